"""What a fairness policy charges a client for a request, and when (VTC, DLPM, D²LPM).

VTC (Sheng et al., OSDI'24) counts service with a cost function h(n_in, n_out) of a request's
input and output tokens. Two shapes, as the paper's artifact (Ying1123/VTC-artifact) has them:

    linear     h(x, y) = w_in x + w_out y                      the paper's default (1, 2)
    profiled   h(x, y) = a x + b y + c x y + d y^2 + e         fitted to measured prefill and
                                                              decode times; the coefficients
                                                              default to the artifact's fit
                                                              (LLaMA-7B on an A10G, in ms)

The input part h(x, 0) is charged when a request starts; the output part h(x, n) - h(x, 0)
either grows with each generated token (`on_token`, the paper's), or (`predicted`, the
artifact's "predict" variant) is charged up front for an output length predicted from the
client's past requests (a moving average over the last `predict_window`), grows only once the
real output passes the prediction, and is corrected to the real length at the finish. So a
finished request always costs exactly h(x, n); the prediction only moves the charge earlier.
Charges are divided by the request's weight. DLPM and D²LPM pass the extend (uncached) tokens
as x, VTC the whole prompt.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

from router.request import Request

COSTS = ("linear", "profiled")
CHARGE_OUTPUT = ("on_token", "predicted")

# The VTC artifact's fit (fair_bench/profile_cost_function.py): a, b, c, d, e.
VTC_PROFILE = (0.21001891, 0.10075395, 0.0039868, 0.00324733, 1.14601454)


class CostFunction(Protocol):
    def input(self, num_input: int) -> float:
        """h(x, 0): the charge for starting a request with `num_input` input tokens."""
        ...

    def output(self, num_input: int, num_output: float) -> float:
        """h(x, y) - h(x, 0): the charge for `num_output` output tokens in all."""
        ...


@dataclass(slots=True, frozen=True)
class LinearCost:
    w_in: float = 1.0
    w_out: float = 2.0

    def input(self, num_input: int) -> float:
        return self.w_in * num_input

    def output(self, num_input: int, num_output: float) -> float:
        return self.w_out * num_output


@dataclass(slots=True, frozen=True)
class ProfiledCost:
    """h(x, y) = a x + b y + c x y + d y^2 + e: a token costs more late in a long request."""

    a: float
    b: float
    c: float
    d: float
    e: float

    def input(self, num_input: int) -> float:
        return self.a * num_input + self.e

    def output(self, num_input: int, num_output: float) -> float:
        y = num_output
        return self.b * y + self.c * num_input * y + self.d * y * y


def make_cost(cost: str, w_in: float, w_out: float, cost_coeffs: tuple[float, ...]) -> CostFunction:
    """The cost function a policy's parameters name; a bad one is a ValueError naming it."""
    if cost == "linear":
        return LinearCost(w_in, w_out)
    if cost == "profiled":
        if len(cost_coeffs) != 5 or not all(math.isfinite(v) and v >= 0 for v in cost_coeffs):
            raise ValueError(
                f"cost_coeffs: five non-negative numbers a, b, c, d, e of "
                f"h(x, y) = a x + b y + c x y + d y^2 + e, got {list(cost_coeffs)}"
            )
        return ProfiledCost(*cost_coeffs)
    raise ValueError(f"cost: one of {', '.join(COSTS)}, got {cost!r}")


@dataclass(slots=True)
class _Started:
    num_input: int
    num_output: int = 0
    charged_output: float = 0.0  # the output part charged so far (before the weight)


