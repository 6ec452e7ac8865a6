"""Each worker's load as the router counts it: the figures in WorkerState a policy balances by.

    tokens_in_flight   prompt and output tokens routed to it and not yet done
    num_waiting        in its router-side queue, plus those inside the server it says wait
    num_running        released to it and not waiting inside it
    kv_used_blocks     as it reports (vLLM's gauge live, the engine in the simulator)

The router's own figures are exact and immediate (it sees every route, token and finish); what
a worker reports refines them. Every change re-keys the worker in the view's orders.
"""

from __future__ import annotations

from typing import Any

from router.dispatch import DispatchQueue
from router.prefix_index import WorkerId
from router.view import ClusterView, WorkerState, boxed_id

# Orders policies balance by (router.view.OrderKey): here, compiled, as a view re-keys every
# worker that changed at each decision.


def least_tokens(view: ClusterView, worker: WorkerState) -> tuple[int, int, Any]:
    # Outstanding tokens first; queue length and id break ties so the choice is deterministic.
    return (worker.tokens_in_flight, worker.num_outstanding, boxed_id(worker.id))


class Load:
    def __init__(self, view: ClusterView) -> None:
        self.view = view

    def add(self, wid: WorkerId, tokens: int) -> None:
        """`tokens` more of work routed to `wid`."""
        state = self.view.workers[boxed_id(wid)]
        state.tokens_in_flight += tokens
        self.view.changed(wid)

    def credit(self, wid: WorkerId | None, tokens: int, kv_used_blocks: int | None = None) -> None:
        """`tokens` of work done on `wid` (None: nowhere), and its KV use if known."""
        state = self.view.workers.get(wid) if wid is not None else None
        if state is not None:
            state.tokens_in_flight -= tokens
            if kv_used_blocks is not None:
                state.kv_used_blocks = kv_used_blocks
            self.view.changed(state.id)

    def count(self, wid: WorkerId, queue: DispatchQueue | None) -> None:
        """Requests waiting (in the router, or inside the server as it reports) and running."""
        state = self.view.workers.get(boxed_id(wid))
        if state is not None and self._recount(state, queue, max(state.reported_waiting, 0)):
            self.view.changed(wid)

    def _recount(self, state: WorkerState, queue: DispatchQueue | None, inside: int) -> bool:
        """`count` with `inside` waiting inside the server, as it last said: True if it moved."""
        if queue is None:
            return False
        inside = min(inside, queue.in_flight)
        waiting, running = len(queue) + inside, queue.in_flight - inside
        if waiting == state.num_waiting and running == state.num_running:
            return False
        state.num_waiting, state.num_running = waiting, running
        return True

    def report(
        self,
        wid: WorkerId,
        waiting: int | None,
        kv_used_blocks: int | None,
        kv_capacity_blocks: int | None,
        queue: DispatchQueue | None,
    ) -> None:
        """What a worker says of itself, the requests it says wait re-counted with `queue`
        (its router-side one). One re-key for all of it: the simulator's workers report after
        every engine run, and a second re-key was a tenth of the report."""
        state = self.view.workers.get(boxed_id(wid))
        if state is None:
            return
        moved = False
        if kv_used_blocks is not None and kv_used_blocks != state.kv_used_blocks:
            state.kv_used_blocks = kv_used_blocks
            moved = True
        if kv_capacity_blocks is not None and kv_capacity_blocks != state.kv_capacity_blocks:
            state.kv_capacity_blocks = kv_capacity_blocks
            moved = True
        if waiting is not None and waiting != state.reported_waiting:
            state.reported_waiting = waiting
            moved = self._recount(state, queue, waiting) or moved
        if moved:
            self.view.changed(wid)
