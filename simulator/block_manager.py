"""Paged KV blocks with prefix caching, as vLLM keeps them.

    [ used by running sequences  | cached, free (LRU)      | empty                ]
      ref > 0 (hashed or not)      ref == 0, keep their hash  no hash, no content
                                   reusable on a hit,
                                   evicted oldest first

A block only has an identity when it holds a full, computed prompt block: it is then keyed by
the block's chained hash so a later prompt with the same prefix can share it. Other blocks
(partial tails, generated tokens) are anonymous and counted, not named. A freed hashed block keeps
its hash in the free LRU until it is reused for something else: the free list is the cache.
Sequences free their blocks tail first, so a prompt's last blocks are evicted before its prefix.

The hashed blocks themselves, their holders and the free LRU, are a `CachedBlocks` store
(simulator/cached_blocks.py), in C when `make` has built it. Hashes are ints of at most 128
bits: a trace's are 64-bit (router.request), and a tiled trace offsets each copy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.request import BlockHash
from simulator.cached_blocks import new_store

# The most blocks a store makes room for up front: in C about 44 bytes each at most (index
# slots for twice as many, a slab slot, a queue entry), 90 KB a worker.
RESERVED_BLOCKS = 2048


class KVEventSink(Protocol):
    """Where a block manager reports what it caches, as vLLM publishes KV events."""

    def stored(self, parent: BlockHash | None, hashes: list[BlockHash]) -> None: ...
    def removed(self, hashes: list[BlockHash]) -> None: ...


class BlockTable:
    """The blocks one sequence holds: hashed prefix blocks, then anonymous ones."""

    __slots__ = ("hashed", "num_anonymous")

    def __init__(self) -> None:
        self.hashed: list[BlockHash] = []
        self.num_anonymous = 0

    def __len__(self) -> int:
        return len(self.hashed) + self.num_anonymous


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, events: KVEventSink | None = None) -> None:
        assert num_blocks > 0 and block_size > 0, "a KV cache needs blocks"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        # Every hashed block, in use or free. A cache fills to its size, so the store takes
        # room for it up front (to a bound: a fleet of small blocks that never fills would
        # hold the room idle), rather than growing its arrays as blocks come.
        self.cached = new_store(min(num_blocks, RESERVED_BLOCKS))
        # The store's count, kept here too: compiled, reading it here is one load, where the
        # store's is a call (the engine reads num_free at every decode catch-up).
        self._num_free_cached = 0
        self._num_empty = num_blocks
        self.num_evictions = 0

    # ----------------------------------------------------------------- queries

    @property
    def num_empty(self) -> int:
        """Free blocks with no cached content: taking them evicts nothing."""
        return self._num_empty

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones plus cached ones nobody uses."""
        return self._num_empty + self._num_free_cached

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_empty - self._num_free_cached

    def forget(self) -> None:
        """Every cached block forgotten, once no sequence holds one (a finished run): freed now,
        by reference counting, where a dropped fleet's would wait for its engines to go."""
        if self.num_used:
            raise RuntimeError(f"forget: sequences hold {self.num_used} blocks")
        self.cached.clear()
        self._num_free_cached = 0
        self._num_empty = self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_cached_prefix(self, hashes: list[BlockHash], limit: int) -> int:
        """Leading blocks of `hashes` (at most `limit`) present in the cache."""
        return self.cached.prefix(hashes, limit)

    def num_free_after_hit(self, hashes: list[BlockHash], num_hit: int) -> int:
        """Free blocks left once the first `num_hit` cached blocks of `hashes` are pinned."""
        return self.num_free - self.cached.num_free_of(hashes, num_hit)

    def is_cached(self, h: BlockHash) -> bool:
        return h in self.cached

    def cached_hashes(self) -> set[BlockHash]:
        """Every block with an identity: in use or free and still reusable."""
        return set(self.cached.keys())

    # --------------------------------------------------------------- mutations

    def pin_prefix(self, table: BlockTable, hashes: list[BlockHash], num_hit: int) -> None:
        """Share the first `num_hit` cached blocks of `hashes` with a new sequence."""
        assert not len(table), "a prefix is pinned before anything else is allocated"
        self._num_free_cached -= self.cached.pin(hashes, num_hit, table.hashed)

    def allocate(self, table: BlockTable, num_new: int) -> None:
        """Give `table` `num_new` anonymous blocks, evicting the oldest free cached ones."""
        assert num_new <= self.num_free, f"allocating {num_new} with {self.num_free} free"
        take_empty = min(num_new, self._num_empty)
        self._num_empty -= take_empty
        if num_new > take_empty:
            num_evicted = num_new - take_empty
            self.num_evictions += num_evicted
            self._num_free_cached -= num_evicted
            if self.events is None:
                self.cached.evict(num_evicted)
            else:
                evicted: list[BlockHash] = []
                self.cached.evict(num_evicted, evicted)
                self.events.removed(evicted)
        table.num_anonymous += num_new

    def commit_full_blocks(
        self, table: BlockTable, hashes: list[BlockHash], num_computed_blocks: int
    ) -> None:
        """Name the table's anonymous blocks that now hold full, computed prompt blocks.

        If another sequence computed the same block meanwhile, ours stays anonymous (a
        duplicate, as in vLLM) and the hashed run of this table ends there.
        """
        hashed = table.hashed
        start = len(hashed)
        # Two at a time: compiled, a min of three is a call into the interpreter.
        stop = min(min(num_computed_blocks, len(hashes)), start + table.num_anonymous)
        named = self.cached.add(hashes, start, stop, hashed)
        table.num_anonymous -= named
        if self.events is not None and named:
            parent = hashed[start - 1] if start else None
            self.events.stored(parent, hashed[start:])

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody is using (vLLM's /reset_prefix_cache; also what a
        restarted server starts with). Returns how many were dropped."""
        dropped: list[BlockHash] = []
        self.cached.evict(self._num_free_cached, dropped)
        self._num_free_cached = 0
        self._num_empty += len(dropped)
        if self.events is not None and dropped:
            self.events.removed(dropped)
        return len(dropped)

    def free(self, table: BlockTable) -> None:
        """Release every block of `table`, tail first."""
        self._num_empty += table.num_anonymous
        self._num_free_cached += self.cached.release(table.hashed)
        table.num_anonymous = 0

    def free_queue(self) -> list[BlockHash]:
        """The free queue's entries, oldest first, stale ones included (a copy)."""
        return self.cached.free_queue()

    def check_integrity(self, tables: Sequence[BlockTable]) -> None:
        cached = self.cached
        refs: dict[BlockHash, int] = {}
        for t in tables:
            for h in t.hashed:
                assert h in cached, f"block {h}: held but not cached"
                refs[h] = refs.get(h, 0) + 1
        held = sum(t.num_anonymous for t in tables) + len(refs)  # a shared block counts once
        assert held == self.num_used, f"sequences hold {held} blocks, manager says {self.num_used}"
        assert self.num_used <= self.num_blocks, "more blocks used than exist"
        entries: dict[BlockHash, int] = {}
        for h in cached.free_queue():
            assert h in cached, f"block {h}: queued, not cached"
            entries[h] = entries.get(h, 0) + 1
        num_free, every_key = 0, cached.keys()
        for h in every_key:
            r, queued = cached.holders(h)
            assert queued == entries.get(h, 0), f"block {h}: entries in the queue"
            assert refs.get(h, 0) == r, f"block {h}: ref {r}, held by {refs.get(h, 0)}"
            assert r or queued, f"block {h}: free and not in the queue"
            num_free += r == 0
        assert num_free == cached.num_free == self._num_free_cached, "free LRU, count disagree"
        assert self._num_empty >= 0, "negative empty count"
