"""What a policy may see of the cluster: a snapshot-like view, never a clock or a socket."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, final

from mypy_extensions import i64

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


# Worker ids as Python ints, each made once. Compiled, an id is a C integer, boxed anew each
# time it goes where an object goes (a set's item, a dict's key, a key's last term); past the
# ints CPython keeps (up to 256) each boxing is an allocation and a free: about 170 a request
# for least_load at 512 workers, none at 8.
BOXED_IDS: Final = 4096
_boxed_ids: Final[list[Any]] = list(range(BOXED_IDS))


def boxed_id(wid: WorkerId) -> Any:
    """`wid` as a Python int: below BOXED_IDS the same object every time."""
    if 0 <= wid < BOXED_IDS:
        return _boxed_ids[wid]
    return wid


# A worker's place in an order: a tuple ending in its id (so ties break by id and the id can be
# read back), computed from what the view knows of it.
OrderKey = Callable[["ClusterView", WorkerState], tuple]


class _KeyedWorkers:
    """The healthy workers' keys under one key function, re-computed only for the workers
    marked changed since the last read (the orders below keep them arranged, each re-keying
    its pending workers in `_rekey`: a loop, not a generator, since compiled each value a
    generator yields costs more than the re-key itself)."""

    __slots__ = ("key", "pending")

    def __init__(self, key: OrderKey, workers: dict[WorkerId, WorkerState]) -> None:
        self.key = key
        self.pending: set[WorkerId] = set(workers)


class WorkerOrder(_KeyedWorkers):
    """The healthy workers sorted by a key, kept sorted across decisions: reading the first
    or last costs the changed workers' moves instead of a pass over the fleet calling the key.

    One list, moved in by binary search: C code throughout, where a sorted list of sublists
    (sortedcontainers) runs about 10,000 instructions in the interpreter per move, and at these
    sizes is one sublist anyway (it splits past 2,000). A move shifts the entries between the
    old place and the new: a memmove of under 8 KB at 1,024 workers."""

    __slots__ = ("sorted", "_keys")

    def __init__(self, key: OrderKey, workers: dict[WorkerId, WorkerState]) -> None:
        super().__init__(key, workers)
        self.sorted: list[tuple] = []
        self._keys: dict[WorkerId, tuple] = {}  # each healthy worker's key in `sorted`

    def refresh(self, view: ClusterView) -> list[tuple]:
        self._rekey(view)
        return self.sorted

    def _rekey(self, view: ClusterView) -> None:
        if not self.pending:
            return
        workers, keys, key, ordered = view.workers, self._keys, self.key, self.sorted
        for wid in self.pending:
            boxed = boxed_id(wid)
            state = workers.get(boxed)
            new = key(view, state) if state is not None and state.healthy else None
            old = keys.get(boxed)
            if new == old:
                continue  # most changes move nothing this order reads (ids, queues)
            if old is not None:  # keys end in the worker's id: each is there once
                del ordered[bisect_left(ordered, old)]
            if new is None:
                del keys[boxed]
            else:
                keys[boxed] = new
                insort(ordered, new)
        self.pending.clear()


# Ints this close to zero convert to floats exactly, so their floats order as they do.
_EXACT_INT: Final = 2**53
_NAN: Final = float("nan")


@final
class _Keyed:
    """A worker's key in `LeastFirst`'s heap, and where in the heap it is. `first` is the
    key's first term as a float where that orders keys as their first terms do (NaN where not:
    every comparison with NaN is false, so the tuples decide)."""

    __slots__ = ("key", "first", "wid", "pos")

    def __init__(self, key: tuple, wid: WorkerId, pos: i64) -> None:
        self.key = key
        self.first = _first_term(key)
        self.wid = wid
        self.pos = pos


def _first_term(key: tuple) -> float:
    term = key[0]
    if isinstance(term, float):
        return term
    if isinstance(term, int) and -_EXACT_INT <= term <= _EXACT_INT:
        return float(term)
    return _NAN


class LeastFirst(_KeyedWorkers):
    """A key only ever asked for its least worker (least_load's, the shortest queue's): a
    binary heap holding each healthy worker once, which a re-key moves up or down from where
    the worker is. A comparison reads the keys' first terms as C doubles and compares the
    tuples only on a tie. At 512 workers least_load re-keys ~4 workers a request; a heap of
    tuples taking a push per re-key and popping stale entries (up to 4x the workers deep)
    cost 11k more instructions a request (docs/benchmarks.md)."""

    __slots__ = ("_heap", "_entries")

    def __init__(self, key: OrderKey, workers: dict[WorkerId, WorkerState]) -> None:
        super().__init__(key, workers)
        self._heap: list[_Keyed] = []
        self._entries: dict[WorkerId, _Keyed] = {}

    def least_id(self, view: ClusterView) -> WorkerId | None:
        """The least worker's id (None: no healthy worker)."""
        self._rekey(view)
        heap = self._heap
        return heap[0].wid if heap else None

    def _rekey(self, view: ClusterView) -> None:
        """Each pending worker's key against the one its entry holds: a second copy of the
        keys, by worker, cost a lookup and a store more per re-key (2.6k instructions a
        request for least_load at 512 workers)."""
        if not self.pending:
            return
        workers, entries, key, heap = view.workers, self._entries, self.key, self._heap
        for wid in self.pending:
            boxed = boxed_id(wid)
            state = workers.get(boxed)
            entry = entries.get(boxed)
            if state is None or not state.healthy:
                if entry is not None:
                    del entries[boxed]
                    self._remove(entry)
                continue
            new = key(view, state)
            if entry is None:
                entry = entries[boxed] = _Keyed(new, wid, len(heap))
                heap.append(entry)
                self._toward_root(entry)
            elif new != entry.key:  # most changes move nothing this order reads
                entry.key, entry.first = new, _first_term(new)
                at = entry.pos
                self._toward_root(entry)
                if entry.pos == at:
                    self._toward_leaf(entry)
        self.pending.clear()

    def _remove(self, entry: _Keyed) -> None:
        heap = self._heap
        last = heap.pop()
        if last is entry:
            return
        last.pos = entry.pos
        heap[entry.pos] = last
        self._toward_root(last)
        if heap[entry.pos] is last:
            self._toward_leaf(last)

    def _toward_root(self, entry: _Keyed) -> None:
        heap = self._heap
        pos = entry.pos
        while pos > 0:
            parent_pos = (pos - 1) >> 1
            parent = heap[parent_pos]
            if not _earlier(entry, parent):
                break
            heap[pos] = parent
            parent.pos = pos
            pos = parent_pos
        heap[pos] = entry
        entry.pos = pos

    def _toward_leaf(self, entry: _Keyed) -> None:
        heap = self._heap
        end: i64 = len(heap)
        pos = entry.pos
        child = 2 * pos + 1
        while child < end:
            right = child + 1
            if right < end and _earlier(heap[right], heap[child]):
                child = right
            low = heap[child]
            if not _earlier(low, entry):
                break
            heap[pos] = low
            low.pos = pos
            pos = child
            child = 2 * pos + 1
        heap[pos] = entry
        entry.pos = pos


def _earlier(a: _Keyed, b: _Keyed) -> bool:
    """a's key is less than b's."""
    if a.first < b.first:
        return True
    if a.first > b.first:
        return False
    return bool(a.key < b.key)


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
            boxed = boxed_id(wid)
            for order in self._orders.values():
                order.pending.add(boxed)
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
            order = self._orders.get(key)
            if end == 0 and (order is None or isinstance(order, LeastFirst)):
                if order is None:
                    order = self._orders[key] = LeastFirst(key, self.workers)
                least = order.least_id(self)
                if least is not None:
                    return self.workers[least]
            else:
                ordered = self._order(key)
                if ordered:
                    return self.workers[ordered[end][-1]]
        else:
            healthy = self.healthy_workers()
            if healthy:
                pick = min if end == 0 else max
                return pick(healthy, key=lambda w: key(self, w))
        raise RuntimeError("no healthy worker to route to")

    def _order(self, key: OrderKey) -> list[tuple]:
        """The sorted order kept for `key`, replacing a least-first heap once more is read."""
        order = self._orders.get(key)
        if not isinstance(order, WorkerOrder):
            order = WorkerOrder(key, self.workers)
            self._orders[key] = order
        return order.refresh(self)
