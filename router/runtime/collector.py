"""Pace CPython's garbage collector, two ways: for short pauses while the live proxy serves
(CollectorPacing), and for throughput while a simulation runs (`paced_for_throughput`).

Live: keep the collector's pauses short while a large prefix index lives in the heap.

A routing decision allocates little that dies in a cycle, but what it keeps is the index's new
nodes, so CPython's collector keeps walking objects that will live on, and lands each walk inside
whichever decision allocated last (`make bench` times them, 1M-block index, defaults):

    pass     what it walks                                    every             cost
    gen 0    allocations since the last pass (700)            ~90 decisions     0.1-0.2 ms
    gen 1    the survivors of the last 10 gen-0 passes        ~1000 decisions   1-1.5 ms
    gen 2    the whole heap, index included                   when it grows     40-70 ms

CollectorPacing reshapes all three:
- `gc.freeze()` moves everything alive into a permanent generation no pass walks: at the first
  tick, and every `every` seconds after collecting the young generations (so what is already dead
  is not frozen). Gen 2 then only ever holds what survived since the last freeze, and is left to
  these freezes: it is never collected on its own.
- The young passes come often and small: gen 0 every `gen0_threshold` allocations (200, not 700),
  gen 1 once more than `gen1_threshold` gen-0 passes ran (3, not 10), so no pass walks much more
  than CPython's gen 0 does. The work is about the same in total, and cheaper per object while
  what a pass walks is still in the CPU's caches (gen-0 passes: ~150 us at 700, ~40 at 200).

The price: a reference cycle that was alive at a freeze and dies later is reclaimed only at the
next `gc.unfreeze()`. The index breaks its own cycles when it prunes a node, so what can pile up
is the proxy's per-request garbage; every `full_every` seconds everything is unfrozen and
collected once (one long pause an hour, outside the p99.9 of decisions).

A simulation: no decision waits on a pause, only the run's total time counts. A run keeps much
of what it allocates for long (the trace, records, each engine's cached KV blocks, the index)
and frees the rest by reference counting: the simulator's own objects make no cyclic garbage
while it runs (tests/unit/test_collector.py checks each policy and feature). So the collector's
walks are pure cost, and a walk costs each object it visits a cache miss or two: the default
collector walks a growing heap again and again, 23 % of the CPU of a 2,048-worker run
(least_load, tiled). `paced_for_throughput` freezes everything alive at the start (no pass walks
it), runs a young pass only once a million objects more are alive, and never collects what
survived one until the run is over. Each object that lives on is then walked once: the first
120 s tiled onto 1,024 workers spent about 0.7 s in the collector, where young passes every
50,000 allocations and older ones every 50 of those spent about 1.7 s. A pass every million
still bounds the garbage a policy's own cycles could pile up. The most numerous objects, the
engines' cached blocks (about a million there), are not tracked at all
(simulator.block_manager); a finished run's blocks and the hit bound's are released to
reference counting (`SimCluster.release`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

NEVER = 1 << 30  # a gen-2 threshold no count reaches: gen 2 is left to the freezes


class CollectorPacing:
    """Process-wide, as the collector is: the thresholds hold until `stop`."""

    def __init__(
        self,
        every: float = 10.0,
        full_every: float = 3600.0,
        gen0_threshold: int = 200,
        gen1_threshold: int = 3,
    ) -> None:
        if gen0_threshold < 1 or gen1_threshold < 0:
            raise ValueError(f"thresholds {gen0_threshold}, {gen1_threshold}: need >= 1, >= 0")
        self.every, self.full_every = every, full_every
        self.gen0_threshold, self.gen1_threshold = gen0_threshold, gen1_threshold
        self._last_freeze: float | None = None
        self._last_full: float | None = None
        self._thresholds: tuple[int, int, int] | None = None  # CPython's, while paced

    def tick(self, now: float) -> None:
        """Call often (each decision is fine: it is two comparisons)."""
        last_full, last_freeze = self._last_full, self._last_freeze
        if last_full is None or last_freeze is None:
            self._start()
            self._last_full = self._last_freeze = now
        elif now - last_full >= self.full_every:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            self._last_full = self._last_freeze = now
        elif now - last_freeze >= self.every:
            gc.collect(1)  # young garbage goes now, not frozen with the living (well under 1 ms)
            gc.freeze()
            self._last_freeze = now

    def stop(self) -> None:
        """Hand the collector back as it was: CPython's thresholds, nothing frozen."""
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            gc.unfreeze()
        self._thresholds = None
        self._last_full = self._last_freeze = None

    def _start(self) -> None:
        self._thresholds = gc.get_threshold()
        gc.set_threshold(self.gen0_threshold, self.gen1_threshold, NEVER)
        gc.freeze()  # no collection first: at startup it would be the longest pause of all


BATCH_THRESHOLDS = (1_000_000, NEVER, NEVER)  # gen 0, 1, 2: see the module's docstring


@contextlib.contextmanager
def paced_for_throughput() -> Iterator[None]:
    """The collector paced for a batch run (a simulation) while the block runs. Process-wide,
    as the collector is; handed back as it was, even when the block raises (a caller's own
    freeze is left alone: unfreezing would undo it)."""
    thresholds = gc.get_threshold()
    freezes = gc.get_freeze_count() == 0
    if freezes:
        gc.freeze()
    gc.set_threshold(*BATCH_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freezes:
            gc.unfreeze()
