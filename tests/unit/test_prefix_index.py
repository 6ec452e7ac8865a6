"""The radix index against a brute-force oracle, with integrity checked after every operation."""

from __future__ import annotations

import random

import pytest

from router.prefix_index import PrefixIndex


class Oracle:
    """Per worker, the set of prefixes (as tuples) it holds."""

    def __init__(self) -> None:
        self.held: dict[int, set[tuple[int, ...]]] = {}

    def insert(self, hashes: list[int], worker: int) -> None:
        prefixes = self.held.setdefault(worker, set())
        for i in range(1, len(hashes) + 1):
            prefixes.add(tuple(hashes[:i]))

    def remove_worker(self, worker: int) -> None:
        self.held.pop(worker, None)

    def match(self, hashes: list[int]) -> dict[int, int]:
        out = {}
        for w, prefixes in self.held.items():
            n = 0
            while n < len(hashes) and tuple(hashes[: n + 1]) in prefixes:
                n += 1
            if n:
                out[w] = n
        return out

    def num_blocks(self, worker: int) -> int:
        return len(self.held.get(worker, ()))


def random_prompt(rng: random.Random, trunks: list[list[int]]) -> list[int]:
    """A prompt that shares a random-length prefix with one of a few trunks, then diverges.
    Hashes are drawn from a large range, so they behave as chained ones: prompts that differ at
    a block differ at every block after it."""
    trunk = rng.choice(trunks)
    keep = rng.randint(0, len(trunk))
    return trunk[:keep] + [rng.randrange(10**9) for _ in range(rng.randint(0, 6))]


def make_trunks(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(10**9) for _ in range(rng.randint(3, 20))] for _ in range(5)]


class TestMatchAgainstOracle:
    @pytest.mark.parametrize("seed", range(8))
    def test_random_inserts_and_removals(self, seed: int) -> None:
        rng = random.Random(seed)
        trunks = make_trunks(rng)
        index, oracle = PrefixIndex(), Oracle()
        for step in range(400):
            prompt = random_prompt(rng, trunks)
            if rng.random() < 0.03:
                w = rng.randrange(4)
                index.remove_worker(w)
                oracle.remove_worker(w)
            elif prompt:
                w = rng.randrange(4)
                held = oracle.match(prompt).get(w, 0)
                # What a worker holds is prefix-closed: what is not new is what it held.
                assert index.insert(prompt, w, now=float(step)) == len(prompt) - held
                oracle.insert(prompt, w)
            index.check_integrity()
            probe = random_prompt(rng, trunks)
            expected = oracle.match(probe)
            assert index.match(probe) == expected, f"step {step}"
            k = rng.randint(0, len(probe))
            assert index.match(probe, more_than=k) == {w: m for w, m in expected.items() if m > k}
            assert [index.match_of(probe, w) for w in range(4)] == [
                expected.get(w, 0) for w in range(4)
            ]
            eligible = set(rng.sample(range(4), rng.randint(0, 4)))
            longest = max((expected.get(w, 0) for w in eligible), default=0)
            holders = [w for w in eligible if longest and expected.get(w) == longest]
            length, found = index.longest_match(probe, eligible)
            found = sorted(w for w in found if w in eligible)  # every holder: some not eligible
            assert (length, found) == (longest, sorted(holders)), f"step {step}"
            w = rng.randrange(4)
            assert index.touch(probe, w, now=step + 0.5) == oracle.match(probe).get(w, 0)
            index.check_integrity()
            for w in range(4):
                assert index.num_blocks(w) == oracle.num_blocks(w), f"worker {w} at step {step}"

    def test_split_keeps_holders_on_both_sides(self) -> None:
        index = PrefixIndex()
        index.insert([1, 2, 3, 4], worker=0, now=1.0)
        index.insert([1, 2, 9], worker=1, now=2.0)
        index.check_integrity()
        assert index.match([1, 2, 3, 4]) == {0: 4, 1: 2}
        assert index.match([1, 2, 9, 9]) == {0: 2, 1: 3}
        assert index.match([7]) == {}

    @pytest.mark.parametrize("diverge_at", [1, 2, 3, 250, 498, 499])
    def test_a_prompt_leaving_a_long_edge_anywhere(self, diverge_at: int) -> None:
        # The walk bisects for the divergence: every position must come out exact.
        doc = list(range(1000, 1500))
        index = PrefixIndex()
        index.insert(doc, worker=0, now=1.0)
        prompt = doc[:diverge_at] + [7, 8]
        assert index.match(prompt) == {0: diverge_at}
        assert index.touch(prompt, worker=0, now=2.0) == diverge_at
        assert index.insert(prompt, worker=1, now=3.0) == diverge_at + 2
        index.check_integrity()
        assert index.match(doc) == {0: 500, 1: diverge_at}
        assert [len(n.key) for n in index.path(doc)] == [diverge_at, 500 - diverge_at]


