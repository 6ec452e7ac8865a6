"""A tiled trace made as it is read: the same requests as copies made up front."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from router.request import Request
from traces import transform
from traces.generators import agent_loops, chat_sessions, shared_prefix
from traces.schema import Trace
from traces.tiled import TiledRequests


def tiled_up_front(trace: Trace, copies: int) -> list[Request]:
    """Every copy made at once and sorted: what a tiled trace's reader must see."""
    span = trace.duration
    stride = 1 + max((h for r in trace.requests for h in r.block_hashes), default=0)
    session_start: dict[str, float] = {}
    for r in trace.requests:
        if r.session is not None:
            session_start.setdefault(r.session, r.arrival)
    out = []
    for k in range(copies):
        shift = k * span / copies
        for r in trace.requests:
            start = r.arrival if r.session is None else session_start[r.session]
            back = span if start + shift >= span else 0.0
            out.append(
                dataclasses.replace(
                    r,
                    arrival=r.arrival + shift - back,
                    block_hashes=[h + k * stride for h in r.block_hashes],
                    session=None if r.session is None else f"{r.session}#{k}",
                )
            )
    for i, r in enumerate(out):  # numbered copy by copy, then sorted
        r.id = i
    return sorted(out, key=lambda r: r.arrival)


TRACES = {
    "sessions": lambda: chat_sessions(num_sessions=40, rate=3.0, think_time=4.0),
    "shared prefix": lambda: shared_prefix(num_requests=300, rate=20.0),
    "agents": lambda: agent_loops(num_sessions=12),
}


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize("copies", [1, 3, 16])
def test_read_in_order_or_at_random_a_tiled_trace_is_its_copies(name: str, copies: int) -> None:
    expected = tiled_up_front(TRACES[name](), copies)
    tiled = transform.tile(TRACES[name](), copies)
    assert isinstance(tiled.requests, TiledRequests)
    assert len(tiled) == len(expected)
    assert list(tiled.requests) == expected
    assert [tiled.requests[i] for i in (0, 7, -1, -len(expected))] == [
        expected[i] for i in (0, 7, -1, -len(expected))
    ]
    assert tiled.requests[5:40:3] == expected[5:40:3]
    with pytest.raises(IndexError):
        tiled.requests[len(expected)]
    for field in ("id", "arrival", "session", "client", "prompt_len", "think_time", "priority"):
        assert tiled.column(field) == [getattr(r, field) for r in expected], field
    assert tiled.duration == expected[-1].arrival - expected[0].arrival
    assert list(pickle.loads(pickle.dumps(tiled)).requests) == expected


def test_time_scaling_and_tenants_after_tiling_are_as_on_the_copies() -> None:
    """What the command line may do after --tile: the copies made up front and scaled, and
    given tenants, in place; the tiled trace keeps the same as arrays."""
    expected = Trace(tiled_up_front(TRACES["sessions"](), 5), block_size=16)
    tiled = transform.tile(TRACES["sessions"](), 5)
    for trace in (expected, tiled):
        transform.scale_time(trace, 1.7)
        transform.scale_rate(trace, 3.0)
        transform.assign_tenants(trace, 4, skew=1.0, seed=3)
    assert list(tiled.requests) == list(expected.requests)
    assert tiled.column("think_time") == [r.think_time for r in expected.requests]
    assert tiled.clients == expected.clients and len(tiled.clients) > 1
    # A session keeps one tenant across its turns, each copy its own draw.
    by_session: dict[str, set[str]] = {}
    for r in tiled.requests:
        by_session.setdefault(r.session, set()).add(r.client)
    assert all(len(c) == 1 for c in by_session.values())


def test_reshaping_a_tiled_trace_makes_its_copies() -> None:
    """A window or a limit after a tiling keeps requests as a list: they are the copies."""
    expected = tiled_up_front(TRACES["shared prefix"](), 4)
    limited = transform.limit(transform.tile(TRACES["shared prefix"](), 4), 50)
    assert limited.requests == expected[:50]
    windowed = transform.window(transform.tile(TRACES["shared prefix"](), 4), 2.0, 5.0)
    kept = [r for r in expected if 2.0 <= r.arrival < 5.0]
    assert [r.id for r in windowed.requests] == [r.id for r in kept]
    assert windowed.requests[0].arrival == 0.0


def test_each_read_makes_a_new_request() -> None:
    """A run may change a request it was given (a closed-loop turn's arrival): the next run
    over the same trace reads it as the trace has it."""
    tiled = transform.tile(TRACES["sessions"](), 2)
    first = tiled.requests[3]
    first.arrival += 100.0
    first.block_hashes.append(1)
    assert tiled.requests[3] != first
    assert tiled.requests[3] == tiled_up_front(TRACES["sessions"](), 2)[3]


def test_clients_must_match_the_requests() -> None:
    tiled = transform.tile(TRACES["shared prefix"](), 2)
    with pytest.raises(ValueError, match="clients for"):
        tiled.requests.set_clients(["a"])  # type: ignore[attr-defined]
