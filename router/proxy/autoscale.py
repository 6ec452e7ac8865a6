"""Live autoscaling: the planner run on the proxy's clock, against servers it starts and stops.

    requests ─▶ LiveCluster.route ─▶ cluster.demand (router.scaling.Demand)
                                                        │ every `interval` s
    phases, router queues, vLLM's waiting ─▶ ScalingLoop.decide ─▶ Plan, Moves
                                                        │
      start: Launcher.launch(slot) ─▶ healthy ─▶ added to the cluster ─▶ serving
      drain: routed nothing new (cluster.draining) ─▶ idle ─▶ removed ─▶ Launcher.retire(slot)

The same step (router/scaling.py) decides in the simulator's replay (simulator/scaling.py), so
a plan tried on a trace is the plan the proxy carries out. A slot is one server the fleet may
run (`max_workers` of them, each with its own port); a worker that leaves is drained first: it
is routed nothing new, finishes what it was given (its router queue included), and only then is
removed and stopped, so no request is lost. A start cancelled before its server answered stops
that server as soon as it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from router.planner import Plan, Planner
from router.prefix_index import WorkerId
from router.proxy.driver import LiveCluster
from router.scaling import Demand, Moves, Phase, ScalingLoop

log = logging.getLogger("fairway.autoscale")
POOL = "mixed"  # the one pool an autoscaled fleet has (split fleets are not scaled)
REAP_EVERY = 0.5  # seconds between looks at the draining workers (each stops once idle)


@dataclass(frozen=True, slots=True)
class Server:
    """A started server: where it answers, and its KV events endpoint (vLLM's), if any."""

    url: str
    kv_events: str | None = None


class Launcher(Protocol):
    """Starts and stops the fleet's servers by slot (workers/scaled.py: through Ray)."""

    async def launch(self, slot: int) -> Server:
        """Start slot `slot`'s server; return once it answers its health check."""
        ...

    async def retire(self, slot: int) -> None:
        """Stop slot `slot`'s server (it has nothing left to answer)."""
        ...


class LiveScaler:
    """The fleet's membership while the proxy serves. `serving`: the slots already serving at
    the start and their worker ids (the planner's first workers); `slots`: how many servers the
    fleet may run (the planner's max)."""

    def __init__(
        self,
        cluster: LiveCluster,
        planner: Planner,
        launcher: Launcher,
        serving: dict[int, WorkerId],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        slots = planner.config.max_workers
        assert len(serving) == planner.config.first, "the first workers serve from the start"
        self.cluster, self.launcher, self.clock = cluster, launcher, clock
        self.loop = ScalingLoop(planner, Demand(start=clock()))
        cluster.demand = self.loop.demand
        self.phase = [Phase.SERVING if s in serving else Phase.STOPPED for s in range(slots)]
        self.wid: dict[int, WorkerId] = dict(serving)
        self._generation = [0] * slots  # a start cancelled before it served is stopped after
        self._tasks: set[asyncio.Task] = set()
        self._gauges()

    @property
    def planner(self) -> Planner:
        return self.loop.planner

    # -------------------------------------------------------------- deciding

    def decide(self, now: float | None = None) -> Plan:
        """One decision, at `now` (the clock's by default), and its moves begun."""
        now = self.clock() if now is None else now
        self.reap()
        waiting = sum(self._waiting(s) for s, p in enumerate(self.phase) if p is Phase.SERVING)
        plan, moves = self.loop.decide(now, self.phase, waiting, self._work)
        for slot in moves.revive:
            self.cluster.draining.discard(self.wid[slot])
            self.phase[slot] = Phase.SERVING
        for slot in moves.start:
            self._start(slot)
        for slot in moves.cancel:
            self.phase[slot] = Phase.STOPPED
            self._generation[slot] += 1  # its launch stops the server once it answers
        for slot in moves.drain:
            self.phase[slot] = Phase.DRAINING
            self.cluster.draining.add(self.wid[slot])
        self.reap()
        self.loop.record(now, self.phase)
        if moves != Moves():
            log.info("autoscale: target %d (%s): %s", plan.target, plan.reason, moves)
        self._gauges()
        return plan

    def reap(self) -> None:
        """Stop each draining worker that has nothing left: removed from the router, then its
        server stopped. A worker removed by hand (the admin API) leaves its slot: stopped."""
        for slot, wid in list(self.wid.items()):
            if wid not in self.cluster.workers:
                del self.wid[slot]
                self.phase[slot] = Phase.STOPPED
                self._spawn(self.launcher.retire(slot))
        for slot, p in enumerate(self.phase):
            if p is Phase.DRAINING and self._work(slot) == 0:
                self.phase[slot] = Phase.STOPPED
                self.cluster.remove_worker(self.wid.pop(slot))
                self._spawn(self.launcher.retire(slot))
                self._gauges()

    async def run(self) -> None:
        """Decide every interval (and stop drained workers in between) until cancelled."""
        interval = self.planner.config.interval
        self.loop.demand.start = self.clock()  # the first window opens as the proxy serves
        next_at = self.clock() + interval
        while True:
            await asyncio.sleep(max(0.0, min(REAP_EVERY, next_at - self.clock())))
            now = self.clock()
            deciding = now >= next_at
            try:
                if deciding:
                    self.decide(now)
                else:
                    self.reap()
            except Exception:  # the proxy serves on with the fleet it has; the next look retries
                log.exception("autoscale: a %s failed", "decision" if deciding else "reap")
            if not deciding:
                continue
            next_at += interval
            if next_at <= now:  # a decision late by an interval or more: none bunched after it
                next_at = now + interval

    async def running(self, app: web.Application) -> AsyncIterator[None]:
        """For `app.cleanup_ctx`: the loop while the app serves."""
        task = asyncio.create_task(self.run(), name="fairway-autoscale")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for pending in list(self._tasks):
            pending.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------ membership

    def _start(self, slot: int) -> None:
        self.phase[slot] = Phase.STARTING
        self._generation[slot] += 1
        self._spawn(self._launch(slot, self._generation[slot]))

    async def _launch(self, slot: int, generation: int) -> None:
        try:
            server = await self.launcher.launch(slot)
        except Exception:
            log.exception("autoscale: slot %d did not start", slot)
            if self._generation[slot] == generation:
                self.phase[slot] = Phase.STOPPED  # the next decision starts another
                self._gauges()
            await self.launcher.retire(slot)  # whatever of it did start
            return
        if self._generation[slot] != generation or self.phase[slot] is not Phase.STARTING:
            await self.launcher.retire(slot)  # cancelled while it started
            return
        worker = self.cluster.add_worker_like_peers(server.url, server.kv_events)
        self.wid[slot] = worker.id
        self.phase[slot] = Phase.SERVING
        log.info("autoscale: slot %d serves as worker %d (%s)", slot, worker.id, server.url)
        self._gauges()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---------------------------------------------------------------- state

    def _work(self, slot: int) -> int:
        """Requests the router has given slot's worker and not seen finish (queued or sent)."""
        worker = self.cluster.workers[self.wid[slot]]
        return len(worker.dispatch) + worker.dispatch.in_flight

    def _waiting(self, slot: int) -> int:
        """Requests waiting on slot's worker: in its router queue, and in vLLM's own (as the
        worker last reported it)."""
        worker = self.cluster.workers[self.wid[slot]]
        return len(worker.dispatch) + int(worker.reported.get("waiting", 0))

    def _gauges(self) -> None:
        metrics = self.cluster.metrics
        metrics.pool_target_workers.labels(POOL).set(self.planner.target)
        for phase in (Phase.STARTING, Phase.SERVING, Phase.DRAINING):
            metrics.pool_workers.labels(POOL, phase.value).set(self.phase.count(phase))
