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
it. The free LRU is a queue of blocks in the order they were freed. A cached block used again
keeps its place there, stale, rather than being unlinked from a list threaded through its
neighbours (as vLLM's free block queue is): at 512 workers those neighbours are long out of the
CPU's caches, two misses a pin. Freeing a sequence appends, evicting pops the oldest and skips
what went stale. Hashes are opaque here: kept as the objects the caller gave, never converted.
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
    """A block with an identity: its hash, how many sequences use it, and how many entries it
    has in its manager's free queue. While no sequence uses it, the last of those is its place
    in the LRU; every other is stale.

    Compiled, the collector does not track it (it refers to no block): at 512 workers a run
    holds half a million, and tracked, each was linked into the collector's lists when made and
    unlinked when freed, touching two neighbours long gone from the CPU's caches."""

    __slots__ = ("hash", "ref", "queued")

    def __init__(self, block_hash: Hashable, ref: int) -> None:
        self.hash = block_hash
        self.ref = ref
        self.queued = 0


# Stale entries a free queue may hold beyond its live ones before it is rebuilt without them.
STALE_SLACK: Final = 64
# Taken slots a free queue keeps at its front before it moves the rest up over them (and only
# once they are half of it, so that each entry is moved about once).
TRIM_AFTER: Final = 64
# What a free queue's slot holds once its block was taken out (itself in no queue).
_TAKEN: Final = CachedBlock(None, 0)


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
        # The free LRU, oldest first from `_oldest` on: a block is appended when its last user
        # frees it. Pinned again, it stays (stale) until it surfaces or the queue is rebuilt
        # (`_compact`). A list and an index, not a deque: compiled, a list's append and item
        # are direct calls, a deque's methods are looked up by name at every call.
        self._freed: list[CachedBlock] = []
        self._oldest = 0
        self.stale_slack = STALE_SLACK  # a module constant (tests push it to extremes)
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
        """Every cached block forgotten, once no sequence holds one (a finished run): freed now,
        by reference counting, where a dropped fleet's would wait for its engines to go."""
        if self.num_used:
            raise RuntimeError(f"forget: sequences hold {self.num_used} blocks")
        self._freed.clear()
        self._oldest = 0
        self._blocks.clear()
        self._num_free_cached = 0
        self._num_empty = self.num_blocks

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
        taken = 0
        for i in range(num_hit):
            block = blocks[keys[i]]
            if block.ref == 0:
                taken += 1  # out of the LRU: its entry in the queue is stale from now
            block.ref += 1
            hashed.append(block)
        if taken:
            self._num_free_cached -= taken
            if len(self._freed) - self._oldest > 2 * self._num_free_cached + self.stale_slack:
                self._compact()

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
        blocks, hashed, keys = self._blocks, table.hashed, as_keys(hashes)
        start = len(hashed)
        # Two at a time: compiled, a min of three is a call into the interpreter.
        stop = min(min(num_computed_blocks, len(keys)), start + table.num_anonymous)
        for i in range(start, stop):
            block = CachedBlock(keys[i], 1)
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
        freed, num_freed = self._freed, 0
        for block in reversed(table.hashed):
            block.ref -= 1
            if block.ref == 0:  # the newest free block
                freed.append(block)
                block.queued += 1
                num_freed += 1
        self._num_free_cached += num_freed
        table.hashed.clear()
        table.num_anonymous = 0

    def _drop_oldest(self) -> Hashable:
        """Forget the oldest free cached block (evicted, or reset); its hash."""
        freed, at = self._freed, self._oldest
        while True:
            oldest = freed[at]
            freed[at] = _TAKEN  # the queue no longer holds it: evicted, it is freed now
            at += 1
            if _was_its_place(oldest):
                break
        if at > TRIM_AFTER and 2 * at > len(freed):
            del freed[:at]
            at = 0
        self._oldest = at
        del self._blocks[oldest.hash]
        self._num_free_cached -= 1
        return oldest.hash

    def _compact(self) -> None:
        """The free queue without its stale entries, in the same order."""
        live: list[CachedBlock] = []
        for block in self.free_queue():
            if _was_its_place(block):
                block.queued = 1
                live.append(block)
        self._freed, self._oldest = live, 0

    def free_queue(self) -> list[CachedBlock]:
        """The free queue's entries, oldest first, stale ones included (a copy)."""
        return self._freed[self._oldest :]

    def check_integrity(self, tables: Sequence[BlockTable]) -> None:
        refs: dict[Hashable, int] = {}
        for t in tables:
            for b in t.hashed:
                assert self._blocks.get(b.hash) is b, f"block {b.hash}: held but not cached"
                refs[b.hash] = refs.get(b.hash, 0) + 1
        held = sum(t.num_anonymous for t in tables) + len(refs)  # a shared block counts once
        assert held == self.num_used, f"sequences hold {held} blocks, manager says {self.num_used}"
        assert self.num_used <= self.num_blocks, "more blocks used than exist"
        entries: dict[int, int] = {}
        free: set[Hashable] = set()
        for block in self.free_queue():
            assert self._blocks.get(block.hash) is block, f"block {block.hash}: queued, not cached"
            entries[id(block)] = entries.get(id(block), 0) + 1
            if entries[id(block)] == block.queued and block.ref == 0:
                free.add(block.hash)
        assert len(free) == self._num_free_cached, "free LRU and its count disagree"
        for h, block in self._blocks.items():
            assert block.queued == entries.get(id(block), 0), f"block {h}: entries in the queue"
            r = block.ref
            assert refs.get(h, 0) == r, f"block {h}: ref {r}, held by {refs.get(h, 0)}"
            assert (r == 0) == (h in free), f"block {h}: ref {r} vs free list"
        assert self._num_empty >= 0, "negative empty count"


def _was_its_place(block: CachedBlock) -> bool:
    """One of `block`'s entries leaves the free queue: was it the block's place in the LRU
    (its last entry, while no sequence uses it), and not a stale one?"""
    block.queued -= 1
    return block.queued == 0 and block.ref == 0


def as_keys(hashes: list[BlockHash]) -> list[Hashable]:
    """`hashes` read as the dictionary keys they are: compiled, an int read from a list is
    converted to a machine integer and back to a new object at every lookup."""
    return cast(list[Hashable], hashes)
