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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from router.request import BlockHash


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
        self._ref: dict[BlockHash, int] = {}  # every hashed block, in use or free
        self._free_cached: OrderedDict[BlockHash, None] = OrderedDict()  # ref 0, oldest first
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
        return self._num_empty + len(self._free_cached)

    @property
    def num_used(self) -> int:
        # num_free inlined: the engine reads this on every decode catch-up.
        return self.num_blocks - self._num_empty - len(self._free_cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_cached_prefix(self, hashes: Sequence[BlockHash], limit: int) -> int:
        """Leading blocks of `hashes` (at most `limit`) present in the cache."""
        ref = self._ref
        n = 0
        for h in hashes[:limit]:
            if h not in ref:
                break
            n += 1
        return n

    def num_free_after_hit(self, hashes: Sequence[BlockHash], num_hit: int) -> int:
        """Free blocks left once the first `num_hit` cached blocks of `hashes` are pinned."""
        free_cached = self._free_cached
        return self.num_free - sum(1 for h in hashes[:num_hit] if h in free_cached)

    def is_cached(self, h: BlockHash) -> bool:
        return h in self._ref

    def cached_hashes(self) -> set[BlockHash]:
        """Every block with an identity: in use or free and still reusable."""
        return set(self._ref)

    # --------------------------------------------------------------- mutations

    def pin_prefix(self, table: BlockTable, hashes: Sequence[BlockHash], num_hit: int) -> None:
        """Share the first `num_hit` cached blocks of `hashes` with a new sequence."""
        assert not len(table), "a prefix is pinned before anything else is allocated"
        for h in hashes[:num_hit]:
            ref = self._ref[h]
            if ref == 0:
                del self._free_cached[h]
            self._ref[h] = ref + 1
            table.hashed.append(h)

    def allocate(self, table: BlockTable, num_new: int) -> None:
        """Give `table` `num_new` anonymous blocks, evicting the oldest free cached ones."""
        assert num_new <= self.num_free, f"allocating {num_new} with {self.num_free} free"
        take_empty = min(num_new, self._num_empty)
        self._num_empty -= take_empty
        if num_new > take_empty:
            # `last` by position: a keyword costs OrderedDict's argument parser more than the
            # pop itself.
            oldest = self._free_cached.popitem
            evicted = [oldest(False)[0] for _ in range(num_new - take_empty)]
            for h in evicted:
                del self._ref[h]
            self.num_evictions += len(evicted)
            if self.events is not None:
                self.events.removed(evicted)
        table.num_anonymous += num_new

    def commit_full_blocks(
        self, table: BlockTable, hashes: Sequence[BlockHash], num_computed_blocks: int
    ) -> None:
        """Name the table's anonymous blocks that now hold full, computed prompt blocks.

        If another sequence computed the same block meanwhile, ours stays anonymous (a
        duplicate, as in vLLM) and the hashed run of this table ends there.
        """
        ref, hashed = self._ref, table.hashed
        start = len(hashed)
        stop = min(num_computed_blocks, len(hashes), start + table.num_anonymous)
        for i in range(start, stop):
            h = hashes[i]
            if h in ref:
                break
            ref[h] = 1
            hashed.append(h)
        table.num_anonymous -= len(hashed) - start
        if self.events is not None and len(hashed) > start:
            self.events.stored(hashed[start - 1] if start else None, hashed[start:])

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody is using (vLLM's /reset_prefix_cache; also what a
        restarted server starts with). Returns how many were dropped."""
        dropped = list(self._free_cached)
        for h in dropped:
            del self._ref[h]
        self._free_cached.clear()
        self._num_empty += len(dropped)
        if self.events is not None and dropped:
            self.events.removed(dropped)
        return len(dropped)

    def free(self, table: BlockTable) -> None:
        """Release every block of `table`, tail first."""
        self._num_empty += table.num_anonymous
        for h in reversed(table.hashed):
            ref = self._ref[h] - 1
            self._ref[h] = ref
            if ref == 0:
                self._free_cached[h] = None
        table.hashed.clear()
        table.num_anonymous = 0

    def check_integrity(self, tables: Sequence[BlockTable]) -> None:
        refs: dict[BlockHash, int] = {}
        for t in tables:
            for h in t.hashed:
                refs[h] = refs.get(h, 0) + 1
        held = sum(t.num_anonymous for t in tables) + len(refs)  # a shared block counts once
        assert held == self.num_used, f"sequences hold {held} blocks, manager says {self.num_used}"
        assert self.num_used <= self.num_blocks, "more blocks used than exist"
        for h, r in self._ref.items():
            assert refs.get(h, 0) == r, f"block {h}: ref {r}, held by {refs.get(h, 0)}"
            assert (r == 0) == (h in self._free_cached), f"block {h}: ref {r} vs free list"
        assert self._num_empty >= 0, "negative empty count"
