"""Reshaping a loaded trace: time scaling, windows, limits, tiling, tenant assignment, cache
bound.

Each transform changes the trace it is given and returns that same trace, for chaining. So a
trace tiled twice holds the product of both tilings (128 x 128 copies of a window tiled 128
times twice); to shape a trace anew, load it again."""

from __future__ import annotations

import random

from traces.schema import Trace, finish
from traces.tiled import TiledRequests


def scale_time(trace: Trace, factor: float) -> Trace:
    """Stretch every timestamp by `factor` (> 1 slows the trace down)."""
    if factor <= 0:
        raise ValueError(f"time scale must be positive, got {factor}")
    if isinstance(trace.requests, TiledRequests):
        trace.requests.scale_time(factor)
        return trace
    for r in trace.requests:
        r.arrival *= factor
        if r.think_time is not None:
            r.think_time *= factor
    return trace


def scale_rate(trace: Trace, factor: float) -> Trace:
    """Multiply the request rate by `factor` (compress time by it)."""
    if factor <= 0:
        raise ValueError(f"rate scale must be positive, got {factor}")
    return scale_time(trace, 1.0 / factor)


def window(trace: Trace, start: float, end: float | None) -> Trace:
    """Keep requests arriving in [start, end) seconds, rebased to 0."""
    trace.requests = [
        r for r in trace.requests if r.arrival >= start and (end is None or r.arrival < end)
    ]
    return finish(trace)


def limit(trace: Trace, n: int) -> Trace:
    """The first `n` requests by arrival."""
    if n <= 0:
        raise ValueError(f"limit must be positive, got {n}")
    trace.requests = trace.requests[:n]
    return trace


def tile(trace: Trace, copies: int) -> Trace:
    """The trace's population `copies` times side by side, for a fleet `copies` times larger:
    the rate grows by `copies` while each worker's load and history stay as they were (where
    `scale_rate` squeezes the same requests into less time). Copy k's prompts are its own
    (block hashes offset past the trace's largest) and its arrivals are rotated by k/copies of
    the trace's span, so copies are not in lockstep; a session rotates as one, in order. The
    copies are made as they are read (`traces.tiled`)."""
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    trace.requests = TiledRequests(trace.requests, copies)
    return trace


def assign_tenants(trace: Trace, num_tenants: int, skew: float = 0.0, seed: int = 0) -> Trace:
    """Give each request (each session, if any) a tenant; tenant k has weight 1/(k+1)^skew."""
    if num_tenants <= 0:
        raise ValueError(f"tenants must be positive, got {num_tenants}")
    rng = random.Random(seed)
    names = [f"tenant-{k}" for k in range(num_tenants)]
    weights = [1 / (k + 1) ** skew for k in range(num_tenants)]
    by_session: dict[str, str] = {}
    clients = []
    for session in trace.column("session"):
        client = by_session.get(session) if session is not None else None
        if client is None:
            client = rng.choices(names, weights)[0]
            if session is not None:
                by_session[session] = client
        clients.append(client)
    if isinstance(trace.requests, TiledRequests):
        trace.requests.set_clients(clients)
    else:
        for r, client in zip(trace.requests, clients, strict=True):
            r.client = client
    return trace
