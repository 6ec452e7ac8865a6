"""The prefix-cache hit bound: what one unbounded cache shared by all workers would hit.

A replay shows it every request, so it is compiled (router/runtime/native.py): as plain Python
its walk over each prompt's leading blocks took about 6 % of the instructions of an 8-worker
replay of the Mooncake trace.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import cast

from router.request import BlockHash, Request


class InfiniteCache:
    """`observe` returns the cached tokens a request would get, in the order requests are shown:
    its leading full blocks seen before, keeping at least one token to compute (as the engine
    does), then remembers its blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._seen: set[Hashable] = set()
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def observe(self, request: Request) -> int:
        hashes, seen, block_size = as_keys(request.block_hashes), self._seen, self.block_size
        prompt_len = request.prompt_len
        full = min(len(hashes), prompt_len // block_size)
        cap = min(len(hashes), request.reusable_blocks(block_size))
        n = 0
        while n < cap and hashes[n] in seen:
            n += 1
        # The blocks before the first miss are remembered already: adding them again would
        # hash every block of every prompt, where a replay's prompts are mostly hits.
        for i in range(n, full):
            seen.add(hashes[i])
        self.prompt_tokens += prompt_len
        self.cached_tokens += n * block_size
        return n * block_size

    def forget(self) -> None:
        """Let go of the blocks seen (the rates stay): a cluster left in reference cycles
        would otherwise hold them for the collector to walk, each block a cache miss."""
        self._seen.clear()

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def as_keys(hashes: list[BlockHash]) -> list[Hashable]:
    """`hashes` read as the set's keys they are: compiled, an int read from a list is converted
    to a machine integer and back to a new object at every lookup."""
    return cast(list[Hashable], hashes)
