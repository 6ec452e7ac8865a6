"""The live autoscaling loop (router/proxy/autoscale.py) on a fake clock and a fake launcher:
a drained worker is routed nothing new, finishes what it has and only then is removed and its
server stopped; a start cancelled before its server answers stops that server; a start that
fails frees its slot; the gauges follow. And the moves router/scaling.py picks."""

from __future__ import annotations

import asyncio
import time

import pytest

import policies
from router.config import RouterConfig
from router.planner import Fleet, Plan, Planner, PlannerConfig, Window
from router.proxy.autoscale import LiveScaler, Server
from router.proxy.driver import LiveCluster
from router.scaling import Moves, Phase, moves
from tests.helpers import COST, make_req

S, R, D, X = Phase.SERVING, Phase.STARTING, Phase.DRAINING, Phase.STOPPED


class TestMoves:
    @pytest.mark.parametrize(
        ("phase", "target", "expected"),
        [
            ([S, X, X], 3, Moves(start=(1, 2))),
            ([S, D, X], 3, Moves(revive=(1,), start=(2,))),
            ([S, D, D], 2, Moves(revive=(1,))),
            ([S, R, R], 1, Moves(cancel=(2, 1))),
            ([S, S, R], 1, Moves(cancel=(2,), drain=(1,))),
            ([S, S, S], 2, Moves(drain=(2,))),
            ([S, S, X], 2, Moves()),
        ],
    )
    def test_table(self, phase, target, expected) -> None:
        assert moves(phase, target, lambda w: 0) == expected

    def test_the_least_busy_drains(self) -> None:
        work = {0: 3, 1: 0, 2: 5}
        assert moves([S, S, S], 1, work.__getitem__) == Moves(drain=(1, 0))


class Script(Planner):
    """A planner whose targets are given in turn."""

    def __init__(self, config: PlannerConfig, targets: list[int]) -> None:
        super().__init__(config, COST)
        self.targets = iter(targets)

    def decide(self, window: Window, fleet: Fleet) -> Plan:
        self.target = next(self.targets)
        return Plan(self.target, "scripted", 0.0, 0.0, self.target)


class Launcher:
    def __init__(self) -> None:
        self.ready: dict[int, asyncio.Future[Server]] = {}
        self.retired: list[int] = []

    async def launch(self, slot: int) -> Server:
        self.ready[slot] = asyncio.get_running_loop().create_future()
        return await self.ready[slot]

    async def retire(self, slot: int) -> None:
        self.retired.append(slot)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def fleet(
    targets: list[int], window: int = 1, interval: float | None = None, script: type = Script
) -> tuple[LiveCluster, LiveScaler, Launcher]:
    """One worker serving, up to three, the planner's targets `targets` in turn. `interval`:
    decided every `interval` s on the real clock (None: a clock stopped at 0, decided by hand)."""
    clock = time.monotonic if interval is not None else lambda: 0.0
    policy = policies.global_policies.build("least_load", {})
    cluster = LiveCluster(
        policy,
        lambda: policies.local_policies.build("fcfs", {}),
        RouterConfig(block_size=16, cost=COST, window=window),
        clock=clock,
    )
    first = cluster.add_worker("http://127.0.0.1:9000")
    launcher = Launcher()
    timing = {"interval": interval} if interval is not None else {}
    config = PlannerConfig(min_workers=1, max_workers=3, **timing)  # type: ignore[arg-type]
    scaler = LiveScaler(cluster, script(config, targets), launcher, {0: first.id}, clock)
    return cluster, scaler, launcher


def gauges(cluster: LiveCluster) -> tuple[float, ...]:
    m = cluster.metrics
    values = [m.pool_target_workers.labels("mixed")._value.get()]
    values += [m.pool_workers.labels("mixed", p)._value.get() for p in ("starting", "serving")]
    values += [m.pool_workers.labels("mixed", "draining")._value.get()]
    return tuple(values)


