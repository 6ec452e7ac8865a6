"""The blocks of one KV cache that have an identity, and the LRU of those nobody holds.

A block has an identity once it holds a full, computed prompt block: it is keyed by the block's
chained hash (an int, at most 128 bits signed), so a later prompt with the same prefix shares
it. For each such block the store keeps how many sequences hold it; one nobody holds is free
and cached, reusable on a hit until it is evicted, oldest freed first.

The free LRU is a queue of keys in the order their blocks were freed. A block pinned again
keeps its entry there, stale, rather than being unlinked from its neighbours; freed again, it is
appended. An entry is the block's place in the LRU when it is the block's last one and nobody
holds the block; every other entry is skipped when it surfaces. The queue is rebuilt without
its stale entries once they outnumber the live ones by a slack.

This module is the definition, in Python. `make` also builds `cached_blocks.c`, the same store
in C: at 512 workers a replay keeps about half a million cached blocks, and there each takes
about 50 bytes in three flat arrays (a slab slot, index slots, queue entries) rather than about
130 in Python objects (a dict entry, the key's int, a state), most of the difference between
the CPU's last-level cache holding them or not. Tests run both through the same operations and
compare them after each.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Final, Protocol, cast

from router.runtime.native import native_root, put_shared_on_path

# Stale entries a free queue may hold beyond its live ones before it is rebuilt without them.
STALE_SLACK: Final = 64
# Taken slots a free queue keeps at its front before it moves the rest up over them (and only
# once they are half of it, so that each entry is moved about once).
TRIM_AFTER: Final = 64
# A block's state, one int: free (no holder), minus its entries in the free queue; held, its
# holders plus HOLDERS_LIMIT times its entries.
HOLDERS_LIMIT: Final = 1 << 32
_HOLDERS_MASK: Final = HOLDERS_LIMIT - 1


class CachedBlocks:
    """Blocks with an identity, by key: their holders and the free LRU (see the module)."""

    def __init__(self, capacity: int = 0) -> None:
        # `capacity`: blocks to make room for before anything grows; dicts and lists here
        # size themselves, so it is only checked (the C store takes its arrays up front).
        if capacity < 0:
            raise ValueError(f"capacity: blocks to make room for, not {capacity}")
        self._state: dict[int, int] = {}
        self._queue: list[int | None] = []  # entries from `_oldest` on, oldest first
        self._oldest = 0
        self._num_free = 0
        self.stale_slack = STALE_SLACK  # tests push it to extremes

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, key: int) -> bool:
        return key in self._state

    @property
    def num_free(self) -> int:
        """Cached blocks nobody holds: the LRU's length."""
        return self._num_free

    def prefix(self, keys: list[int], limit: int) -> int:
        """How many leading blocks of `keys` (at most `limit`) are cached."""
        state, n, stop = self._state, 0, min(limit, len(keys))
        while n < stop and keys[n] in state:
            n += 1
        return n

    def num_free_of(self, keys: list[int], n: int) -> int:
        """Of the first `n` blocks of `keys` (all cached), how many nobody holds."""
        state = self._state
        return sum(1 for i in range(n) if state[keys[i]] < 0)

    def pin(self, keys: list[int], n: int, held: list[int]) -> int:
        """One holder more for each of the first `n` blocks of `keys` (all cached), appended to
        `held`; a free one leaves the LRU (its entries go stale). How many were free."""
        state, taken = self._state, 0
        for i in range(n):
            key = keys[i]
            s = state[key]
            if s < 0:
                taken += 1
                state[key] = 1 - s * HOLDERS_LIMIT
            else:
                state[key] = s + 1
            held.append(key)
        if taken:
            self._num_free -= taken
            if len(self._queue) - self._oldest > 2 * self._num_free + self.stale_slack:
                self._compact()
        return taken

    def add(self, keys: list[int], start: int, stop: int, held: list[int]) -> int:
        """Name blocks `keys[start:stop]` in order, each held once and appended to `held`, up to
        the first one cached already (computed meanwhile by another sequence); how many."""
        state = self._state
        for i in range(start, stop):
            key = keys[i]
            if key in state:
                return i - start
            state[key] = 1
            held.append(key)
        return max(0, stop - start)

    def release(self, held: list[int]) -> int:
        """One holder fewer for each of `held`, last first; a block left with none joins the
        LRU as its newest. `held` is emptied. How many joined."""
        state, queue, num_freed = self._state, self._queue, 0
        for key in reversed(held):
            if state[key] < 0:
                raise ValueError(f"releasing cached block {key!r}, which nobody holds")
            s = state[key] - 1
            if s & _HOLDERS_MASK == 0:
                state[key] = -1 - (s >> 32)
                queue.append(key)
                num_freed += 1
            else:
                state[key] = s
        self._num_free += num_freed
        held.clear()
        return num_freed

    def evict(self, n: int, evicted: list[int] | None = None) -> None:
        """Forget the `n` oldest free blocks (at most `num_free`), their keys appended to
        `evicted` when given."""
        if n > self._num_free or n < 0:
            raise ValueError(f"evicting {n} of {self._num_free} free cached blocks")
        state, queue, at = self._state, self._queue, self._oldest
        for _ in range(n):
            while True:
                key = queue[at]
                assert key is not None, "the free queue ran out before its count"
                queue[at] = None  # the queue no longer holds it
                at += 1
                if self._leaves_its_place(key):
                    break
            del state[key]
            if evicted is not None:
                evicted.append(key)
        if at > TRIM_AFTER and 2 * at > len(queue):
            del queue[:at]
            at = 0
        self._oldest = at
        self._num_free -= n

    def clear(self) -> None:
        self._state.clear()
        self._queue.clear()
        self._oldest = self._num_free = 0

    def keys(self) -> list[int]:
        return list(self._state)

    def free_queue(self) -> list[int]:
        """The free queue's entries, oldest first, stale ones included (a copy)."""
        # Only slots before `_oldest` are taken (None), so the copy from there holds keys.
        return cast(list[int], self._queue[self._oldest :])

    def holders(self, key: int) -> tuple[int, int]:
        """A cached block's holders and its entries in the free queue."""
        s = self._state[key]
        return (0, -s) if s < 0 else (s & _HOLDERS_MASK, s >> 32)

    def _leaves_its_place(self, key: int) -> bool:
        """One of the block's entries leaves the queue: was it its place in the LRU (its last
        entry, while nobody holds it), and not a stale one?"""
        s = self._state[key]
        if s == -1:
            return True
        self._state[key] = s + 1 if s < 0 else s - HOLDERS_LIMIT
        return False

    def _compact(self) -> None:
        """The free queue without its stale entries, in the same order."""
        live: list[int | None] = []
        for key in self.free_queue():
            if self._leaves_its_place(key):
                self._state[key] = -1  # its one entry, in the new queue
                live.append(key)
        self._queue, self._oldest = live, 0


