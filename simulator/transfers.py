"""KV-cache transfers in flight over a `Topology` (prefill GPU -> decode GPU), sharing its links
max-min fairly.

Apart from the graph (simulator/topology.py) and compiled with the simulator's core
(router/runtime/native.py): a split fleet's every request starts and finishes a transfer, and
each start or finish shares the links anew over the paths in flight.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import simpy

from simulator.topology import Topology

DONE = 1e-9  # a flow with under this many seconds of bytes left at its rate has finished


def fair_rates(
    paths: Sequence[Sequence[int]],
    capacity: Sequence[float] | Mapping[int, float],
    counts: Sequence[int] | None = None,
) -> list[float]:
    """Max-min fair rates of flows crossing `paths` (link ids) over links of `capacity` (by
    link id; `counts[i]` flows on path i, default one each; each gets the rate returned for its
    path), by progressive filling: the link with the least capacity left per unfixed flow fixes
    its flows at that share; their rates leave the other links they cross; repeat until every
    flow is fixed. A link's share only grows as others fix, so a heap with stale entries skipped
    finds the next bottleneck: O(path links x log links)."""
    counts = counts if counts is not None else [1] * len(paths)
    for i, links in enumerate(paths):
        assert links and counts[i] > 0, f"path {i} crosses no link or carries no flow"
    crossed = [link for links in paths for link in links]
    if len(set(crossed)) == len(crossed):
        # No link is shared (the usual case: a few transfers in flight, between different
        # GPUs): each path's flows split its own bottleneck, as the filling below finds it.
        return [min(float(capacity[k]) / counts[i] for k in p) for i, p in enumerate(paths)]
    rates = [0.0] * len(paths)
    users: dict[int, list[int]] = {}
    unfixed: dict[int, int] = {}  # link -> flows on it not yet fixed
    for i, links in enumerate(paths):
        for link in links:
            users.setdefault(link, []).append(i)
            unfixed[link] = unfixed.get(link, 0) + counts[i]
    left = {link: float(capacity[link]) for link in users}
    share_of = {link: left[link] / n for link, n in unfixed.items()}  # the live heap entries
    heap = [(share, link) for link, share in share_of.items()]
    heapq.heapify(heap)
    is_fixed = [False] * len(paths)
    while heap:
        share, bottleneck = heapq.heappop(heap)
        if share_of.get(bottleneck) != share:
            continue  # stale: the link's share has grown since, or its flows are fixed
        del share_of[bottleneck]
        touched: set[int] = set()
        for i in users[bottleneck]:
            if is_fixed[i]:
                continue
            is_fixed[i], rates[i] = True, share
            for link in paths[i]:
                left[link] -= share * counts[i]
                unfixed[link] -= counts[i]
            touched.update(paths[i])
        touched.discard(bottleneck)
        for link in touched:
            if unfixed[link]:
                share_of[link] = left[link] / unfixed[link]
                heapq.heappush(heap, (share_of[link], link))
            else:
                share_of.pop(link, None)
    return rates


class Transfer(NamedTuple):
    src: int
    dst: int
    nbytes: float
    start: float
    end: float  # when the last byte arrived: its bytes done, plus the path's latency


class _Path:
    """The flows in flight on one path. Flows crossing the same links get the same max-min rate,
    so they advance together: `served` counts the bytes each has moved since the path was
    opened, and a flow is done when it reaches the mark (`served` at its start + its bytes) the
    flow is filed under in `flows`, a heap (first to finish on top).

        served at start        served now          mark
        |---- moved -----------|---- remaining ----|
    """

    def __init__(self, links: tuple[int, ...], latency: float) -> None:
        self.links = links
        self.latency = latency
        self.rate = 0.0  # bytes/s, each flow
        self.served = 0.0
        self.flows: list[tuple[float, int, Transfer, Callable[[Transfer], object]]] = []


class KVTransfers:
    """Transfers in flight on a `Topology`, sharing every link max-min fairly.

    A flow occupies its links from `send` until its last byte leaves; the path's latency (the
    tail's propagation) is added once, after that. Rates are recomputed, over the paths in flight
    only, whenever a flow starts or its bytes finish; between those moments every flow's bytes go
    at a constant rate, so one timer (the next finish) is all that is scheduled: exact, no steps.
    A start or finish costs O(paths in flight), however many flows share them.
    """

    def __init__(self, env: simpy.Environment, topology: Topology) -> None:
        self.env = env
        self.topology = topology
        self.records: list[Transfer] = []  # in order of arrival; `end` filled in on arrival
        self.num_active = 0  # flows whose bytes are still moving
        self._paths: dict[tuple[int, ...], _Path] = {}  # in flight, by link ids
        self._updated = env.now  # when `served` was last advanced
        self._timer = 0  # the generation of the one live wake-up; older ones are ignored
        self._seq = 0  # files flows with the same mark in order of sending

    def send(
        self,
        src: int,
        dst: int,
        nbytes: float,
        then: Callable[[Transfer], object] | None = None,
    ) -> simpy.Event | None:
        """Start moving `nbytes` from GPU `src` to GPU `dst`; the event returned fires (with
        its `Transfer`) when the last byte has arrived, or `then(transfer)` is called then
        instead (one SimPy event fewer per transfer, for a simulation's hot path). The same
        GPU: at once."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        links = self.topology.path(src, dst)
        latency = sum(k.latency for k in links)
        transfer = Transfer(src, dst, nbytes, self.env.now, math.nan)
        event = self.env.event() if then is None else None
        arrived = then if then is not None else event.succeed  # type: ignore[union-attr]
        if not links or nbytes == 0:
            self._arrive(transfer, arrived, latency)
            return event
        self._advance()
        ids = tuple(k.id for k in links)
        path = self._paths.get(ids)
        if path is None:
            path = self._paths[ids] = _Path(ids, latency)
        self._seq += 1
        heapq.heappush(path.flows, (path.served + nbytes, self._seq, transfer, arrived))
        self.num_active += 1
        self._reshare()
        return event

    def _advance(self) -> None:
        elapsed, self._updated = self.env.now - self._updated, self.env.now
        for path in self._paths.values():
            path.served += path.rate * elapsed

    def _reshare(self) -> None:
        """New fair rates for the paths in flight, and a wake-up at the next flow's finish."""
        paths = list(self._paths.values())
        capacity = self.topology.bandwidths
        rates = fair_rates([p.links for p in paths], capacity, [len(p.flows) for p in paths])
        for path, rate in zip(paths, rates, strict=True):
            path.rate = rate
        self._timer += 1  # SimPy cannot cancel a timeout: the older one fires and is ignored
        if paths:
            first = min(paths, key=lambda p: (p.flows[0][0] - p.served) / p.rate)
            timer, delay = self._timer, max((first.flows[0][0] - first.served) / first.rate, 0.0)
            self.env.timeout(delay).callbacks.append(lambda _: self._wake(timer, first))

    def _wake(self, timer: int, first: _Path) -> None:
        if timer != self._timer:
            return  # a start or finish since then rescheduled
        self._advance()
        first.served = max(first.served, first.flows[0][0])  # its first flow finishes now
        for ids, path in list(self._paths.items()):
            while path.flows and path.flows[0][0] - path.served <= path.rate * DONE:
                _, _, transfer, arrived = heapq.heappop(path.flows)
                self.num_active -= 1
                self._arrive(transfer, arrived, path.latency)
            if not path.flows:
                del self._paths[ids]
        self._reshare()

    def _arrive(
        self, transfer: Transfer, arrived: Callable[[Transfer], object], latency: float
    ) -> None:
        def land(_: object = None) -> None:
            done = transfer._replace(end=self.env.now)
            self.records.append(done)
            arrived(done)

        if latency > 0:
            self.env.timeout(latency).callbacks.append(land)
        else:
            land()