class TestLiveScaler:
    def test_a_start_serves_once_its_server_answers(self) -> None:
        async def go() -> None:
            cluster, scaler, launcher = fleet([2])
            scaler.decide()
            await settle()
            assert scaler.phase[:2] == [S, R] and len(cluster.workers) == 1
            assert gauges(cluster) == (2, 1, 1, 0)
            launcher.ready[1].set_result(Server("http://127.0.0.1:9001", "ipc://kv-1"))
            await settle()
            assert scaler.phase[:2] == [S, S]
            added = cluster.workers[scaler.wid[1]]
            assert (added.url, added.kv_events) == ("http://127.0.0.1:9001", "ipc://kv-1")
            assert gauges(cluster) == (2, 0, 2, 0)

        asyncio.run(go())

    def test_a_drained_worker_finishes_what_it_has_then_stops(self) -> None:
        async def go() -> None:
            cluster, scaler, launcher = fleet([2, 1])
            scaler.decide()
            await settle()
            launcher.ready[1].set_result(Server("http://127.0.0.1:9001"))
            await settle()
            # Two requests on each worker: one sent (the window is 1), one queued.
            held = {}
            for i in range(4):
                req = make_req(i, [100 + i])
                worker, _, sent = cluster.route(req)
                held[i] = (worker, req, sent)
            busy = {wid: len(w.dispatch) + w.dispatch.in_flight for wid, w in
                    cluster.workers.items()}  # fmt: skip
            assert set(busy.values()) == {2}
            scaler.decide()  # target 1: the highest slot drains (equal work)
            draining = scaler.wid[1]
            assert scaler.phase[1] is D and cluster.draining == {draining}
            assert gauges(cluster) == (1, 0, 1, 1)
            for i in range(4, 8):  # routed nothing new
                worker, _, _ = cluster.route(make_req(i, [200 + i]))
                assert worker.id != draining
            ours = [(w, r, f) for w, r, f in held.values() if w.id == draining]
            for worker, req, sent in ours:
                await asyncio.wait_for(sent, 1)  # its queue goes on: nothing withdrawn
                scaler.reap()
                assert draining in cluster.workers, "stopped only once idle"
                cluster.release(worker, req, 10)
            scaler.reap()
            assert draining not in cluster.workers and scaler.phase[1] is X
            await settle()
            assert launcher.retired == [1]
            assert gauges(cluster) == (1, 0, 1, 0)

        asyncio.run(go())

    def test_a_cancelled_start_stops_its_server_when_it_answers(self) -> None:
        async def go() -> None:
            cluster, scaler, launcher = fleet([3, 1])
            scaler.decide()
            await settle()
            scaler.decide()
            assert scaler.phase == [S, X, X] and gauges(cluster) == (1, 0, 1, 0)
            for slot in (1, 2):
                launcher.ready[slot].set_result(Server(f"http://127.0.0.1:900{slot}"))
            await settle()
            assert sorted(launcher.retired) == [1, 2] and len(cluster.workers) == 1

        asyncio.run(go())

    def test_a_failed_start_frees_its_slot(self) -> None:
        async def go() -> None:
            cluster, scaler, launcher = fleet([2, 2])
            scaler.decide()
            await settle()
            launcher.ready[1].set_exception(RuntimeError("no GPU"))
            await settle()
            assert scaler.phase[1] is X and launcher.retired == [1]
            scaler.decide()  # the target still stands: started again
            await settle()
            assert scaler.phase[1] is R

        asyncio.run(go())

    def test_only_first_routings_are_demand(self) -> None:
        async def go() -> None:
            cluster, scaler, _ = fleet([1])
            worker, _, _ = cluster.route(make_req(0, [1, 2]))
            with pytest.raises(Exception, match="no healthy worker"):
                cluster.route(make_req(1, [3]), exclude={worker.id})  # a retry
            demand = scaler.loop.demand
            assert demand.arrivals == 1 and demand.prompt == make_req(0, [1, 2]).prompt_len

        asyncio.run(go())

    def test_the_loop_decides_every_interval_until_the_app_stops(self) -> None:
        async def go() -> None:
            _, scaler, _ = fleet([1] * 100, interval=0.05)
            running = scaler.running(None)  # type: ignore[arg-type]
            await running.__anext__()
            await asyncio.sleep(0.3)
            with pytest.raises(StopAsyncIteration):
                await running.__anext__()
            made = len(scaler.loop.plans)
            assert made >= 3, f"{made} decisions in 0.3 s (or more) at 0.05 s"
            await asyncio.sleep(0.1)
            assert len(scaler.loop.plans) == made, "none after the app stopped"

        asyncio.run(go())

    def test_a_decision_that_fails_is_logged_and_the_loop_goes_on(self, caplog) -> None:
        class Flaky(Script):
            def decide(self, window: Window, fleet: Fleet) -> Plan:
                self.calls = getattr(self, "calls", 0) + 1
                if self.calls == 1:
                    raise RuntimeError("a planner bug")
                return super().decide(window, fleet)

        async def go() -> None:
            _, scaler, _ = fleet([1] * 100, interval=0.05, script=Flaky)
            task = asyncio.create_task(scaler.run())
            await asyncio.sleep(0.3)
            assert not task.done(), "the loop died with the decision"
            task.cancel()
            assert len(scaler.loop.plans) >= 2, "decisions after the failed one"

        asyncio.run(go())
        assert "autoscale: a decision failed" in caplog.text

    def test_a_worker_removed_by_hand_leaves_its_slot(self) -> None:
        async def go() -> None:
            cluster, scaler, launcher = fleet([2, 2])
            scaler.decide()
            await settle()
            launcher.ready[1].set_result(Server("http://127.0.0.1:9001"))
            await settle()
            cluster.remove_worker(scaler.wid[1])  # DELETE /admin/workers
            scaler.decide()  # the slot is free, and the target starts it again
            await settle()
            assert launcher.retired == [1] and scaler.phase[1] is R

        asyncio.run(go())


class TestServeOption:
    """`fairway serve --autoscale`: a bad setting, or a fleet it cannot size, stops the command
    before anything starts, with the field named."""

    @pytest.mark.parametrize(
        ("argv", "field"),
        [
            (["--autoscale", "min=3,max=2"], "min: 3 is above max"),
            (["--autoscale", "min=1,max=2,startup=-1"], "startup: must be >= 0"),
            (["--autoscale", "min=1,max=2,speed=3"], "speed: expected K=V"),
            (["--autoscale", "min=1,max=2", "--prefill-workers", "1", "--decode-workers", "1"],
             "workers.prefill, workers.decode"),
            (["--autoscale", "min=1,max=2", "--routers", "2"], "routers: "),
        ],
    )  # fmt: skip
    def test_errors_name_the_field(self, argv: list[str], field: str) -> None:
        from router.cli import main

        with pytest.raises(SystemExit, match=f"--autoscale: {field}"):
            main(["serve", "--backend", "emulated", *argv])