class Store(Protocol):
    """A store of cached blocks: `CachedBlocks` below, or the same in C."""

    stale_slack: int

    def __len__(self) -> int: ...
    def __contains__(self, key: int) -> bool: ...
    def prefix(self, keys: list[int], limit: int) -> int: ...
    def num_free_of(self, keys: list[int], n: int) -> int: ...
    def pin(self, keys: list[int], n: int, held: list[int]) -> int: ...
    def add(self, keys: list[int], start: int, stop: int, held: list[int]) -> int: ...
    def release(self, held: list[int]) -> int: ...
    def evict(self, n: int, evicted: list[int] | None = None) -> None: ...
    def clear(self) -> None: ...
    def keys(self) -> list[int]: ...
    def free_queue(self) -> list[int]: ...
    def holders(self, key: int) -> tuple[int, int]: ...

    @property
    def num_free(self) -> int: ...


C_STORE: Final = "fairway_cached_blocks"


def _store_type() -> Callable[[int], Store]:
    """The C store where `make` built it, else its definition in Python; called with the
    blocks to make room for up front."""
    root = native_root()
    if root is not None:
        put_shared_on_path(root)
        try:
            return cast(Callable[[int], Store], importlib.import_module(C_STORE).CachedBlocks)
        except ImportError:
            pass  # a build without it
    return CachedBlocks


new_store: Final = _store_type()
