"""The KV block manager against a plain model of vLLM's prefix cache, operation by operation.

The model keeps what the manager must: a reference count per cached block, and the free cached
blocks in the order they were freed (an ordered dict), evicted oldest first. Random sequences
of admissions, commits, frees and resets must leave both with the same blocks, the same free
order and the same KV events.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from simulator.block_manager import BlockManager, BlockTable
from simulator.cached_blocks import STALE_SLACK


class Events:
    def __init__(self) -> None:
        self.log: list[tuple] = []

    def stored(self, parent: int | None, hashes: list[int]) -> None:
        self.log.append(("stored", parent, list(hashes)))

    def removed(self, hashes: list[int]) -> None:
        self.log.append(("removed", list(hashes)))


class Model:
    """What the manager must do, the plainest way."""

    def __init__(self, num_blocks: int) -> None:
        self.ref: dict[int, int] = {}
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.empty = num_blocks
        self.events = Events()

    def hit(self, hashes: list[int], limit: int) -> int:
        n = 0
        while n < min(limit, len(hashes)) and hashes[n] in self.ref:
            n += 1
        return n

    def admit(self, table: list, hashes: list[int], num_hit: int, num_new: int) -> None:
        for h in hashes[:num_hit]:
            if self.ref[h] == 0:
                del self.free_cached[h]
            self.ref[h] += 1
            table[0].append(h)
        take = min(num_new, self.empty)
        self.empty -= take
        evicted = [self.free_cached.popitem(last=False)[0] for _ in range(num_new - take)]
        for h in evicted:
            del self.ref[h]
        if evicted:
            self.events.removed(evicted)
        table[1] += num_new

    def commit(self, table: list, hashes: list[int], num_computed: int) -> None:
        hashed, start = table[0], len(table[0])
        for h in hashes[start : min(num_computed, start + table[1])]:
            if h in self.ref:
                break
            self.ref[h] = 1
            hashed.append(h)
        table[1] -= len(hashed) - start
        if len(hashed) > start:
            self.events.stored(hashed[start - 1] if start else None, hashed[start:])

    def free(self, table: list) -> None:
        self.empty += table[1]
        for h in reversed(table[0]):
            self.ref[h] -= 1
            if self.ref[h] == 0:
                self.free_cached[h] = None
        table[0], table[1] = [], 0

    def reset(self) -> int:
        dropped = list(self.free_cached)
        for h in dropped:
            del self.ref[h]
        self.free_cached.clear()
        self.empty += len(dropped)
        if dropped:
            self.events.removed(dropped)
        return len(dropped)


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Chained prompts sharing prefixes: each extends a random earlier one's prefix."""
    prompts: list[list[int]] = []
    next_id = 0
    for _ in range(count):
        base = rng.choice(prompts)[: rng.randint(0, 6)] if prompts and rng.random() < 0.7 else []
        extra = rng.randint(1, 6)
        prompts.append(base + list(range(next_id, next_id + extra)))
        next_id += extra
    return prompts


