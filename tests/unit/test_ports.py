"""Ports chosen for servers that another process starts later: never from the kernel's
ephemeral range, where any outgoing connection may take them first (a CI run failed on it)."""

from __future__ import annotations

import socket

import pytest

from router.proxy.ports import RAY_WORKER_PORTS, ephemeral_ports, free_ports, quiet_ports


def _overlap(a: range, b: range) -> bool:
    return max(a.start, b.start) < min(a.stop, b.stop)


# A machine whose ephemeral range covers nearly every port leaves no quiet ones: the chooser
# then draws from all ports, as it must.
needs_quiet_ports = pytest.mark.skipif(
    len(quiet_ports()) < 1000, reason="the ephemeral range covers nearly every port here"
)


@needs_quiet_ports
def test_quiet_ports_avoid_ephemeral_and_ray_worker_ports() -> None:
    quiet = quiet_ports()
    assert not _overlap(quiet, ephemeral_ports())
    assert not _overlap(quiet, RAY_WORKER_PORTS)


@needs_quiet_ports
def test_ports_are_distinct_free_and_in_a_row_when_asked() -> None:
    for _ in range(100):
        ports = free_ports(5)
        assert len(set(ports)) == 5
        assert all(p in quiet_ports() for p in ports)
        first, *rest = free_ports(4, consecutive=True)
        assert rest == [first + 1, first + 2, first + 3]


def test_a_port_in_use_is_never_chosen() -> None:
    first = free_ports(4, consecutive=True)[0]
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 1))
        held.listen()
        four = range(first, first + 4)
        for _ in range(20):
            assert sorted(free_ports(3, pool=four)) == [first, first + 2, first + 3]
        with pytest.raises(RuntimeError, match="no 2 free ports"):
            free_ports(2, consecutive=True, pool=range(first, first + 3))


@needs_quiet_ports
def test_a_port_handed_out_is_not_handed_out_again() -> None:
    # Two servers told the same port before either binds it: one fails, the other answers for
    # both. Nothing is bound between these calls, as nothing is before servers start. Drawn
    # blindly from the quiet ports, 600 draws would repeat one about 14 times.
    chosen = [free_ports(1)[0] for _ in range(600)]
    assert len(set(chosen)) == len(chosen)
