"""Keep the garbage collector's full passes short while a large prefix index lives in the heap.

A million-block index is millions of long-lived objects; CPython's full collection walks them all
(10-15 ms here), and it lands inside whichever routing decision allocated last. `gc.freeze()`
moves everything alive into a permanent generation the collector no longer walks, so later
passes cost what was allocated since. Freezing again every `every` seconds keeps that bounded.

The price: a reference cycle that was alive at a freeze and dies later is reclaimed only at the
next `gc.unfreeze()` (the young generations are collected just before each freeze, so what is
already dead is not frozen). The index breaks its own cycles when it prunes a node, so what can
pile up is the proxy's per-request garbage; every `full_every` seconds, everything is unfrozen
and collected once (one long pause an hour, outside the p99.9 of decisions).
"""

from __future__ import annotations

import gc


class CollectorPacing:
    def __init__(self, every: float = 10.0, full_every: float = 3600.0) -> None:
        self.every, self.full_every = every, full_every
        self._last_freeze: float | None = None
        self._last_full: float | None = None

    def tick(self, now: float) -> None:
        """Call often (each decision is fine: it is two comparisons)."""
        if self._last_full is None:
            self._last_full = self._last_freeze = now
            gc.freeze()
        elif now - self._last_full >= self.full_every:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            self._last_full = self._last_freeze = now
        elif now - self._last_freeze >= self.every:
            gc.collect(1)  # young garbage goes now, not frozen with the living (well under 1 ms)
            gc.freeze()
            self._last_freeze = now