@pytest.mark.parametrize("seed", range(12))
def test_matches_the_model_operation_by_operation(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.choice([8, 16, 40])
    events = Events()
    manager, model = BlockManager(num_blocks, 16, events), Model(num_blocks)
    # Pinned again, a free block leaves a stale entry in the free queue: rebuilt without them
    # past a slack, which only a long run reaches at its default.
    manager.cached.stale_slack = rng.choice([0, 3, STALE_SLACK])
    prompts = _prompts(rng, 60)
    running: list[tuple[BlockTable, list, list[int]]] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.45:  # admit a prompt from its cached prefix, then compute part of it
            hashes = rng.choice(prompts)
            limit = rng.randint(0, len(hashes))
            hit = manager.num_cached_prefix(hashes, limit)
            assert hit == model.hit(hashes, limit)
            pinned_free = manager.num_free - manager.num_free_after_hit(hashes, hit)
            assert pinned_free == sum(1 for h in hashes[:hit] if model.ref[h] == 0)
            need = rng.randint(0, len(hashes) - hit + 1)
            if need > manager.num_free_after_hit(hashes, hit):
                continue
            table, twin = BlockTable(), [[], 0]
            manager.pin_prefix(table, hashes, hit)
            manager.allocate(table, need)
            model.admit(twin, hashes, hit, need)
            computed = rng.randint(hit, len(table))
            manager.commit_full_blocks(table, hashes, computed)
            model.commit(twin, hashes, computed)
            running.append((table, twin, hashes))
        elif op < 0.85 and running:  # a sequence finishes or is preempted
            table, twin, _ = running.pop(rng.randrange(len(running)))
            manager.free(table)
            model.free(twin)
        elif op < 0.97 and running:  # a running sequence grows by a block and commits more
            table, twin, hashes = rng.choice(running)
            if manager.num_free:
                manager.allocate(table, 1)
                model.admit(twin, hashes, 0, 1)
                manager.commit_full_blocks(table, hashes, len(table))
                model.commit(twin, hashes, len(table))
        else:
            assert manager.reset_prefix_cache() == model.reset()
        manager.check_integrity([t for t, _, _ in running])
        assert manager.cached_hashes() == set(model.ref)
        assert manager.num_free == model.empty + len(model.free_cached)
        assert manager.num_empty == model.empty
        for t, twin, _ in running:
            assert t.hashed == twin[0] and t.num_anonymous == twin[1]
    assert events.log == model.events.log
    assert manager.num_evictions > 0, "no eviction tested"
    # The free order itself: evicting everything free goes oldest first, as the model does.
    table = BlockTable()
    manager.allocate(table, manager.num_free)
    model.admit([[], 0], [], 0, model.empty + len(model.free_cached))
    assert events.log == model.events.log


def test_forget_empties_the_cache_once_no_sequence_holds_a_block() -> None:
    blocks = BlockManager(num_blocks=8, block_size=4)
    table = BlockTable()
    blocks.allocate(table, 3)
    blocks.commit_full_blocks(table, [11, 12, 13], 3)
    with pytest.raises(RuntimeError, match="hold 3 blocks"):
        blocks.forget()
    blocks.free(table)
    assert blocks.is_cached(11) and blocks.num_free == 8
    blocks.forget()
    assert not blocks.is_cached(11) and blocks.num_empty == 8 and blocks.num_used == 0
    again = BlockTable()
    blocks.allocate(again, 2)  # usable as before
    assert blocks.num_used == 2


def test_a_prefix_used_again_and_again_keeps_its_place_and_the_queue_bounded() -> None:
    """A cached prefix pinned and freed over and over leaves a stale entry in the free queue
    each time: the queue is rebuilt before they pile up, and eviction still goes by the last
    free, oldest first."""
    events = Events()
    blocks = BlockManager(num_blocks=6, block_size=16, events=events)
    first, other = BlockTable(), BlockTable()
    blocks.allocate(first, 3)
    blocks.commit_full_blocks(first, [1, 2, 3], 3)
    blocks.allocate(other, 2)
    blocks.commit_full_blocks(other, [7, 8], 2)
    blocks.free(first)  # free, newest last: 3 2 1
    blocks.free(other)  # 3 2 1 8 7
    longest = 0
    for _ in range(10 * STALE_SLACK):
        again = BlockTable()
        blocks.pin_prefix(again, [1, 2, 3], 2)
        blocks.free(again)  # 3 8 7 2 1: the prefix's blocks move to the new end
        blocks.check_integrity([])
        longest = max(longest, len(blocks.free_queue()))
    assert longest <= 2 * blocks.num_free + STALE_SLACK, "stale entries piled up"
    taken = BlockTable()
    blocks.allocate(taken, 6)  # one empty block, then every cached one evicted
    assert events.log[-1] == ("removed", [3, 8, 7, 2, 1])
