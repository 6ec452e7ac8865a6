"""LiveCluster's bookkeeping without HTTP: windows, queues, workers going away."""

from __future__ import annotations

import asyncio

import pytest

import policies
from router.config import RouterConfig
from router.proxy.driver import LiveCluster, WorkerDown
from router.request import Request


def cluster(window: int = 1, local: str = "fcfs") -> LiveCluster:
    c = LiveCluster(
        policies.global_policies.create("round_robin"),
        lambda: policies.local_policies.create(local),
        RouterConfig(block_size=16, window=window),
    )
    c.add_worker("http://127.0.0.1:1")
    return c


def req(i: int, client: str = "a") -> Request:
    return Request(i, 0.0, 32, 4, [i], client=client)


def test_window_holds_the_rest_in_the_router_until_release() -> None:
    async def go() -> None:
        c = cluster(window=1)
        w, _, first = c.route(req(1))
        _, _, second = c.route(req(2))
        assert first.done() and not second.done()
        assert len(w.dispatch) == 1 and w.dispatch.in_flight == 1
        c.release(w, req(1), 4)
        assert second.done() and w.dispatch.in_flight == 1 and len(w.dispatch) == 0

    asyncio.run(go())


def test_local_discipline_orders_the_router_queue() -> None:
    async def go() -> None:
        c = cluster(window=1, local="vtc")
        w, _, _ = c.route(req(1, "flood"))
        waiting = [c.route(req(i, "flood"))[2] for i in range(2, 5)]
        calm = c.route(req(9, "calm"))[2]
        c.release(w, req(1, "flood"), 4)
        assert calm.done() and not any(f.done() for f in waiting), "VTC serves the calm client"

    asyncio.run(go())


def test_worker_going_down_hands_its_queue_back() -> None:
    async def go() -> None:
        c = cluster(window=1)
        w, _, running = c.route(req(1))
        _, _, queued = c.route(req(2))
        c.mark_down(w.id)
        with pytest.raises(WorkerDown):
            await queued
        assert running.done()
        with pytest.raises(WorkerDown):
            c.route(req(3))  # nobody healthy left
        assert w.dispatch.in_flight == 1 and len(w.dispatch) == 0
        c.release(w, req(1), 4)  # the in-flight one still finishes cleanly
        assert w.dispatch.in_flight == 0

    asyncio.run(go())


def test_removed_worker_in_flight_request_finishes_cleanly() -> None:
    async def go() -> None:
        c = cluster(window=2)
        w, _, running = c.route(req(1))
        c.remove_worker(w.id)
        c.release(w, req(1), 4)
        assert not c.workers and running.done()

    asyncio.run(go())


def test_dispatch_queue_counts_what_waits() -> None:
    from policies.fcfs import FCFS
    from router.dispatch import DispatchQueue
    from router.prefix_index import PrefixIndex

    queue = DispatchQueue(0, FCFS(), window=1)
    first, second = req(1), req(2)
    queue.push(first)
    queue.push(second)
    waiting = first.prompt_len + first.output_len + second.prompt_len + second.output_len
    assert queue.queued_tokens == waiting
    assert list(queue.release(PrefixIndex(), 16)) == [first]  # the window holds one
    assert queue.queued_tokens == second.prompt_len + second.output_len
    queue.withdraw(second)
    assert queue.queued_tokens == 0 and len(queue) == 0
