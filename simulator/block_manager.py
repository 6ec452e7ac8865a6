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

A hashed block is one small object, found by its hash once and then held by the sequences using
it: freeing a sequence, pinning a cached block and evicting the oldest touch no table but the
block's own links in the free LRU (a list threaded through the blocks, as vLLM's free block
queue is). Hashes are opaque here: kept as the objects the caller gave, never converted.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Final, Protocol, cast

from mypy_extensions import mypyc_attr

from router.request import BlockHash


class KVEventSink(Protocol):
    """Where a block manager reports what it caches, as vLLM publishes KV events."""

    def stored(self, parent: BlockHash | None, hashes: list[BlockHash]) -> None: ...
    def removed(self, hashes: list[BlockHash]) -> None: ...


@mypyc_attr(acyclic=True)
class CachedBlock:
    """A block with an identity: its hash, how many sequences use it, and, while none does,
    its neighbours in the free LRU (older towards the oldest, newer towards the newest).

    Compiled, the collector does not track it: at 512 workers a run holds half a million, and
    tracked, each was linked into the collector's lists when made and unlinked when freed,
    touching two neighbours long gone from the CPU's caches. The only cycle among blocks, the
    free LRU, is broken by its manager: when it forgets its blocks, and when it is freed."""

    __slots__ = ("hash", "ref", "older", "newer")

    def __init__(self, block_hash: Hashable, ref: int, end: CachedBlock | None = None) -> None:
        self.hash = block_hash
        self.ref = ref
        # Out of the LRU a block points at its end, never at another block: an evicted block
        # then keeps nothing alive and is freed by reference counting alone.
        self.older: CachedBlock = self if end is None else end
        self.newer: CachedBlock = self if end is None else end


# What a block out of every LRU points at once its manager let it go (itself an LRU end of none).
_DETACHED: Final = CachedBlock(None, 0)


