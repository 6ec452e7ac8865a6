"""D²LPM: distributed Deficit Longest Prefix Match (Cao et al., the DLPM paper's cluster form).

The router keeps a deficit per (client, worker). A request goes to a worker that holds its
prefix and where its client still has deficit — the longest match first, the shortest queue
among equal matches; failing that, to the shortest queue overall. D²LPM builds on the LPM router,
so "holds the prefix" means a match above LPM's `cache_threshold` of the prompt, and LPM's
imbalance guard (queues apart by more than `balance_abs_threshold` requests and by a factor above
`balance_rel_threshold`) sends to the shortest queue: with one client, deficits alone would never
spread load away from a holder. The chosen pair is charged the
request's extend tokens x w_in at dispatch and w_out per generated token (over the client's
weight). A worker whose active clients (those with requests outstanding there) are all in
deficit gives each of them the quantum Q^u, as often as needed for one to turn positive; this is
checked when the worker is considered for a request and after each dispatch to it. A client
that becomes active on a worker starts with its debt there plus one quantum, so a newcomer may
use a worker at once. Each worker runs local DLPM.
"""

from __future__ import annotations

import math

from policies.lpm import is_imbalanced
from router.cluster import ClusterView, WorkerState
from router.policy import Decision, GlobalPolicy
from router.prefix_index import WorkerId
from router.registry import global_policies
from router.request import Request


@global_policies.register("d2lpm")
class DistributedDLPM(GlobalPolicy):
    """Per-(client, worker) deficits choose among the workers holding the prefix."""

    default_local = "dlpm"

    def __init__(
        self,
        quantum: float = 2048,
        w_in: float = 1.0,
        w_out: float = 2.0,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if quantum <= 0:
            raise ValueError(f"quantum: must be positive, got {quantum}")
        self.quantum, self.w_in, self.w_out = quantum, w_in, w_out
        self.cache_threshold = cache_threshold
        self.balance = (balance_abs_threshold, balance_rel_threshold)
        self.deficits: dict[tuple[str, WorkerId], float] = {}
        self.active: dict[WorkerId, dict[str, int]] = {}  # worker -> client -> outstanding
        self._matched: dict[int, int] = {}  # request id -> blocks matched on the chosen worker
        self._outstanding: dict[int, WorkerId] = {}  # request id -> the worker it was sent to

    def deficit(self, client: str, worker: WorkerId) -> float:
        """The client's deficit on `worker` as a new request would find it."""
        d = self.deficits.get((client, worker), 0.0)
        if client in self.active.get(worker, ()):
            return d
        return min(d, 0.0) + self.quantum

    def route(self, request: Request, view: ClusterView) -> Decision:
        workers = view.routable_workers()
        healthy = {w.id: w for w in workers}
        matched = {w: m for w, m in view.index.match(request.block_hashes).items() if w in healthy}

        def queue(w: WorkerState) -> tuple[int, int]:
            return (w.num_outstanding, w.id)

        enough = self.cache_threshold * request.num_blocks
        holders = sorted(
            (w for w in matched if matched[w] > enough),
            key=lambda w: (-matched[w], queue(healthy[w])),
        )
        if is_imbalanced([w.num_outstanding for w in workers], *self.balance):
            holders = []
        for w in holders:
            # A holder nobody is in credit at refills now: refilling only on dispatch would
            # starve it, since only clients in credit are sent to holders.
            self._refill(w)
            if self.deficit(request.client, w) > 0:
                self._matched[request.id] = matched[w]
                return Decision(w, "holds prefix, client in credit")
        target = min(workers, key=queue).id
        self._matched[request.id] = matched.get(target, 0)
        return Decision(target, "no holder in credit (or imbalanced): shortest queue")

    def on_dispatch(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        key = (request.client, worker)
        clients = self.active.setdefault(worker, {})
        if request.client not in clients:
            self.deficits[key] = self.deficit(request.client, worker)
        clients[request.client] = clients.get(request.client, 0) + 1
        self._outstanding[request.id] = worker
        extend = request.prompt_len - self._matched.pop(request.id, 0) * view.block_size
        self.deficits[key] -= self.w_in * max(extend, 1) / request.weight
        self._refill(worker)

    def on_token(self, request: Request, worker: WorkerId, num_tokens: int, now: float) -> None:
        # Hooks come from failure paths too: a request this policy did not send is ignored.
        if self._outstanding.get(request.id) == worker:
            self.deficits[(request.client, worker)] -= self.w_out * num_tokens / request.weight

    def on_finish(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        self._matched.pop(request.id, None)
        if self._outstanding.get(request.id) != worker:
            return  # not sent there by this policy, or already finished or withdrawn
        del self._outstanding[request.id]
        clients = self.active[worker]
        clients[request.client] -= 1
        if not clients[request.client]:
            del clients[request.client]

    def _refill(self, worker: WorkerId) -> None:
        clients = self.active.get(worker)
        if not clients:
            return
        richest = max(self.deficits[(c, worker)] for c in clients)
        if richest > 0:
            return
        rounds = math.floor(-richest / self.quantum) + 1
        for c in clients:
            self.deficits[(c, worker)] += rounds * self.quantum
