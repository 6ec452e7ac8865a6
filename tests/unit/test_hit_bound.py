"""The prefix-cache hit bound (simulator/hit_bound.py) against its definition: one unbounded set of
the blocks seen, a request's hit its leading blocks found there (the last prompt token always
computed), then every full block of its prompt remembered.

Hashes are drawn from a small pool so that prompts repeat blocks in any order, not only chained
prefixes: a block seen before can follow a miss, and a prompt can name one block twice.
"""

from __future__ import annotations

import random

import pytest

from router.request import Request
from simulator.hit_bound import InfiniteCache


def by_definition(requests: list[Request], block_size: int) -> tuple[list[int], float]:
    seen: set[int] = set()
    hits, prompt, cached = [], 0, 0
    for r in requests:
        cap = min(len(r.block_hashes), (r.prompt_len - 1) // block_size)
        n = 0
        while n < cap and r.block_hashes[n] in seen:
            n += 1
        seen.update(r.block_hashes[: min(len(r.block_hashes), r.prompt_len // block_size)])
        hits.append(n * block_size)
        prompt += r.prompt_len
        cached += n * block_size
    return hits, cached / prompt


def random_requests(rng: random.Random, count: int, block_size: int) -> list[Request]:
    pool = [rng.randrange(-(2**63), 2**63) for _ in range(rng.choice([3, 20, 400]))]
    requests = []
    for i in range(count):
        blocks = rng.randrange(0, 12)
        if requests and rng.random() < 0.5:  # a later turn: an earlier prompt, then more
            hashes = requests[rng.randrange(len(requests))].block_hashes[: rng.randrange(8)]
            hashes = hashes + [rng.choice(pool) for _ in range(blocks)]
        else:
            hashes = [rng.choice(pool) for _ in range(blocks)]
        # A prompt's length may end inside its last block, exactly on it, or short of it.
        prompt_len = max(1, len(hashes) * block_size + rng.randrange(-block_size, block_size))
        requests.append(Request(i, float(i), prompt_len, 1, hashes))
    return requests


@pytest.mark.parametrize("seed", range(40))
def test_the_bound_is_its_definition(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    requests = random_requests(rng, rng.randrange(1, 300), block_size)
    expected_hits, expected_rate = by_definition(requests, block_size)
    bound = InfiniteCache(block_size)
    assert [bound.observe(r) for r in requests] == expected_hits
    assert bound.hit_rate == pytest.approx(expected_rate)


def test_forgetting_keeps_the_rate_and_starts_cold() -> None:
    a = Request(0, 0.0, 32, 1, [1, 2])
    bound = InfiniteCache(16)
    assert bound.observe(a) == 0
    assert bound.observe(a) == 16  # the second block holds the last token: computed
    rate = bound.hit_rate
    bound.forget()
    assert bound.hit_rate == rate
    assert bound.observe(a) == 0
