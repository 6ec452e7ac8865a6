"""Workers joining and leaving a replay: the planner (router.planner) run in SimPy time.

Every engine of the largest fleet exists from the start; those not in the fleet are down in
each router (routed nothing). Each interval the planner hears what arrived and sets a target,
and the fleet moves towards it (router/scaling.py decides, for this driver and the live proxy
alike; a start serves `startup` s later).

A started worker serves cold: its engine's cache is emptied and the router forgot what it held
when it stopped. A draining worker is routed nothing new but keeps what it was given (its router
queue included) until it has finished it; then it stops. GPU time counts from a start to a stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import simpy

from router.core import Router
from router.planner import Plan, Planner, PlannerConfig
from router.request import Request
from router.scaling import Phase, ScalingLoop
from simulator.engine import Engine


class Scaler:
    """The fleet's membership over a run, driven by `planner`. `routers` and `engines` are the
    cluster's (engine i is worker i); `sync(now)` brings the engines' steps up to `now`."""

    def __init__(
        self,
        env: simpy.Environment,
        planner: Planner,
        routers: Sequence[Router],
        engines: Sequence[Engine],
        sync: Callable[[float], None],
    ) -> None:
        self.env, self.routers, self.engines = env, routers, engines
        self.loop = ScalingLoop(planner)
        self._sync = sync
        config: PlannerConfig = planner.config
        self.config = config
        n = len(engines)
        self.phase = [Phase.SERVING if w < config.first else Phase.STOPPED for w in range(n)]
        self.draining: set[int] = set()  # routing excludes these (they are healthy still)
        self._started_at: list[float | None] = [0.0 if w < config.first else None for w in range(n)]
        self._generation = [0] * n  # a start cancelled before it served ignores its timer
        self.gpu_seconds = 0.0
        for w in range(config.first, n):
            for router in routers:
                router.worker_down(w, 0.0)

    # ------------------------------------------------------------ from the driver

    @property
    def planner(self) -> Planner:
        return self.loop.planner

    @planner.setter
    def planner(self, planner: Planner) -> None:  # another planner, before the run starts
        self.loop.planner = planner

    @property
    def plans(self) -> list[Plan]:
        return self.loop.plans

    @property
    def series(self) -> list[tuple[float, int, int]]:
        return self.loop.series

    def arrived(self, req: Request) -> None:
        self.loop.demand.arrived(req)

    def routed(self, req: Request, hit_tokens: int) -> None:
        self.loop.demand.routed(req, hit_tokens)

    def finished(self, worker: int) -> None:
        """A request on `worker` ended: a draining worker with nothing left stops."""
        if self.phase[worker] is Phase.DRAINING and self._idle(worker):
            self._stop(worker)

    def run(self, done: Callable[[], bool]) -> simpy.events.ProcessGenerator:
        """Decide every interval until `done()`."""
        interval = self.config.interval
        while not done():
            yield self.env.timeout(interval)
            self.decide()

    def close(self, end: float) -> None:
        """The run ended at `end`: every worker still up stops there."""
        for w, started in enumerate(self._started_at):
            if started is not None:
                self.gpu_seconds += max(end - started, 0.0)
                self._started_at[w] = None

    # -------------------------------------------------------------- deciding

    def decide(self) -> Plan:
        now = self.env.now
        self._sync(now)
        for w in sorted(self.draining):  # one whose last request was withdrawn, not finished
            if self._idle(w):
                self._stop(w)
        serving = [w for w, p in enumerate(self.phase) if p is Phase.SERVING]
        waiting = sum(
            len(self.engines[w].waiting) + sum(len(r.queues[w]) for r in self.routers)
            for w in serving
        )
        plan, moves = self.loop.decide(now, self.phase, waiting, self._work)
        for w in moves.revive:
            self.draining.discard(w)
            self.phase[w] = Phase.SERVING
        for w in moves.start:
            self._start(w)
        for w in moves.cancel:
            self._stop(w)
        for w in moves.drain:
            self._drain(w)
        self.loop.record(now, self.phase)
        return plan

    # ------------------------------------------------------------ membership

    def _start(self, w: int) -> None:
        self.phase[w] = Phase.STARTING
        self._started_at[w] = self.env.now
        self._generation[w] += 1
        generation = self._generation[w]
        self.env.timeout(self.config.startup).callbacks.append(
            lambda _: self._serve(w) if self._generation[w] == generation else None
        )

    def _serve(self, w: int) -> None:
        """Started: cold (an empty cache, no adapters), then routed to."""
        engine = self.engines[w]
        engine.blocks.reset_prefix_cache()
        engine.adapters.clear()
        self.phase[w] = Phase.SERVING
        for router in self.routers:
            router.worker_up(w)

    def _drain(self, w: int) -> None:
        self.phase[w] = Phase.DRAINING
        self.draining.add(w)
        if self._idle(w):
            self._stop(w)

    def _stop(self, w: int) -> None:
        now = self.env.now
        was = self.phase[w]
        self.phase[w] = Phase.STOPPED
        self.draining.discard(w)
        self._generation[w] += 1
        started = self._started_at[w]
        if started is not None:
            self.gpu_seconds += now - started
            self._started_at[w] = None
        if was is not Phase.STARTING:  # a start never served: the routers still hold it down
            for router in self.routers:
                queued = router.worker_down(w, now)  # forgets what it cached
                if queued:
                    raise RuntimeError(f"worker {w} stopped with {len(queued)} requests queued")

    def _idle(self, w: int) -> bool:
        """Nothing queued at `w` or sent to it unfinished, as its routers count (they hear of
        each finish as its engine applies it, so an engine mid-step is never taken for idle)."""
        return all(len(r.queues[w]) == 0 and r.queues[w].in_flight == 0 for r in self.routers)

    def _work(self, w: int) -> int:
        return len(self.engines[w].waiting) + len(self.engines[w].running)

    # ---------------------------------------------------------------- output

    def summary(self) -> dict[str, object]:
        return {
            "gpu_seconds": self.gpu_seconds,
            "workers_over_time": [list(point) for point in self.series],
            "autoscale_decisions": self.loop.decisions(),
        }
