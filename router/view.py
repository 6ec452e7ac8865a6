"""What a policy may see of the cluster: a snapshot-like view, never a clock or a socket."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from typing import Protocol

from router.cost_model import StepShape
from router.prefix_index import PrefixIndex, WorkerId


@dataclass(slots=True)
class WorkerState:
    """One worker as the router believes it is.

    `tokens_in_flight` counts work not yet done: prompt tokens not yet prefilled plus output
    tokens not yet generated, over the worker's waiting and running requests.
    """

    id: WorkerId
    healthy: bool = True
    num_waiting: int = 0
    num_running: int = 0
    tokens_in_flight: int = 0
    kv_used_blocks: int = 0
    kv_capacity_blocks: int = 0
    reported_waiting: int = -1  # requests it last said wait inside it; -1 before it says
    model: str | None = None  # its model group; None in a fleet of one model
    role: str = "mixed"  # router.traits.Role: mixed, prefill or decode

    @property
    def num_outstanding(self) -> int:
        return self.num_waiting + self.num_running

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_capacity_blocks if self.kv_capacity_blocks else 0.0


class CostEstimates(Protocol):
    """Time estimates policies may use (Preble's prefill-time terms); see router.cost_model."""

    def prefill_time(self, num_new_tokens: int, num_cached_tokens: int) -> float: ...

    def decode_time(self, num_seqs: int, context_tokens: int) -> float: ...

    def step_time(self, shape: StepShape) -> float: ...


# A worker's place in an order: a tuple ending in its id (so ties break by id and the id can be
# read back), computed from what the view knows of it.
OrderKey = Callable[["ClusterView", WorkerState], tuple]


class _KeyedWorkers:
    """The healthy workers' keys under one key function, re-computed only for the workers
    marked changed since the last read (the orders below keep them arranged)."""

    __slots__ = ("key", "pending", "_keys")

    def __init__(self, key: OrderKey, workers: dict[WorkerId, WorkerState]) -> None:
        self.key = key
        self.pending: set[WorkerId] = set(workers)
        self._keys: dict[WorkerId, tuple] = {}

    def _rekey(self, view: ClusterView) -> None:
        """Re-key each pending worker; `_moved` hears of each key that moved (None: not
        healthy). A loop calling a method, not a generator: compiled, each value a generator
        yields costs more than the re-key itself."""
        if not self.pending:
            return
        workers, keys, key = view.workers, self._keys, self.key
        for wid in self.pending:
            state = workers.get(wid)
            new = key(view, state) if state is not None and state.healthy else None
            old = keys.get(wid)
            if new == old:
                continue  # most changes move nothing this order reads (ids, queues)
            if new is None:
                del keys[wid]
            else:
                keys[wid] = new
            self._moved(old, new)
        self.pending.clear()

    def _moved(self, old: tuple | None, new: tuple | None) -> None:
        raise NotImplementedError


class WorkerOrder(_KeyedWorkers):
    """The healthy workers sorted by a key, kept sorted across decisions: reading the first
    or last costs the changed workers' moves instead of a pass over the fleet calling the key.

    One list, moved in by binary search: C code throughout, where a sorted list of sublists
    (sortedcontainers) runs about 10,000 instructions in the interpreter per move, and at these
    sizes is one sublist anyway (it splits past 2,000). A move shifts the entries between the
    old place and the new: a memmove of under 8 KB at 1,024 workers."""

    __slots__ = ("sorted",)

    def __init__(self, key: OrderKey, workers: dict[WorkerId, WorkerState]) -> None:
        super().__init__(key, workers)
        self.sorted: list[tuple] = []

    def refresh(self, view: ClusterView) -> list[tuple]:
        self._rekey(view)
        return self.sorted

    def _moved(self, old: tuple | None, new: tuple | None) -> None:
        keys = self.sorted
        if old is not None:  # keys end in the worker's id: each is there once
            del keys[bisect_left(keys, old)]
        if new is not None:
            insort(keys, new)


class LeastFirst(_KeyedWorkers):
    """A key only ever asked for its least worker (least_load's): a heap whose stale entries
    are dropped as they surface. A re-key is one push, where the sorted list takes a search
    and a move each way: at 512 workers least_load re-keys ~20 workers per request, as their
    decode progress is applied."""

    __slots__ = ("heap",)

    def __init__(self, key: OrderKey, workers: dict[WorkerId, WorkerState]) -> None:
        super().__init__(key, workers)
        self.heap: list[tuple] = []

    def refresh(self, view: ClusterView) -> list[tuple]:
        """The heap, its first entry the least key (an empty list: no healthy worker)."""
        self._rekey(view)
        keys, heap = self._keys, self.heap
        if len(heap) > 4 * len(keys) + 64:  # mostly stale entries below the top: start afresh
            heap[:] = keys.values()
            heapify(heap)
        while heap and keys.get(heap[0][-1]) != heap[0]:
            heappop(heap)
        return heap

    def _moved(self, old: tuple | None, new: tuple | None) -> None:
        if new is not None:
            heappush(self.heap, new)


@dataclass(slots=True)
class ClusterView:
    """The router's state as handed to a policy.

    The backend (simulator or proxy) owns and mutates it; policies read it and keep their own
    counters through the hooks. `now` is the backend's clock: simulated or monotonic seconds.

    `least` and `most` find a worker by a key. A view whose owner calls `changed(worker)`
    after every change to a worker's state or index holdings (`tracked`: the router core does)
    keeps an order per key and re-keys only changed workers; any other view (one a test builds
    by hand) takes a pass over the workers.
    """

    now: float
    workers: dict[WorkerId, WorkerState]
    index: PrefixIndex
    block_size: int
    cost: CostEstimates | None = None
    tracked: bool = False
    _orders: dict[OrderKey, WorkerOrder | LeastFirst] = field(default_factory=dict, repr=False)
    _healthy_ids: list[WorkerId] | None = field(default=None, repr=False)
    _healthy_set: frozenset[WorkerId] | None = field(default=None, repr=False)
    # Views over a part of the fleet (a model group's) sharing these WorkerStates: told of
    # every change to their workers here, so each keeps its own orders current.
    _parts: list[ClusterView] = field(default_factory=list, repr=False)
    _part_of: dict[WorkerId, ClusterView] = field(default_factory=dict, repr=False)

    def healthy_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.healthy]

    def healthy_ids(self) -> list[WorkerId]:
        """The healthy workers' ids, smallest first (read-only). A tracked view keeps the list
        until its owner calls `roster_changed`, so a policy that weighs the whole fleet per
        request (Preble) does not rebuild it each time."""
        if self._healthy_ids is not None:
            return self._healthy_ids
        ids = sorted(w.id for w in self.workers.values() if w.healthy)
        if self.tracked:
            self._healthy_ids = ids
        return ids

    def healthy_set(self) -> frozenset[WorkerId]:
        """The healthy workers' ids as a set, kept as `healthy_ids` is: `w in` it costs no
        Python call, where `is_healthy(w)` per holder of a shared prefix does."""
        if self._healthy_set is not None:
            return self._healthy_set
        ids = frozenset(self.healthy_ids())
        if self.tracked:
            self._healthy_set = ids
        return ids

    def is_healthy(self, wid: WorkerId) -> bool:
        state = self.workers.get(wid)
        return state is not None and state.healthy

    def roster_changed(self) -> None:
        """A worker joined or left, or went down or came back (a tracked view's owner calls it)."""
        self._healthy_ids = self._healthy_set = None
        for part in self._parts:
            part.roster_changed()

    def new_part(self) -> ClusterView:
        """An empty view over a part of this one's workers (`join_part` fills it), sharing its
        index and cost model and hearing of every change to its workers made through here."""
        view = ClusterView(self.now, {}, self.index, self.block_size, self.cost, self.tracked)
        self._parts.append(view)
        return view

    def among(self, workers: dict[WorkerId, WorkerState]) -> ClusterView:
        """A view over `workers` (some of this one's) for one decision: untracked, so it keeps
        no orders and a policy reading it takes a pass over them."""
        return ClusterView(self.now, workers, self.index, self.block_size, self.cost)

    def join_part(self, wid: WorkerId, part: ClusterView) -> None:
        part.workers[wid] = self.workers[wid]
        self._part_of[wid] = part
        part.changed(wid)
        part.roster_changed()

    def leave_part(self, wid: WorkerId) -> None:
        part = self._part_of.pop(wid, None)
        if part is not None:
            part.workers.pop(wid, None)
            part.changed(wid)
            part.roster_changed()

    def routable_workers(self) -> list[WorkerState]:
        """The healthy workers; a policy's `route` starts here, so none means an error."""
        workers = self.healthy_workers()
        if not workers:
            raise RuntimeError("no healthy worker to route to")
        return workers

    def least(self, key: OrderKey) -> WorkerState:
        """The healthy worker with the smallest `key(view, worker)`."""
        return self._end(key, 0)

    def most(self, key: OrderKey) -> WorkerState:
        """The healthy worker with the largest `key(view, worker)`."""
        return self._end(key, -1)

    def ordered(self, key: OrderKey) -> list[tuple]:
        """Every healthy worker's key, smallest first (read-only; ends in the worker's id)."""
        if not self.tracked:
            return sorted(key(self, w) for w in self.workers.values() if w.healthy)
        return self._order(key)

    def changed(self, wid: WorkerId) -> None:
        """What the view knows of `wid` changed: re-key it in every order before the next read."""
        # Called on every load change, and a policy reading no order keeps none: test before
        # making an iterator (compiled, that was most of a call).
        if self._orders:
            for order in self._orders.values():
                order.pending.add(wid)
        if self._part_of:
            part = self._part_of.get(wid)
            if part is not None:
                part.changed(wid)

    def changed_all(self) -> None:
        for order in self._orders.values():
            order.pending.update(self.workers)
        for part in self._parts:
            part.changed_all()

    def _end(self, key: OrderKey, end: int) -> WorkerState:
        if self.tracked:
            ordered = self._order(key, sort=end != 0)
            if ordered:
                return self.workers[ordered[end][-1]]
        else:
            healthy = self.healthy_workers()
            if healthy:
                pick = min if end == 0 else max
                return pick(healthy, key=lambda w: key(self, w))
        raise RuntimeError("no healthy worker to route to")

    def _order(self, key: OrderKey, sort: bool = True) -> list[tuple]:
        """The order kept for `key`: a heap until something other than its least is read."""
        order = self._orders.get(key)
        if order is None or (sort and isinstance(order, LeastFirst)):
            kind = WorkerOrder if sort else LeastFirst
            order = self._orders[key] = kind(key, self.workers)
        return order.refresh(self)
