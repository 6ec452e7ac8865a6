"""Free loopback ports for servers another process will start (Redis, replicas, test servers).

A port the kernel hands out for `bind(0)` comes from its ephemeral range, the same range every
outgoing connection takes its local port from. Between choosing such a port and the server
binding it, any connection (Ray opens hundreds as it starts) may take it: CI failed once on
"port 50382 is already in use". Ports chosen here lie outside that range, and outside the one
Ray gives its workers, so only another explicit chooser could race for them. This process's
own choosers are kept apart: a port handed out lately is not handed out again while others are
free (CI failed once on two servers told the same port, one of them answering for both).
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections import deque
from pathlib import Path

RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default min_worker_port..max_worker_port
_rng = random.Random()  # seeded from the OS: parallel processes draw different ports
_handed_out: deque[int] = deque(maxlen=2048)  # chosen here, perhaps not yet bound by their server


def ephemeral_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def quiet_ports() -> range:
    """The widest stretch of 1024..65535 that is neither ephemeral nor Ray's workers'."""
    taken = sorted([ephemeral_ports(), RAY_WORKER_PORTS], key=lambda r: r.start)
    gaps, start = [], 1024
    for r in taken:
        gaps.append(range(start, max(start, r.start)))
        start = max(start, r.stop)
    gaps.append(range(start, 65536))
    return max(gaps, key=len)


def free_ports(n: int, *, consecutive: bool = False, pool: range | None = None) -> list[int]:
    """`n` distinct free loopback ports (`consecutive`: in a row, as `first_port` numbers
    servers), all held open together while chosen."""
    if pool is None:
        pool = quiet_ports()
        if len(pool) < 64 * n:  # a machine whose ephemeral range covers nearly everything
            pool = range(1024, 65536)
    recent = set(_handed_out)
    fresh = [p for p in pool if p not in recent] if recent and not consecutive else pool
    for attempt in range(200):
        # Half the draws leave out what was handed out lately, if that leaves enough; a small
        # pool may hold nothing else, so the other half take any free port.
        avoid = attempt < 100
        if consecutive:
            first = _rng.randrange(pool.start, pool.stop - n + 1)
            ports = list(range(first, first + n))
            if avoid and recent.intersection(ports):
                continue
        else:
            ports = _rng.sample(fresh if avoid and len(fresh) >= n else pool, n)
        if _all_free(ports):
            _handed_out.extend(ports)
            return ports
    raise RuntimeError(f"no {n} free ports on 127.0.0.1 in {pool.start}..{pool.stop - 1}")


def free_port() -> int:
    return free_ports(1)[0]


def _all_free(ports: list[int]) -> bool:
    with contextlib.ExitStack() as stack:
        for port in ports:
            s = stack.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True
