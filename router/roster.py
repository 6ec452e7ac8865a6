"""The workers a router knows: each one's state in the view, its dispatch queue, and its health.

    add      a WorkerState in the view, in its pools (model group, role), a queue of its own
    down     not routed to; what it cached forgotten; returns its queued requests, which the
             core withdraws (those in flight stay until their driver finishes them)
    up       routed to again
    remove   forgotten by every part (after `down`)
    report   what a worker says of itself: requests waiting inside it, KV blocks in use

A worker's queue gets its own discipline from the policy's factory; with traffic classes on,
one per priority band (router.bands).
"""

from __future__ import annotations

from collections.abc import Callable

from router.adapters import AdapterSlots
from router.bands import Banded
from router.config import RouterConfig
from router.dispatch import DispatchQueue
from router.indexes import Indexes
from router.latency import LatencyTargets
from router.load import Load
from router.policy import LocalPolicy
from router.pools import Pools
from router.prefix_index import WorkerId
from router.request import Request
from router.traits import Role
from router.view import ClusterView, WorkerState, boxed_id


class Roster:
    def __init__(
        self,
        config: RouterConfig,
        local_factory: Callable[[], LocalPolicy],
        view: ClusterView,
        pools: Pools,
        indexes: Indexes,
        latency: LatencyTargets,
        load: Load,
        adapters: AdapterSlots,
    ) -> None:
        self.config = config
        self.local_factory = local_factory
        self.view = view
        self.pools = pools
        self.indexes = indexes
        self.latency = latency
        self.load = load
        self.adapters = adapters
        self.queues: dict[WorkerId, DispatchQueue] = {}

    def add(
        self,
        wid: WorkerId,
        kv_capacity_blocks: int | None = None,
        model: str | None = None,
        adapter_slots: int = 0,
        role: str = Role.MIXED,
    ) -> DispatchQueue:
        if wid in self.queues:
            raise ValueError(f"worker {wid} is already known")
        role = Role(role)
        banded = self.config.is_banded
        if banded:
            priorities = self.latency.classes.priorities()
            discipline: LocalPolicy = Banded(self.local_factory, priorities)
        else:
            discipline = self.local_factory()
        queue = DispatchQueue(wid, discipline, self.config.window, banded=banded)
        self.queues[wid] = queue
        if kv_capacity_blocks is None:
            kv_capacity_blocks = self.config.kv_capacity_blocks
        state = WorkerState(
            wid, kv_capacity_blocks=kv_capacity_blocks, model=model, role=role.value
        )
        self.view.workers[wid] = state
        self.pools.add(state)
        self.latency.add_worker(wid)
        self.adapters.add_worker(wid, adapter_slots)
        self._changed(wid)
        return queue

    def down(self, wid: WorkerId) -> list[Request]:
        """`wid` is not routed to and holds nothing. Returns its queued requests, in its
        discipline's order (none if it was unknown or down already)."""
        state = self.view.workers.get(wid)
        if state is None or not state.healthy:
            return []
        state.healthy = False
        self._changed(wid)
        self.indexes.remove_worker(wid)
        self.adapters.report(wid, ())  # a server that comes back has loaded none
        return list(self.queues[wid].discipline)

    def up(self, wid: WorkerId) -> None:
        state = self.view.workers.get(wid)
        if state is not None:
            state.healthy = True
            self._changed(wid)

    def remove(self, wid: WorkerId) -> None:
        self.queues.pop(wid, None)
        self.pools.remove(wid)
        self.adapters.remove_worker(wid)
        self.view.workers.pop(wid, None)
        self._changed(wid)
        self.latency.remove_worker(wid)

    def report(
        self,
        wid: WorkerId,
        waiting: int | None,
        kv_used_blocks: int | None,
        kv_capacity_blocks: int | None,
    ) -> None:
        queue = self.queues.get(boxed_id(wid))
        self.load.report(wid, waiting, kv_used_blocks, kv_capacity_blocks, queue)

    def count(self, wid: WorkerId) -> None:
        """Re-count `wid`'s requests waiting and running, after its queue changed."""
        self.load.count(wid, self.queues.get(boxed_id(wid)))

    def _changed(self, wid: WorkerId) -> None:
        self.view.changed(wid)
        self.view.roster_changed()
