"""LoRA adapters on workers: which ones each worker holds, and where a request should go.

A worker holds at most `slots` adapters (vLLM's `--max-loras`; the simulated engine's adapter
slots): using one it lacks costs a load (seconds) and evicts its least recently used. The
router's belief follows what it routes, as the approximate prefix index does, and a worker's
own report (vLLM's /v1/models, the engine's state) replaces it when one comes.

Placement weighs the load against queueing: the request goes among the workers holding its
adapter unless some other worker would start it sooner even after loading it,

    min over holders of wait(w)  >  min over the others of wait(w) + load_time

with wait(w) the work `w` has in flight, in tokens, at the cost model's per-token prefill time
(linear: the work is many requests, not one prompt of that length, whose attention would make
it quadratic). The global policy then chooses among those candidates as it always does, so
every policy keeps its meaning. `affinity=False` routes as if blind to adapters (a baseline):
loads are still counted.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.prefix_index import WorkerId
from router.view import ClusterView, WorkerState


class AdapterSlots:
    """Per worker, its adapters from least to most recently used, and each adapter's holders."""

    def __init__(self, load_time: float = 0.0, affinity: bool = True) -> None:
        self.load_time = load_time
        self.affinity = affinity
        self._per_token: float | None = None  # the cost model's prefill seconds per token
        self._held: dict[WorkerId, dict[str, None]] = {}
        self._slots: dict[WorkerId, int] = {}
        self.holders: dict[str, set[WorkerId]] = {}
        self.loads = 0  # placements on a worker believed not to hold the adapter

    def add_worker(self, wid: WorkerId, slots: int = 0) -> None:
        """`slots`: how many adapters the worker holds at once (0: no limit)."""
        self._held[wid] = {}
        self._slots[wid] = slots

    def remove_worker(self, wid: WorkerId) -> None:
        for adapter in self._held.pop(wid, {}):
            self._forget(wid, adapter)
        self._slots.pop(wid, None)

    def holds(self, wid: WorkerId, adapter: str) -> bool:
        return adapter in self._held.get(wid, ())

    def use(self, wid: WorkerId, adapter: str) -> bool:
        """A request for `adapter` goes to `wid`: it is the most recently used there (loaded
        if it was not, evicting the least recently used beyond the slots). True if it was held."""
        held = self._held.setdefault(wid, {})
        was_held = adapter in held
        if was_held:
            del held[adapter]  # re-inserted last: most recently used
        else:
            self.loads += 1
            self.holders.setdefault(adapter, set()).add(wid)
            slots = self._slots.get(wid, 0)
            while slots and len(held) >= slots:
                self.drop(wid, next(iter(held)))
        held[adapter] = None
        return was_held

    def drop(self, wid: WorkerId, adapter: str) -> None:
        """The worker no longer holds `adapter` (evicted, unloaded, or it failed to load)."""
        held = self._held.get(wid)
        if held is not None and adapter in held:
            del held[adapter]
            self._forget(wid, adapter)

    def report(self, wid: WorkerId, adapters: Iterable[str]) -> None:
        """What the worker says it holds now; the order of use is kept where known."""
        if wid not in self._held:
            return
        now_held = set(adapters)
        held = self._held[wid]
        for adapter in [a for a in held if a not in now_held]:
            self.drop(wid, adapter)
        for adapter in now_held:
            if adapter not in held:
                held[adapter] = None
                self.holders.setdefault(adapter, set()).add(wid)

    def candidates(self, adapter: str, view: ClusterView) -> ClusterView:
        """The view a policy should route a request for `adapter` in: its healthy holders in
        `view`, or all of `view` when another worker would start it sooner after a load."""
        held_by = self.holders.get(adapter)
        if not held_by or not self.affinity:
            return view
        holders = [w for w in (view.workers.get(h) for h in held_by) if w is not None and w.healthy]
        if not holders:
            return view
        if self.load_time > 0 and view.cost is not None:
            # The least loaded worker of all: a holder wins outright; another is the best
            # non-holder (wait grows with the work in flight), read from a kept order.
            least = view.least(least_work)
            if least.id not in held_by:
                if self._per_token is None:
                    self._per_token = view.cost.prefill_time(PER_TOKEN_AT, 0) / PER_TOKEN_AT
                best_holder = min(w.tokens_in_flight for w in holders) * self._per_token
                if least.tokens_in_flight * self._per_token + self.load_time < best_holder:
                    return view
        if len(holders) == len(view.workers):
            return view
        return view.among({w.id: w for w in holders})

    def _forget(self, wid: WorkerId, adapter: str) -> None:
        holders = self.holders.get(adapter)
        if holders is not None:
            holders.discard(wid)
            if not holders:
                del self.holders[adapter]


PER_TOKEN_AT = 2048  # a typical prefill chunk: the per-token time the waits are priced at


def least_work(view: ClusterView, worker: WorkerState) -> tuple[int, int]:
    return (worker.tokens_in_flight, worker.id)
