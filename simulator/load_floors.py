"""Which worker has the least load now, without bringing every engine up to date first.

A policy routing to the least loaded worker (`router.policy.LeastLoaded`) reads each worker's
tokens in flight, which a decoding engine lowers at every step. Applying every engine's ended
steps before each arrival makes an arrival cost a pass over the fleet: at 1,024 workers about a
hundred engines have a step ended between two arrivals. Between its changes of state an engine's
load falls only by its decode steps, each taking the run's batch size off, at times the run
already knows. So each worker keeps a floor: its key with the first term lowered by the steps due
over the next `horizon` of them, which holds until the end of the step past those.

At an arrival the floors are read smallest first, each worker's exact key at that instant worked
out from its run (no step applied), until the next floor is no lower than the least exact key
found: no worker left can beat it. Only that worker is brought up to date, so the view the policy
reads ranks it first: every other worker's key there is its key as of its last update, never
below its exact key now.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from router.view import ClusterView, OrderKey
from simulator.engine import Engine

INF = float("inf")


class LoadFloors:
    __slots__ = ("_engines", "_view", "_key", "_horizon", "_floor", "_heap", "_until", "_expiry")

    def __init__(
        self, engines: Sequence[Engine], view: ClusterView, key: OrderKey, horizon: int = 8
    ) -> None:
        self._engines, self._view, self._key = engines, view, key
        # Steps ahead a floor covers: fewer keep floors tight (fewer workers read per
        # arrival), more renew them less often (fewer renewals per arrival).
        self._horizon = horizon
        self._floor: dict[int, tuple] = {}  # each worker's floor key, as in the heap
        self._heap: list[tuple] = []  # floor keys, stale ones dropped as they surface
        self._until: dict[int, float] = {}  # when each worker's floor stops holding
        self._expiry: list[tuple[float, int]] = []  # (until, worker), stale ones skipped

    def changed(self, wid: int, now: float) -> None:
        """The worker's state moved (its engine applied steps, or took a request): a new floor."""
        state = self._view.workers.get(wid)
        if state is None:
            self._floor.pop(wid, None)
            return
        _, ahead, until = self._engines[wid].decode_credit(now, self._horizon)
        key = self._key(self._view, state)
        floor = (key[0] - ahead, *key[1:])
        self._floor[wid] = floor
        heapq.heappush(self._heap, floor)
        self._until[wid] = until
        if until != INF:
            heapq.heappush(self._expiry, (until, wid))

    def least(self, now: float) -> int | None:
        """The healthy worker whose exact key is least at `now` (None: no healthy worker).
        Every engine's steps that change more than its decode progress must be applied."""
        self._renew(now)
        heap, floors, view, key = self._heap, self._floor, self._view, self._key
        workers, engines, horizon = view.workers, self._engines, self._horizon
        best: tuple | None = None
        read: list[tuple] = []
        while heap:
            floor = heap[0]
            wid = floor[-1]
            if floors.get(wid) is not floor:
                heapq.heappop(heap)
                continue
            if best is not None and floor >= best:
                break
            read.append(heapq.heappop(heap))
            state = workers[wid]
            if not state.healthy:
                continue
            credit = engines[wid].decode_credit(now, horizon)[0]
            exact = key(view, state)
            if credit:
                exact = (exact[0] - credit, *exact[1:])
            if best is None or exact < best:
                best = exact
        for floor in read:
            heapq.heappush(heap, floor)
        if len(heap) > 4 * len(floors) + 64:  # mostly stale entries: start afresh
            heap[:] = floors.values()
            heapq.heapify(heap)
        return None if best is None else best[-1]

    def _renew(self, now: float) -> None:
        """New floors for the workers whose floors have run out by `now`."""
        expiry, until = self._expiry, self._until
        while expiry and expiry[0][0] <= now:
            end, wid = heapq.heappop(expiry)
            if until.get(wid) == end:
                self.changed(wid, now)