class TestEviction:
    def test_evicts_least_recently_used_leaves_first(self) -> None:
        index = PrefixIndex()
        index.insert([1, 2, 3], worker=0, now=1.0)  # old branch
        index.insert([1, 2, 4], worker=0, now=2.0)
        index.insert([5, 6], worker=0, now=3.0)
        assert index.num_blocks(0) == 6
        index.evict(0, capacity_blocks=5)
        index.check_integrity()
        assert index.match([1, 2, 3]) == {0: 2}, "the oldest leaf [3] goes first"
        assert index.match([1, 2, 4]) == {0: 3}
        index.evict(0, capacity_blocks=2)
        index.check_integrity()
        assert index.match([5, 6]) == {0: 2}, "the most recent branch survives"
        assert index.match([1, 2, 4]) == {}

    def test_touch_by_reinsert_protects(self) -> None:
        index = PrefixIndex()
        index.insert([1, 2], worker=0, now=1.0)
        index.insert([3, 4], worker=0, now=2.0)
        index.insert([1, 2], worker=0, now=3.0)  # touched again
        index.evict(0, capacity_blocks=2)
        assert index.match([1, 2]) == {0: 2}
        assert index.match([3, 4]) == {}

    def test_other_workers_unaffected_and_empty_branches_pruned(self) -> None:
        index = PrefixIndex()
        index.insert([1, 2, 3], worker=0, now=1.0)
        index.insert([1, 2, 3], worker=1, now=1.0)
        index.insert([8, 9], worker=0, now=2.0)
        index.evict(0, capacity_blocks=0)
        index.check_integrity()
        assert index.num_blocks(0) == 0
        assert index.match([1, 2, 3]) == {1: 3}
        assert all(n.workers for n in index.nodes()), "no holderless nodes remain"

    @pytest.mark.parametrize("seed", range(6))
    def test_capacity_is_respected_under_random_load(self, seed: int) -> None:
        rng = random.Random(seed)
        trunks = make_trunks(rng)
        index = PrefixIndex()
        capacity = 25
        for step in range(500):
            prompt = random_prompt(rng, trunks)
            if not prompt:
                continue
            index.insert(prompt, 0, now=float(step))
            index.evict(0, capacity)
            index.check_integrity()
            assert index.num_blocks(0) <= capacity
            # What was just inserted is the most recent; it survives unless it alone overflows.
            if len(prompt) <= capacity:
                assert index.match(prompt) == {0: len(prompt)}

    def test_hit_counts_expire_with_the_window(self) -> None:
        index = PrefixIndex(hit_window=10.0)
        for t in (0.0, 1.0, 2.0):
            index.insert([1, 2], worker=0, now=t)
        node = index.path([1, 2])[0]
        assert index.hit_count(node, now=5.0) == 3
        assert index.hit_count(node, now=11.5) == 1


class TestTouch:
    def test_a_reused_prefix_becomes_recent_without_new_blocks(self) -> None:
        index = PrefixIndex()
        index.insert([1, 2], worker=0, now=1.0)
        index.insert([3, 4], worker=0, now=2.0)
        assert index.touch([1, 2, 5], worker=0, now=3.0) == 2  # 5 is not claimed
        assert index.num_blocks(0) == 4 and index.touch([1, 2], worker=1, now=3.0) == 0
        (node,) = index.path([1, 2])
        assert index.hit_count(node, now=3.0) == 2  # the insert and the reuse
        index.evict(0, capacity_blocks=2)
        assert index.match([1, 2]) == {0: 2} and index.match([3, 4]) == {}
        index.check_integrity()

    def test_extending_a_prefix_counts_no_reuse_of_it(self) -> None:
        # A KV event storing blocks after a known prefix: the prefix was not used again.
        index = PrefixIndex()
        index.insert([1, 2], worker=0, now=1.0)
        index.insert([1, 2, 3], worker=0, now=2.0, hits_from=2)
        prefix, tail = index.path([1, 2, 3])
        assert (index.hit_count(prefix, 2.0), index.hit_count(tail, 2.0)) == (1, 1)
        assert prefix.workers[0] == 2.0, "still refreshed: the prefix is in use"
