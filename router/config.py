"""RouterConfig: every setting of the router core, validated once and handed down whole.

The simulator (SimConfig), the proxy (cluster.yaml) and tests each build one; the core reads it
and never writes it back. Every default lives here, and `fairway simulate --print-config` and
`fairway serve --print-config` print the one each backend runs with (`describe`), so where the
simulator and the proxy differ shows in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

from router.classes import ClassTable
from router.decode import DEFAULT_SLACK
from router.traits import IndexMode
from router.view import CostEstimates

# vLLM's default max_num_batched_tokens with chunked prefill: a step's token budget.
DEFAULT_STEP_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class RouterConfig:
    block_size: int = 16  # tokens per KV block: the prefix index's unit
    # Requests in flight at each worker; the rest wait in the router's queue, ordered by the
    # local discipline (how the proxy keeps tenants fair in front of a stock vLLM). None: each
    # request is released at once, and the engine's own scheduler runs the discipline (the
    # simulator's engine placement).
    window: int | None = 8
    # The step-cost model behind the view's estimates and TTFT prediction; None: no estimates,
    # so no latency routing or admission control.
    cost: CostEstimates | None = None
    # Approximate: believe a routed prompt is cached on its worker, within capacity. Precise:
    # the workers' KV events fill the index; `keep_approximate` keeps the other beside it.
    index: IndexMode = IndexMode.APPROXIMATE
    keep_approximate: bool = False
    # Estimate each routed request's cached prefix from the index of what was routed even when
    # routing reads no index (a load-only policy, no classes): someone reads the estimates (the
    # proxy's metrics, an autoscaler's demand). False: such a router keeps no index of what it
    # routed, and reports no estimate.
    estimate_hits: bool = True
    kv_capacity_blocks: int = 1 << 20  # a worker's, until it is told its own
    strict: bool = True  # a policy hook that raises stops the run (live: logged and counted)
    # LoRA adapters: seconds to load one where it is not held (the router weighs that against
    # a holder's queue), and whether routing prefers holders at all.
    adapter_load_time: float = 0.0
    adapter_affinity: bool = True
    # Traffic classes: strict priority bands in every queue, and each request's predicted TTFT.
    # None: no bands. `latency_routing` routes a class with a TTFT target among the workers
    # predicted to meet it; `admission` refuses a request none is predicted to serve in time.
    classes: ClassTable | None = None
    latency_routing: bool = False
    admission: bool = False
    step_tokens: int = DEFAULT_STEP_TOKENS  # the workers' step budget: prefills are chunked by it
    decode_slack: int = DEFAULT_SLACK  # router.decode: how much busier a decode-side hit may be

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {self.block_size}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window: must be at least 1, got {self.window}")
        object.__setattr__(self, "index", _index_mode(self.index))
        if self.kv_capacity_blocks <= 0:
            raise ValueError(f"kv_capacity_blocks: must be positive, got {self.kv_capacity_blocks}")
        if self.adapter_load_time < 0:
            raise ValueError(f"adapter_load_time: must be >= 0, got {self.adapter_load_time}")
        if self.step_tokens <= 0:
            raise ValueError(f"step_tokens: must be positive, got {self.step_tokens}")
        if self.decode_slack < 0:
            raise ValueError(f"decode_slack: must be >= 0, got {self.decode_slack}")
        if (self.latency_routing or self.admission) and self.cost is None:
            raise ValueError("cost: latency routing and admission control need a step-cost model")

    @property
    def is_precise(self) -> bool:
        return self.index is IndexMode.PRECISE

    @property
    def is_banded(self) -> bool:
        return self.classes is not None

    @property
    def predicts_latency(self) -> bool:
        """A request's TTFT is predicted at routing and may decide where it goes or whether."""
        return self.is_banded and (self.latency_routing or self.admission)

    def describe(self) -> dict[str, object]:
        """Every setting as a user reads it: the cost model by name, classes as their names."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "cost":
                value = None if value is None else getattr(value, "name", type(value).__name__)
            elif f.name == "classes":
                value = None if value is None else [c.name for c in value]
            elif isinstance(value, IndexMode):
                value = value.value
            out[f.name] = value
        return out


def slowest_adapter_load(load_times: Iterable[float]) -> float:
    """The one adapter load time a router weighs for a fleet of several model groups: the
    longest of any group's, so it never spills a request to a load it believes cheaper than it
    is (a group that loads faster keeps to its holders a little longer than it need)."""
    return max(load_times, default=0.0)


def _index_mode(value: object) -> IndexMode:
    try:
        return IndexMode(value)
    except ValueError:
        names = " or ".join(repr(m.value) for m in IndexMode)
        raise ValueError(f"index: {names}, got {value!r}") from None
