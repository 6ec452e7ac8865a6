"""Preble's load signals: the work of a recent window, per prefix group and per worker.

E2 (policies/preble.py) prices each worker by L, its load over the last `window` seconds: every
dispatched request leaves an entry, the prefill of what it brought new to the cluster (charged
to its prefix group, split over the workers the group is allocated to) and its decode (charged
to the worker it runs on). Entries expire with the window, or are taken back when a request is
withdrawn. Per-worker numbers live in numpy vectors that line up, so L for the whole fleet is
one array operation. The TTFT detector says when a group's requests on a worker got slower
within the window: rebalancing replicates such a group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from router.prefix_index import WorkerId

Group = Hashable  # the block hash naming it, or ("request", id) for a prompt without a full block


@dataclass(slots=True)
class WindowEntry:
    """One dispatched request's work, kept for the window: the prefill of what was new to the
    cluster (charged to its group) and its decode (charged to the worker it runs on)."""

    request_id: int
    time: float
    group: Group
    worker: WorkerId
    prefill: float
    decode: float
    is_live: bool = True  # False once withdrawn: already taken back


class PerWorker:
    """A number per worker, held in a numpy vector. Vectors sharing one `slots` map line up,
    so a term read for the whole fleet per request (Preble's L) is one array operation. The
    arithmetic is float64 either way: values are those a dict of floats would hold."""

    def __init__(self, slots: dict[WorkerId, int]) -> None:
        self.slots = slots
        self._values = np.zeros(8)

    def get(self, worker: WorkerId, default: float = 0.0) -> float:
        i = self.slots.get(worker)
        return default if i is None or i >= len(self._values) else float(self._values[i])

    def __getitem__(self, worker: WorkerId) -> float:
        return self.get(worker)

    def __setitem__(self, worker: WorkerId, value: float) -> None:
        i = self.slots.setdefault(worker, len(self.slots))
        self._grow(i + 1)
        self._values[i] = value

    def values(self) -> np.ndarray:
        """Every slot's value (0 for a worker never set), read-only."""
        n = len(self.slots)
        self._grow(n)
        return self._values[:n]

    def _grow(self, n: int) -> None:
        if n > len(self._values):
            more = max(n, 2 * len(self._values)) - len(self._values)
            self._values = np.concatenate([self._values, np.zeros(more)])


class GroupWindow:
    """The work requests brought over the last `window` seconds: prefill per prefix group,
    decode per worker and per (worker, group)."""

    def __init__(self, window: float, slots: dict[WorkerId, int] | None = None) -> None:
        self.window = window
        self.prefill: dict[Group, float] = {}
        self.count: dict[Group, int] = {}  # requests of the group in the window
        self.decode = PerWorker({} if slots is None else slots)
        self.decode_of: dict[tuple[WorkerId, Group], float] = {}
        self._entries: deque[WindowEntry] = deque()
        self._by_request: dict[int, WindowEntry] = {}

    def add(self, entry: WindowEntry) -> None:
        self._entries.append(entry)
        self._by_request[entry.request_id] = entry
        self.prefill[entry.group] = self.prefill.get(entry.group, 0.0) + entry.prefill
        self.count[entry.group] = self.count.get(entry.group, 0) + 1
        self._charge_decode(entry, +1.0)

    def withdraw(self, request_id: int) -> Group | None:
        """Take back a request's entry; its group, or None if it has none here."""
        entry = self._by_request.pop(request_id, None)
        if entry is None or not entry.is_live:
            return None
        self._take(entry)
        return entry.group

    def expire(self, now: float) -> set[Group]:
        """Drop the entries older than the window; the groups that changed."""
        changed = set()
        while self._entries and self._entries[0].time < now - self.window:
            entry = self._entries.popleft()
            if entry.is_live:
                if self._by_request.get(entry.request_id) is entry:  # ids may be reused
                    del self._by_request[entry.request_id]
                self._take(entry)
                changed.add(entry.group)
        return changed

    def move_decode(self, group: Group, src: WorkerId, dst: WorkerId) -> None:
        """Charge `group`'s decode on `src` to `dst` instead."""
        for entry in self._entries:
            if entry.is_live and entry.group == group and entry.worker == src:
                self._charge_decode(entry, -1.0)
                entry.worker = dst
                self._charge_decode(entry, +1.0)

    def _take(self, entry: WindowEntry) -> None:
        entry.is_live = False
        group = entry.group
        self.count[group] -= 1
        self.prefill[group] -= entry.prefill
        if not self.count[group]:
            del self.count[group], self.prefill[group]
        self._charge_decode(entry, -1.0)

    def _charge_decode(self, entry: WindowEntry, sign: float) -> None:
        w, key = entry.worker, (entry.worker, entry.group)
        self.decode_of[key] = self.decode_of.get(key, 0.0) + sign * entry.decode
        self.decode[w] = self.decode.get(w, 0.0) + sign * entry.decode
        if sign < 0:  # drop the rounding subtractions leave
            if self.decode_of[key] < 1e-9:
                del self.decode_of[key]
            if self.decode[w] < 1e-9:
                self.decode[w] = 0.0


class TTFTOverloadDetector:
    """Per (group, worker), the TTFTs seen over the last `window` seconds. Overloaded when the
    later half-window's mean is at least `factor` x the earlier half's (both non-empty)."""

    def __init__(self, window: float, factor: float) -> None:
        self.window = window
        self.factor = factor
        self._samples: dict[Group, dict[WorkerId, deque[tuple[float, float]]]] = {}

    def add(self, group: Group, worker: WorkerId, now: float, ttft: float) -> None:
        samples = self._samples.setdefault(group, {}).setdefault(worker, deque())
        samples.append((now, ttft))
        while samples[0][0] < now - self.window:
            samples.popleft()

    def is_overloaded(self, group: Group, worker: WorkerId, now: float) -> bool:
        samples = self._samples.get(group, {}).get(worker, ())
        mid = now - self.window / 2
        early = [t for at, t in samples if now - self.window <= at < mid]
        late = [t for at, t in samples if at >= mid]
        if not early or not late:
            return False
        return sum(late) / len(late) >= self.factor * sum(early) / len(early)

    def forget(self, group: Group, worker: WorkerId | None = None) -> None:
        """Drop the samples of `group` on `worker`, or on every worker."""
        if worker is None:
            self._samples.pop(group, None)
        else:
            self._samples.get(group, {}).pop(worker, None)
