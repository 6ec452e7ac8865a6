"""A min-heap of (time, worker) pairs, for the simulator's own schedules: when each engine's
next step ends (the driver's syncing), when each worker's load floor crosses a level (the load
floors), and when each of the environment's plain calls is due (simulator/environment.py, an
id in the worker's place and the callable as the entry's payload).

heapq on (float, int) tuples compares through tuple and float rich comparison, a few hundred
instructions a comparison and a tuple made and freed per entry: at 1,024 workers these heaps
were ~6 % of a run's instructions. Compiled, an entry holds its time as a C double and a
comparison is two loads and a branch. The order is the tuples' exactly (time, then worker), so
pops come out as heapq's would and a run's records do not change.
"""

from __future__ import annotations

from typing import Final, final

from mypy_extensions import i64

_INF: Final = float("inf")


@final
class _Entry:
    __slots__ = ("at", "wid", "payload")

    def __init__(self, at: float, wid: int, payload: object) -> None:
        self.at = at
        self.wid = wid
        self.payload = payload


@final
class TimeHeap:
    """(time, worker) pairs, the earliest first, ties by worker. Entries are not unique: a
    caller that re-schedules pushes anew and skips the stale entry when it surfaces."""

    __slots__ = ("_entries", "_spare")

    def __init__(self) -> None:
        self._entries: list[_Entry] = []
        # Entries popped, for pushes to reuse: an entry holds an object, so each new one was
        # an allocation the collector tracks, and each pop its free (3 % of a saturated run).
        self._spare: list[_Entry] = []

    def __len__(self) -> int:
        return len(self._entries)

    def first_at(self) -> float:
        """The earliest time (inf when empty)."""
        entries = self._entries
        return entries[0].at if entries else _INF

    def first_id(self) -> int:
        """The earliest pair's worker (the heap must not be empty)."""
        return self._entries[0].wid

    def first_payload(self) -> object:
        """What the earliest pair was pushed with (the heap must not be empty)."""
        return self._entries[0].payload

    def push(self, at: float, wid: int, payload: object = None) -> None:
        """(at, wid), carrying `payload` for its popper: the call queue's callable, where a dict
        by id cost a store and a delete a call."""
        entries, spare = self._entries, self._spare
        if spare:
            entry = spare.pop()
            entry.at, entry.wid, entry.payload = at, wid, payload
        else:
            entry = _Entry(at, wid, payload)
        entries.append(entry)
        self._toward_root(0, len(entries) - 1)

    def pop(self) -> int:
        """Take out the earliest pair (the heap must not be empty); its worker. Read its time
        first with `first_at`."""
        entries = self._entries
        first = last = entries.pop()
        if entries:
            first = entries[0]
            entries[0] = last
            self._toward_leaf(0)
        first.payload = None  # its callable let go as the call is made
        self._spare.append(first)
        return first.wid

    def rebuild(self, pairs: list[tuple[float, int]]) -> None:
        """Hold exactly `pairs` from now on."""
        entries = self._entries = [_Entry(at, wid, None) for at, wid in pairs]
        for pos in reversed(range(len(entries) // 2)):
            self._toward_leaf(pos)

    # heapq's _siftdown and _siftup, under names that say which way each goes.

    def _toward_root(self, start: i64, pos: i64) -> None:
        entries = self._entries
        item = entries[pos]
        at, wid = item.at, item.wid
        while pos > start:
            parent_pos = (pos - 1) >> 1
            parent = entries[parent_pos]
            # Earlier: by time, then worker (the tuples' order), compared inline: this loop
            # and the next are the heap's time, and a call per comparison was a third of it.
            if not (at < parent.at or (at == parent.at and wid < parent.wid)):
                break
            entries[pos] = parent
            pos = parent_pos
        entries[pos] = item

    def _toward_leaf(self, pos: i64) -> None:
        # Down to a leaf along the earlier children, then back up: fewer comparisons than
        # stopping on the way, since what moves down came from the bottom (heapq's reasoning).
        entries = self._entries
        end: i64 = len(entries)
        start, item = pos, entries[pos]
        child = 2 * pos + 1
        while child < end:
            right = child + 1
            if right < end:
                left_entry, right_entry = entries[child], entries[right]
                if not (
                    left_entry.at < right_entry.at
                    or (left_entry.at == right_entry.at and left_entry.wid < right_entry.wid)
                ):
                    child = right
            entries[pos] = entries[child]
            pos = child
            child = 2 * pos + 1
        entries[pos] = item
        self._toward_root(start, pos)
