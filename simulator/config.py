"""What a simulation runs: `SimConfig`, every setting of one simulated cluster, validated once.

The CLI (`fairway simulate`), the benches, the experiments and `fairway plan` each build one and
hand it to simulator.driver whole; an error names the field it is about. The router core's own
settings are derived from it (`SimCluster.router_config`), as the proxy derives them from
cluster.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

import policies
from router.budgets import RateLimit
from router.classes import TrafficClass
from router.planner import PlannerConfig
from router.traits import IndexMode, Placement, Role
from simulator.engine import EngineConfig
from simulator.fleet import ModelGroup, parse_fleet
from simulator.topology import Topology

M = TypeVar("M", bound=Enum)


@dataclass(frozen=True)
class SimConfig:
    num_workers: int = 8
    policy: str = "least_load"
    local_policy: str | None = None  # None: the global policy's own default
    policy_params: dict[str, object] = field(default_factory=dict)
    local_params: dict[str, object] = field(default_factory=dict)
    engine: EngineConfig = field(default_factory=EngineConfig)
    closed_loop: bool = False
    # How the router learns what engines cache: approximate believes every routed prompt is
    # cached on its worker (within capacity); precise hears the engines' KV events (blocks
    # stored, evicted), each `kv_event_delay` seconds after it happened. A string is taken as
    # the mode it names, here and for `placement`.
    index: IndexMode = IndexMode.APPROXIMATE
    kv_event_delay: float = 0.0
    # Where the local discipline runs: inside each engine's scheduler, or in the router's
    # per-worker dispatch queue with at most `window` requests in flight at an FCFS engine (how
    # the live proxy keeps tenants fair in front of a stock vLLM).
    placement: Placement = Placement.ENGINE
    window: int = 8
    # (start, end, worker): the router holds the worker down over [start, end), as after failed
    # health checks: its queued requests are routed elsewhere, what its engine runs finishes.
    outages: tuple[tuple[float, float, int], ...] = ()
    # Router replicas behind a load balancer (round robin over arrivals), each with its own
    # index, counters, load accounting and queues, sharing counters and routing decisions every
    # `router_sync` seconds (0: a store written through at once, the replicas as one).
    routers: int = 1
    router_sync: float = 0.0
    # Model groups (simulator.fleet), their workers in order: each group's engines run its own
    # cost model and adapter slots, and `num_workers` is set to their sum. Empty: one group of
    # `num_workers` engines on the cost model `simulate` is given, with `engine`'s slots.
    groups: tuple[ModelGroup, ...] = ()
    # Off: routing ignores which worker holds a request's adapter (the adapter-blind baseline);
    # engines load adapters as ever.
    adapter_affinity: bool = True
    # Traffic classes (router.classes), found by each request's priority: strict bands in
    # every queue, latency targets in the summary. Bands are kept as soon as classes are
    # named or the trace carries more than one priority. `latency_routing` routes a class with
    # a TTFT target among the workers predicted to meet it; `admission` refuses requests no
    # worker is predicted to serve in time and those waiting past their class's queue limit.
    # `priority_scheduling`: banded engines preempt as vLLM's --scheduling-policy priority.
    classes: tuple[TrafficClass, ...] = ()
    latency_routing: bool = False
    admission: bool = False
    priority_scheduling: bool = True
    # Tenant budgets (router.budgets): a client's requests past its token buckets are refused
    # at arrival, as the proxy answers them 429.
    rate_limits: dict[str, RateLimit] = field(default_factory=dict)
    # Split fleets: `prefill_workers` and `decode_workers` of the `num_workers` (the rest
    # mixed; ids run mixed, prefill, decode). Worker i runs on GPU i of `topology`, a preset
    # of simulator.topology or a YAML file, over which each split request's prompt KV moves
    # (less what its decode worker holds already) at `kv_bytes_per_token` (None: the cost
    # model's model's; a fitted profile names none).
    prefill_workers: int = 0
    decode_workers: int = 0
    topology: str = "dgx-h100"
    kv_bytes_per_token: int | None = None
    # A fleet that grows and shrinks (simulator.scaling): `autoscale.max_workers` engines,
    # of which the planner keeps its target serving; `num_workers` is set to the maximum.
    autoscale: PlannerConfig | None = None
    # Least-load decisions (router.policy.LeastLoaded) on a large fleet (the driver's
    # LOAD_FLOORS_MIN_WORKERS or more) read only the engines whose load could be least
    # (simulator.load_floors). Off: every engine with a step ended is brought up to date before
    # each decision (the same records, slower; for checking).
    load_floors: bool = True
    seed: int = 0
    show_progress: bool = False

    def __post_init__(self) -> None:
        if self.autoscale is not None:
            if self.groups or self.prefill_workers or self.decode_workers or self.outages:
                raise ValueError(
                    "autoscale: a fleet of one pool of mixed workers only (no model groups, "
                    "split pools or outages)"
                )
            object.__setattr__(self, "num_workers", self.autoscale.max_workers)
        if self.groups:
            fleet = parse_fleet({"groups": list(self.groups)}, source="config")
            object.__setattr__(self, "groups", fleet.groups)
            object.__setattr__(self, "num_workers", fleet.num_workers)
        if self.num_workers <= 0:
            raise ValueError(f"workers: must be positive, got {self.num_workers}")
        self._check_roles()
        if self.policy not in policies.global_policies:
            known = ", ".join(policies.global_policies.names())
            raise ValueError(f"policy: unknown {self.policy!r}; choose one of: {known}")
        if self.local_policy is not None and self.local_policy not in policies.local_policies:
            known = ", ".join(policies.local_policies.names())
            raise ValueError(f"local_policy: unknown {self.local_policy!r}; choose one of: {known}")
        object.__setattr__(self, "index", _mode(IndexMode, self.index, "index"))
        if self.kv_event_delay < 0:
            raise ValueError(f"kv_event_delay: must be >= 0, got {self.kv_event_delay}")
        object.__setattr__(self, "placement", _mode(Placement, self.placement, "placement"))
        if self.window < 1:
            raise ValueError(f"window: must be at least 1, got {self.window}")
        if self.routers < 1:
            raise ValueError(f"routers: must be at least 1, got {self.routers}")
        if self.router_sync < 0:
            raise ValueError(f"router_sync: must be >= 0, got {self.router_sync}")
        for start, end, worker in self.outages:
            if not 0 <= start < end or not 0 <= worker < self.num_workers:
                raise ValueError(f"outages: ({start}, {end}, {worker}) is not a (start < end, "
                                 f"worker) of this cluster")  # fmt: skip

    @property
    def roles(self) -> list[Role]:
        """Each worker's role, in worker order."""
        p, d = self.prefill_workers, self.decode_workers
        return [Role.MIXED] * (self.num_workers - p - d) + [Role.PREFILL] * p + [Role.DECODE] * d

    @property
    def split(self) -> bool:
        return self.prefill_workers > 0

    def network(self) -> Topology:
        """The topology a split fleet's KV moves over, one GPU per worker."""
        return Topology.named(self.topology, self.num_workers)

    def _check_roles(self) -> None:
        p, d = self.prefill_workers, self.decode_workers
        if p < 0 or d < 0:
            raise ValueError(f"prefill_workers, decode_workers: must be >= 0, got {p}, {d}")
        if not p and not d:
            return
        if p and not d:
            raise ValueError("decode_workers: prefill workers need a decode worker to hand to")
        if d and not p:
            raise ValueError("prefill_workers: decode workers need a prefill worker to feed them")
        if p + d > self.num_workers:
            raise ValueError(
                f"workers: {self.num_workers} cannot hold {p} prefill and {d} decode workers"
            )
        if self.groups:
            raise ValueError("groups: a simulated split fleet has one model group")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token: must be positive, got {self.kv_bytes_per_token}")
        try:
            network = self.network()
        except ValueError as e:
            raise ValueError(f"topology: {e}") from None
        first = self.num_workers - p - d
        decoders = range(first + p, self.num_workers)
        for dst in decoders:  # some prefill worker must reach each decode worker
            reachable = False
            for src in range(first, first + p):
                try:
                    network.path(src, dst)
                except ValueError:
                    continue
                reachable = True
                break
            if not reachable:
                raise ValueError(f"topology: no path to decode worker {dst} from a prefill worker")


def _mode(kind: type[M], value: object, what: str) -> M:
    """`value` as the `kind` member it is or names; a ValueError naming `what` if none."""
    try:
        return kind(value)
    except ValueError:
        names = " or ".join(repr(m.value) for m in kind)
        raise ValueError(f"{what}: {names}, got {value!r}") from None