class BlockTable:
    """The blocks one sequence holds: hashed prefix blocks, then anonymous ones."""

    __slots__ = ("hashed", "num_anonymous")

    def __init__(self) -> None:
        self.hashed: list[CachedBlock] = []
        self.num_anonymous = 0

    def __len__(self) -> int:
        return len(self.hashed) + self.num_anonymous


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, events: KVEventSink | None = None) -> None:
        assert num_blocks > 0 and block_size > 0, "a KV cache needs blocks"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self._blocks: dict[Hashable, CachedBlock] = {}  # every hashed block, in use or free
        # The free LRU's two ends in one: its `newer` is the oldest free block, its `older`
        # the newest (itself both when the LRU is empty).
        self._lru = CachedBlock(None, 0)
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
        # num_free inlined: the engine reads this on every decode catch-up.
        return self.num_blocks - self._num_empty - self._num_free_cached

    def forget(self) -> None:
        """Every cached block forgotten, once no sequence holds one (a finished run): out of
        the free LRU, which links them both ways, reference counting frees them now."""
        if self.num_used:
            raise RuntimeError(f"forget: sequences hold {self.num_used} blocks")
        self._detach()
        self._lru = CachedBlock(None, 0)
        self._blocks.clear()
        self._num_free_cached = 0
        self._num_empty = self.num_blocks

    def __del__(self) -> None:
        # Dropped unforgotten (a run not released), the LRU's cycle would keep every free block
        # alive for good: the collector, not tracking blocks, would never see it.
        self._detach()

    def _detach(self) -> None:
        """Point every block's links, the LRU's end's too, at no block of this manager's: the
        free LRU's cycle is gone, and a block is freed once no table or dict holds it."""
        for block in self._blocks.values():
            block.older = block.newer = _DETACHED
        end = self._lru
        end.older = end.newer = _DETACHED

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_cached_prefix(self, hashes: list[BlockHash], limit: int) -> int:
        """Leading blocks of `hashes` (at most `limit`) present in the cache."""
        # By index, here and below: a slice would copy a prompt's hashes, thousands for a
        # long one, at every admission.
        blocks, keys = self._blocks, as_keys(hashes)
        n, stop = 0, min(limit, len(keys))
        while n < stop and keys[n] in blocks:
            n += 1
        return n

    def num_free_after_hit(self, hashes: list[BlockHash], num_hit: int) -> int:
        """Free blocks left once the first `num_hit` cached blocks of `hashes` are pinned."""
        blocks, keys = self._blocks, as_keys(hashes)
        pinned = 0
        for i in range(num_hit):
            if blocks[keys[i]].ref == 0:
                pinned += 1
        return self.num_free - pinned

    def is_cached(self, h: BlockHash) -> bool:
        return h in self._blocks

    def cached_hashes(self) -> set[BlockHash]:
        """Every block with an identity: in use or free and still reusable."""
        return cast(set[BlockHash], set(self._blocks))

    # --------------------------------------------------------------- mutations

    def pin_prefix(self, table: BlockTable, hashes: list[BlockHash], num_hit: int) -> None:
        """Share the first `num_hit` cached blocks of `hashes` with a new sequence."""
        assert not len(table), "a prefix is pinned before anything else is allocated"
        blocks, hashed, keys = self._blocks, table.hashed, as_keys(hashes)
        for i in range(num_hit):
            block = blocks[keys[i]]
            if block.ref == 0:
                self._unlink(block)
            block.ref += 1
            hashed.append(block)

    def allocate(self, table: BlockTable, num_new: int) -> None:
        """Give `table` `num_new` anonymous blocks, evicting the oldest free cached ones."""
        assert num_new <= self.num_free, f"allocating {num_new} with {self.num_free} free"
        take_empty = min(num_new, self._num_empty)
        self._num_empty -= take_empty
        if num_new > take_empty:
            num_evicted = num_new - take_empty
            self.num_evictions += num_evicted
            if self.events is None:
                for _i in range(num_evicted):
                    self._drop_oldest()
            else:
                evicted = [self._drop_oldest() for _ in range(num_evicted)]
                self.events.removed(cast(list[BlockHash], evicted))
        table.num_anonymous += num_new

    def commit_full_blocks(
        self, table: BlockTable, hashes: list[BlockHash], num_computed_blocks: int
    ) -> None:
        """Name the table's anonymous blocks that now hold full, computed prompt blocks.

        If another sequence computed the same block meanwhile, ours stays anonymous (a
        duplicate, as in vLLM) and the hashed run of this table ends there.
        """
        blocks, hashed, lru, keys = self._blocks, table.hashed, self._lru, as_keys(hashes)
        start = len(hashed)
        # Two at a time: compiled, a min of three is a call into the interpreter.
        stop = min(min(num_computed_blocks, len(keys)), start + table.num_anonymous)
        for i in range(start, stop):
            block = CachedBlock(keys[i], 1, lru)
            if blocks.setdefault(block.hash, block) is not block:  # computed meanwhile
                break
            hashed.append(block)
        table.num_anonymous -= len(hashed) - start
        if self.events is not None and len(hashed) > start:
            parent = cast(BlockHash, hashed[start - 1].hash) if start else None
            self.events.stored(parent, cast(list[BlockHash], [b.hash for b in hashed[start:]]))

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody is using (vLLM's /reset_prefix_cache; also what a
        restarted server starts with). Returns how many were dropped."""
        dropped = [self._drop_oldest() for _ in range(self._num_free_cached)]
        self._num_empty += len(dropped)
        if self.events is not None and dropped:
            self.events.removed(cast(list[BlockHash], dropped))
        return len(dropped)

    def free(self, table: BlockTable) -> None:
        """Release every block of `table`, tail first."""
        self._num_empty += table.num_anonymous
        lru = self._lru
        for block in reversed(table.hashed):
            block.ref -= 1
            if block.ref == 0:  # the newest free block
                newest = lru.older
                block.older = newest
                block.newer = lru
                newest.newer = block
                lru.older = block
                self._num_free_cached += 1
        table.hashed.clear()
        table.num_anonymous = 0

    def _drop_oldest(self) -> Hashable:
        """Forget the oldest free cached block (evicted, or reset); its hash."""
        oldest = self._lru.newer
        self._unlink(oldest)
        del self._blocks[oldest.hash]
        return oldest.hash

    def _unlink(self, block: CachedBlock) -> None:
        """Take a free block out of the LRU (it is pinned again, or evicted)."""
        older, newer = block.older, block.newer
        older.newer = newer
        newer.older = older
        block.older = block.newer = self._lru
        self._num_free_cached -= 1

    def check_integrity(self, tables: Sequence[BlockTable]) -> None:
        refs: dict[Hashable, int] = {}
        for t in tables:
            for b in t.hashed:
                assert self._blocks.get(b.hash) is b, f"block {b.hash}: held but not cached"
                refs[b.hash] = refs.get(b.hash, 0) + 1
        held = sum(t.num_anonymous for t in tables) + len(refs)  # a shared block counts once
        assert held == self.num_used, f"sequences hold {held} blocks, manager says {self.num_used}"
        assert self.num_used <= self.num_blocks, "more blocks used than exist"
        free: set[Hashable] = set()
        lru = self._lru
        b = lru.newer
        while b is not lru:
            assert b.newer.older is b, f"block {b.hash}: LRU links disagree"
            free.add(b.hash)
            b = b.newer
        assert len(free) == self._num_free_cached, "free LRU and its count disagree"
        for h, block in self._blocks.items():
            r = block.ref
            assert refs.get(h, 0) == r, f"block {h}: ref {r}, held by {refs.get(h, 0)}"
            assert (r == 0) == (h in free), f"block {h}: ref {r} vs free list"
        assert self._num_empty >= 0, "negative empty count"


def as_keys(hashes: list[BlockHash]) -> list[Hashable]:
    """`hashes` read as the dictionary keys they are: compiled, an int read from a list is
    converted to a machine integer and back to a new object at every lookup."""
    return cast(list[Hashable], hashes)
