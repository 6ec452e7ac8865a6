"""The parameters of a fairness policy's service meter, as users set them (VTC, DLPM, D²LPM).

Apart from policies/service_cost.py because that module is compiled, and a compiled dataclass
keeps no annotation the registry could check a user's value against.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.service_cost import VTC_PROFILE, ServiceMeter, make_cost


@dataclass(slots=True, frozen=True)
class ServiceCostParams:
    """What a fairness policy charges and when (policies/service_cost.py), the same on VTC,
    DLPM and D²LPM. A policy takes them as one object; users still name each one
    (`--param w_out=3`), and the registry gathers them (router/registry.py). A bad value is a
    ValueError naming its parameter, on construction."""

    w_in: float = 1.0
    w_out: float = 2.0
    cost: str = "linear"
    cost_coeffs: tuple[float, float, float, float, float] = VTC_PROFILE
    charge_output: str = "on_token"
    predict_window: int = 5

    def __post_init__(self) -> None:
        self.meter()

    def meter(self) -> ServiceMeter:
        """A new meter charging by these parameters."""
        cost = make_cost(self.cost, self.w_in, self.w_out, self.cost_coeffs)
        return ServiceMeter(cost, self.charge_output, self.predict_window)


DEFAULT_SERVICE_COST = ServiceCostParams()  # VTC's: linear, w_in 1, w_out 2, charged per token
