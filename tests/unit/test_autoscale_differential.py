"""The simulator's autoscaling and the live proxy's decide alike on the same arrivals: a ramp is
replayed in the simulator, and the same requests are routed through the live cluster at the
same (fake) times, each finished when the simulator finished it, its servers started in the
planner's start-up time; the two make the same decisions, one for one.

Both run router/scaling.py's step; what this checks is that each driver feeds it the same
state (arrivals, lengths and expected hits, workers by phase, what waits) and carries out its
moves in the same way (a start serving after its start-up, a drain stopping once idle)."""

from __future__ import annotations

import asyncio
import heapq

import numpy as np
import pytest

import policies
from router.config import RouterConfig
from router.cost_model import roofline
from router.planner import Plan, Planner, PlannerConfig
from router.proxy.autoscale import LiveScaler, Server
from router.proxy.driver import LiveCluster
from simulator.config import SimConfig
from simulator.driver import SimCluster
from traces.generators import shared_prefix
from traces.schema import Trace

COST = roofline("llama-2-13b", "l40s")
PLANNER = PlannerConfig.parse("min=1,max=6,startup=20,interval=5,cooldown=10")
POLICY = "round_robin"  # the same routing in both, whatever load each driver reports


def ramp(peak: float, duration: float, seed: int = 3) -> Trace:
    """Shared-prefix requests whose rate rises from 0.5/s to `peak` over the first half of
    `duration` and falls back over the second."""
    grid = np.linspace(0.0, duration, 2001)
    rate = 0.5 + (peak - 0.5) * (1 - np.abs(2 * grid / duration - 1))
    cumulative = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(grid))])
    trace = shared_prefix(num_requests=int(cumulative[-1]), rate=1.0, prefix_tokens=400,
                          question_tokens=60, output_tokens=40, seed=seed)  # fmt: skip
    for r in trace.requests:
        r.arrival = float(np.interp(r.arrival, cumulative, grid))
    return Trace(trace.requests, trace.block_size, source="generated:ramp")


class ClockLauncher:
    """Servers that answer `startup` seconds (on the test's clock) after their launch."""

    def __init__(self, clock: list[float], startup: float) -> None:
        self.clock, self.startup = clock, startup
        self.pending: list[tuple[float, int, asyncio.Future[Server]]] = []
        self.retired: list[int] = []

    async def launch(self, slot: int) -> Server:
        ready: asyncio.Future[Server] = asyncio.get_running_loop().create_future()
        heapq.heappush(self.pending, (self.clock[0] + self.startup, slot, ready))
        return await ready

    async def retire(self, slot: int) -> None:
        self.retired.append(slot)

    def due(self) -> float:
        return self.pending[0][0] if self.pending else float("inf")

    def answer(self) -> None:
        _, slot, ready = heapq.heappop(self.pending)
        ready.set_result(Server(f"http://127.0.0.1:{9000 + slot}"))


def simulated(trace: Trace) -> tuple[list[Plan], dict[int, float], RouterConfig]:
    """The simulator's decisions, when it finished each request, and its router's settings.
    Its routers keep each worker's queue, as the proxy does (`placement` router)."""
    config = SimConfig(policy=POLICY, autoscale=PLANNER, placement="router")
    cluster = SimCluster(trace, COST, config)
    result = cluster.run()
    assert cluster.scaler is not None
    assert result.summary["completed"] == len(trace), "every request answered"
    finish = {r.id: r.finish for r in result.records}
    return list(cluster.scaler.plans), finish, cluster.router_config


def live(
    trace: Trace, finish: dict[int, float], decisions: int, config: RouterConfig
) -> list[Plan]:
    """The live proxy's decisions on the same requests, at the same times."""
    clock = [0.0]
    policy = policies.global_policies.build(POLICY, {})
    local = "fcfs"
    cluster = LiveCluster(
        policy, lambda: policies.local_policies.build(local, {}), config, clock=lambda: clock[0]
    )
    first = cluster.add_worker("http://127.0.0.1:9000")
    launcher = ClockLauncher(clock, PLANNER.startup)
    scaler = LiveScaler(
        cluster, Planner(PLANNER, COST), launcher, {0: first.id}, clock=lambda: clock[0]
    )
    by_id = {r.id: r for r in trace.requests}
    # (time, order at that time, kind, request id): a start due at a decision serves at it,
    # as a SimPy timer scheduled before the decision's.
    events = [(r.arrival, 2, "arrive", r.id) for r in trace.requests]
    events += [(finish[i], 2, "finish", i) for i in finish]
    events += [(PLANNER.interval * (k + 1), 1, "decide", -1) for k in range(decisions)]
    heapq.heapify(events)

    async def settle() -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    async def go() -> None:
        at: dict[int, tuple] = {}
        while events:
            t, _, kind, rid = heapq.heappop(events)
            while launcher.due() <= t:
                clock[0] = launcher.due()
                launcher.answer()
                await settle()  # the launch goes on: the worker joins
            clock[0] = t
            if kind == "decide":
                scaler.decide(t)
                await settle()  # the launches it began start
            elif kind == "arrive":
                req = by_id[rid]
                worker, _, sent = cluster.route(req)
                at[rid] = worker, req, sent
            else:
                worker, req, sent = at.pop(rid)
                assert sent.done(), f"request {rid} finished in the simulator, queued here"
                cluster.release(worker, req, req.output_len)
                scaler.reap()

    asyncio.run(go())
    return scaler.loop.plans


@pytest.fixture(scope="module")
def both() -> tuple[list[Plan], list[Plan]]:
    sim_plans, finish, config = simulated(ramp(peak=12.0, duration=200.0))
    fresh = ramp(peak=12.0, duration=200.0)  # the same requests, untouched by the replay
    return sim_plans, live(fresh, finish, len(sim_plans), config)


def test_the_same_decisions(both) -> None:
    sim, live_plans = both
    assert [p.target for p in sim] == [p.target for p in live_plans]
    assert [p.reason for p in sim] == [p.reason for p in live_plans]
    # What waits inside a simulated engine (dispatched, not yet scheduled) the proxy learns
    # only from vLLM's scraped gauge, which these workers do not have: a request or two
    # waiting there moves the projection by 1/(startup + interval) each.
    per_waiting = 1 / (PLANNER.startup + PLANNER.interval)
    for s, lv in zip(sim, live_plans, strict=True):
        assert lv.needed == s.needed
        assert lv.worker_rate == pytest.approx(s.worker_rate)
        assert abs(lv.projected_rate - s.projected_rate) <= 2 * per_waiting + 1e-9


def test_the_ramp_scales_up_and_back_down(both) -> None:
    sim, _ = both
    targets = [p.target for p in sim]
    assert max(targets) >= 3, targets
    assert targets[-1] < max(targets), targets
