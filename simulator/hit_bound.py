"""The prefix-cache hit bound: what one unbounded cache shared by all workers would hit.

A replay shows it every request, so it is compiled (router/runtime/native.py): as plain Python
its walk over each prompt's leading blocks took about 6 % of the instructions of an 8-worker
replay of the Mooncake trace.
"""

from __future__ import annotations

from router.request import Request
from simulator.cached_blocks import new_store


class InfiniteCache:
    """`observe` returns the cached tokens a request would get, in the order requests are shown:
    its leading full blocks seen before, keeping at least one token to compute (as the engine
    does), then remembers its blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # Every block seen, in a store of cached blocks, each held for good: in C, about 40
        # bytes a block where a set and its ints take about 70, and a tiled fleet's trace
        # names hundreds of thousands.
        self._seen = new_store()
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def observe(self, request: Request) -> int:
        hashes, seen, block_size = request.block_hashes, self._seen, self.block_size
        prompt_len = request.prompt_len
        full = min(len(hashes), prompt_len // block_size)
        n = seen.prefix(hashes, min(len(hashes), request.reusable_blocks(block_size)))
        # The blocks before the first miss are remembered already.
        seen.remember(hashes, n, full)
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
