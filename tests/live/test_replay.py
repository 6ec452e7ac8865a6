"""`fairway replay`: a trace sent to a live proxy, recorded in the simulator's columns."""

from __future__ import annotations

import pytest

from dashboards.report import load_run
from router.request import Request
from tests.live_helpers import emulated_workers, proxy, run
from traces.generators import shared_prefix
from traces.replay import prompt_tokens, replay
from traces.schema import Trace


def test_shared_blocks_become_shared_tokens() -> None:
    a = Request(0, 0.0, 40, 4, [11, 22, 33])
    b = Request(1, 0.0, 36, 4, [11, 22, 99])
    ta, tb = prompt_tokens(a, 16), prompt_tokens(b, 16)
    assert len(ta) == 40 and len(tb) == 36
    assert ta[:32] == tb[:32] and ta[32:] != tb[32:36]


def test_replay_through_the_proxy_records_every_request(tmp_path) -> None:
    trace = shared_prefix(num_requests=30, num_tenants=3, prefix_tokens=600, rate=20.0, seed=2)
    out = tmp_path / "live"

    async def go() -> None:
        async with emulated_workers(2, speed=20) as urls, proxy(urls, "lpm") as (base, _):
            result = await replay(trace, base, out)
            assert not result.failures and len(result.records) == 30

    run(go)
    live = load_run(out)
    assert len(live.records) == 30 and live.name == "live (live)"
    assert {r.worker for r in live.records} == {0, 1}, "the proxy's worker header is kept"
    assert {r.client for r in live.records} == {"tenant-0", "tenant-1", "tenant-2"}
    assert all(r.output_tokens == req.output_len for r, req in zip(
        sorted(live.records, key=lambda r: r.id), trace.requests, strict=True))  # fmt: skip
    assert live.summary["prefix_cache"]["hit_rate"] > 0.3, "shared documents hit the cache"


def test_a_trace_the_model_cannot_hold_is_refused_before_sending(tmp_path) -> None:
    trace = Trace([Request(0, 0.0, 100, 8), Request(1, 0.1, 9000, 8)], 16)

    async def go() -> None:
        async with emulated_workers(1, speed=20) as urls:
            with pytest.raises(ValueError, match=r"1 of 2 requests need more than"):
                await replay(trace, urls[0], tmp_path / "x")

    run(go)
    assert not (tmp_path / "x" / "requests.csv").exists()


def test_an_endpoint_that_is_not_there_is_a_clear_error(tmp_path) -> None:
    from router.proxy.ports import free_port

    trace = Trace([Request(0, 0.0, 100, 8)], 16)
    with pytest.raises(ValueError, match="no model list at /v1/models"):
        run(lambda: replay(trace, f"http://127.0.0.1:{free_port()}", tmp_path / "x"))


def test_closed_loop_sends_each_turn_after_the_previous_answer(tmp_path) -> None:
    from traces.generators import chat_sessions

    trace = chat_sessions(num_sessions=4, mean_turns=3, system_tokens=200, user_tokens=50,
                          output_tokens=20, think_time=0.2, rate=10.0, seed=1)  # fmt: skip
    assert any(r.id != min(q.id for q in trace.requests if q.session == r.session)
               for r in trace.requests), "some sessions have later turns"  # fmt: skip

    async def go() -> None:
        async with emulated_workers(1, speed=20) as urls:
            result = await replay(trace, urls[0], tmp_path / "live", closed_loop=True)
            assert not result.failures

    run(go)
    by_session: dict = {}
    for r in sorted(load_run(tmp_path / "live").records, key=lambda r: r.arrival):
        by_session.setdefault(r.session, []).append(r)
    think = {r.id: r.think_time or 0.0 for r in trace.requests}
    for turns in by_session.values():
        for previous, turn in zip(turns, turns[1:], strict=False):
            assert turn.arrival >= previous.finish + think[turn.id] - 1e-3
