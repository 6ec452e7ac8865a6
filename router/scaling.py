"""One autoscaling step, shared by the simulator's replay and the live proxy:

    arrived / routed ──▶ Demand ──close(now)──▶ Window ─┐
    phases, waiting  ──────────────────────────▶ Fleet ─┼─▶ Planner.decide ─▶ Plan
                                                        │                       │
    phases, each worker's work ────────────────────────-┴──▶ moves(target) ◀───-┘

A driver supplies time, its workers' phases and what waits on them, and carries out the moves
(SimPy timers in simulator/scaling.py; servers started and stopped through Ray in
router/proxy/autoscale.py). Every choice (what the planner hears, which worker starts, which
drains) is made here, once, so the two drivers decide alike on the same arrivals.

    stopped ──start──▶ starting ──started──▶ serving ──drain──▶ draining ──idle──▶ stopped
                          │ (cancelled when the target falls) ▲          │
                          └──────────────────────────────────-┼──────────┘ (revived: serves on)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from router.planner import Fleet, Plan, Planner, Window
from router.request import Request


class Phase(str, Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"


@dataclass(slots=True)
class Demand:
    """What arrived since the last decision: counted on a request's first routing only (a
    retry is no new demand), with the prompt tokens routing expected to find cached."""

    start: float = 0.0
    arrivals: int = 0
    prompt: int = 0
    output: int = 0
    cached: int = 0

    def arrived(self, req: Request) -> None:
        self.arrivals += 1
        self.prompt += req.prompt_len
        self.output += req.output_len

    def routed(self, req: Request, hit_tokens: int) -> None:
        self.cached += min(hit_tokens, req.prompt_len)

    def close(self, now: float) -> Window:
        """The window since the last close, and a fresh one from `now`."""
        window = Window(self.start, now, self.arrivals, self.prompt, self.output, self.cached)
        self.start, self.arrivals, self.prompt, self.output, self.cached = now, 0, 0, 0, 0
        return window


@dataclass(frozen=True, slots=True)
class Moves:
    """What a decision asks of the fleet, by worker: draining ones to serve on, stopped ones to
    start, starting ones to cancel, serving ones to drain."""

    revive: tuple[int, ...] = ()
    start: tuple[int, ...] = ()
    cancel: tuple[int, ...] = ()
    drain: tuple[int, ...] = ()


def moves(phase: Sequence[Phase], target: int, work: Callable[[int], int]) -> Moves:
    """The moves that bring the committed workers (serving and starting) to `target`. Up: a
    draining worker serves on (warm, at once) before a stopped one starts, lowest id first.
    Down: a start not yet serving is cancelled first (highest id first), then the serving
    worker with the least `work` drains (the highest id among equals)."""
    committed = sum(1 for p in phase if p in (Phase.SERVING, Phase.STARTING))
    if committed < target:
        revive = [w for w, p in enumerate(phase) if p is Phase.DRAINING][: target - committed]
        stopped = [w for w, p in enumerate(phase) if p is Phase.STOPPED]
        start = stopped[: target - committed - len(revive)]
        return Moves(revive=tuple(revive), start=tuple(start))
    excess = committed - target
    if excess <= 0:
        return Moves()
    starting = [w for w in reversed(range(len(phase))) if phase[w] is Phase.STARTING]
    cancel = starting[:excess]
    serving = [w for w, p in enumerate(phase) if p is Phase.SERVING]
    drain = sorted(serving, key=lambda w: (work(w), -w))[: excess - len(cancel)]
    return Moves(cancel=tuple(cancel), drain=tuple(drain))


@dataclass
class ScalingLoop:
    """The planner fed from a driver's state, each decision kept (`plans`) with the workers
    serving and the target after it (`series`: (time, serving, target))."""

    planner: Planner
    demand: Demand = field(default_factory=Demand)
    plans: list[Plan] = field(default_factory=list)
    series: list[tuple[float, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        first = self.planner.config.first
        self.series.append((self.demand.start, first, first))

    def decide(
        self, now: float, phase: Sequence[Phase], waiting: int, work: Callable[[int], int]
    ) -> tuple[Plan, Moves]:
        """The plan after the window ending `now`, and the moves towards it. `waiting`: the
        requests waiting on the serving workers, summed; `work(w)`: worker w's requests."""
        serving = sum(1 for p in phase if p is Phase.SERVING)
        starting = sum(1 for p in phase if p is Phase.STARTING)
        plan = self.planner.decide(self.demand.close(now), Fleet(serving, starting, waiting))
        self.plans.append(plan)
        return plan, moves(phase, plan.target, work)

    def record(self, now: float, phase: Sequence[Phase]) -> None:
        """The fleet once a decision's moves are made."""
        serving = sum(1 for p in phase if p is Phase.SERVING)
        self.series.append((now, serving, self.planner.target))

    def decisions(self) -> dict[str, int]:
        """How many decisions gave each reason."""
        reasons = sorted({p.reason for p in self.plans})
        return {reason: sum(1 for p in self.plans if p.reason == reason) for reason in reasons}