class ServiceMeter:
    """Charges of the requests a policy has started, per the cost function and charge mode.

    Each method returns the (weighted) amount to add to the client's account now. A request
    the meter did not start (it was rebuilt under it, or the request went elsewhere) costs
    nothing: the hooks of a failure path may name one.
    """

    def __init__(
        self, cost: CostFunction, charge_output: str = "on_token", predict_window: int = 5
    ) -> None:
        if charge_output not in CHARGE_OUTPUT:
            raise ValueError(
                f"charge_output: one of {', '.join(CHARGE_OUTPUT)}, got {charge_output!r}"
            )
        if predict_window < 1:
            raise ValueError(f"predict_window: must be at least 1, got {predict_window}")
        self.cost = cost
        # `tokens` runs per request per engine catch-up in a simulation: with the linear cost
        # it computes LinearCost.output's product itself, the same arithmetic without a call.
        self._w_out = cost.w_out if type(cost) is LinearCost else None
        self.is_predicted = charge_output == "predicted"
        self.predict_window = predict_window
        self.predicted: dict[str, float] = {}  # client -> predicted output length
        self._started: dict[int, _Started] = {}

    def is_started(self, request: Request) -> bool:
        return request.id in self._started

    def start(self, request: Request, num_input: int) -> float:
        """`request` starts with `num_input` input tokens to charge. Once per request: a
        preempted request's recompute is not service."""
        if request.id in self._started:
            return 0.0
        started = self._started[request.id] = _Started(num_input)
        if self.is_predicted:
            guess = self.predicted.get(request.client, 0.0)
            started.charged_output = self.cost.output(num_input, guess)
        return (self.cost.input(num_input) + started.charged_output) / request.weight

    def tokens(self, request: Request, num_tokens: int) -> float:
        started = self._started.get(request.id)
        if started is None:
            return 0.0
        started.num_output += num_tokens
        w_out = self._w_out
        if w_out is not None:
            due = w_out * started.num_output
        else:
            due = self.cost.output(started.num_input, started.num_output)
        if due <= started.charged_output:
            return 0.0  # still within what the prediction charged
        charge, started.charged_output = due - started.charged_output, due
        return charge / request.weight

    def charge_tokens(
        self,
        requests: Iterable[Request],
        num_tokens: int,
        accounts: dict[Hashable, float],
        sign: float,
        account_of: Callable[[Request], Hashable] | None = None,
    ) -> None:
        """`tokens` for each of a batch, added to (sign 1) or taken from (sign -1) its account
        (`account_of` the request, None: its client): each account is written once, with the
        value a write per request gives."""
        # The client read here, not through a key function: compiled, calling one (an
        # attrgetter) is a generic call and a lookup by name, about 230 instructions a request
        # charged, and VTC charges each running request at every settle.
        # The account charged last runs in a local: a batch's requests mostly share a client,
        # and a dict read and write per request cost about as much as its charge. Each
        # account's value is summed in the same order as one write per request would, and an
        # account goes into `values` as its first run ends, so in the order of first charges.
        values: dict[Hashable, float] = {}
        key: Hashable = None
        value = 0.0
        running = False
        for request in requests:
            charge = self.tokens(request, num_tokens)
            if not charge:
                continue
            this = request.client if account_of is None else account_of(request)
            if running and this == key:
                value += sign * charge
                continue
            if running:
                values[key] = value
            key, running = this, True
            held = values.get(key)
            value = (accounts.get(key, 0.0) if held is None else held) + sign * charge
        if running:
            values[key] = value
        for account, total in values.items():
            accounts[account] = total

    def finish(self, request: Request) -> float:
        """`request` ended (or was taken back after it had run): settle its output charge to
        the real length (a refund of what the prediction over-charged) and forget it."""
        started = self._started.pop(request.id, None)
        if started is None:
            return 0.0
        if self.is_predicted:
            old = self.predicted.get(request.client)
            n = started.num_output
            window = self.predict_window
            self.predicted[request.client] = n if old is None else (old * (window - 1) + n) / window
        due = self.cost.output(started.num_input, started.num_output)
        return (due - started.charged_output) / request.weight

    def refund(self, request: Request) -> float:
        """`request` never ran after all (withdrawn): everything it was charged, negated."""
        started = self._started.pop(request.id, None)
        if started is None:
            return 0.0
        charged = self.cost.input(started.num_input) + started.charged_output
        return -charged / request.weight
