"""D²LPM: distributed Deficit Longest Prefix Match (Cao et al., the DLPM paper's cluster form).

The router keeps a deficit per (client, worker). A request goes to the worker with the shortest
queue among those that hold its prefix and where its client still has deficit (the longer match
breaks ties); failing that, to the shortest queue overall. D²LPM builds on the LPM router,
so "holds the prefix" means a match above LPM's `cache_threshold` of the prompt, and LPM's
imbalance guard (queues apart by more than `balance_abs_threshold` requests and by a factor above
`balance_rel_threshold`) sends to the shortest queue: with one client, deficits alone would never
spread load away from a holder. The chosen pair is charged the
request's extend tokens x w_in at dispatch and w_out per generated token (over the client's
weight). A worker whose active clients (those with requests outstanding there) are all in
deficit gives each of them the quantum Q^u, as often as needed for one to turn positive; this is
checked when the worker is considered for a request and after each dispatch to it. A client
that becomes active on a worker starts with its debt there plus one quantum, so a newcomer may
use a worker at once. A request withdrawn before it ran there (queue timeout, worker down) is
refunded what its dispatch charged, and the quantum its arrival granted if it leaves the client
inactive there: it costs nothing. Each worker runs local DLPM. VTC's cost options apply
(`cost`, `charge_output`: policies/service_cost.py), with the extend tokens as the input.
Without a `quantum`, Q^u follows the dispatch charges (policies/quantum.py): below one
request's charge, a client joining a holder of its prefix would be in deficit there after one
request and its next sent away from its cache, where the miss costs more. The local DLPM
keeps its own default (`local_params` sets it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from policies.lpm import healthy_matches, is_imbalanced, shortest_queue
from policies.quantum import Quantum
from policies.service_params import DEFAULT_SERVICE_COST, ServiceCostParams
from router.ledger import Ledger
from router.policy import Decision, GlobalPolicy
from router.prefix_index import WorkerId
from router.registry import global_policies
from router.request import Request
from router.view import ClusterView


@dataclass(slots=True)
class _Sent:
    """What dispatching one request did to its (client, worker) deficit, to undo it."""

    worker: WorkerId
    granted: float  # the activation quantum (its debt plus Q^u), if this request activated


@global_policies.register("d2lpm")
class DistributedDLPM(GlobalPolicy):
    """Per-(client, worker) deficits choose among the workers holding the prefix."""

    default_local = "dlpm"

    def __init__(
        self,
        quantum: float | None = None,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
        service_cost: ServiceCostParams = DEFAULT_SERVICE_COST,
    ) -> None:
        self._quantum = Quantum(quantum)  # None: adapted to the dispatch charges
        self.meter = service_cost.meter()
        self.cache_threshold = cache_threshold
        self.balance = (balance_abs_threshold, balance_rel_threshold)
        self.deficits = Ledger()  # (client, worker) -> deficit; shared by router replicas
        self.active: dict[WorkerId, dict[str, int]] = {}  # worker -> client -> outstanding
        self._matched: dict[int, int] = {}  # request id -> blocks matched on the chosen worker
        self._sent: dict[int, _Sent] = {}  # request id -> its dispatch, while outstanding
        self._last_match: tuple[int, dict[WorkerId, int]] = (-1, {})

    @property
    def quantum(self) -> float:
        """Q^u now: the user's, or the one the dispatch charges so far call for."""
        return self._quantum.value

    def deficit(self, client: str, worker: WorkerId) -> float:
        """The client's deficit on `worker` as a new request would find it."""
        d = self.deficits.get((client, worker), 0.0)
        if client in self.active.get(worker, ()):
            return d
        return min(d, 0.0) + self.quantum

    def progress_read(self, request: Request, view: ClusterView) -> set[WorkerId]:
        """Deficits move as requests decode (output is charged per token): those of the
        holders, one of which may be chosen, and of the shortest queue, the fallback."""
        return set(self._holders(request, view)) | {view.least(shortest_queue).id}

    def _holders(self, request: Request, view: ClusterView) -> dict[WorkerId, int]:
        """Blocks matched per healthy worker holding more than `cache_threshold` of the
        prompt; kept from `progress_read` for `route`."""
        if self._last_match[0] != request.id:
            enough = math.floor(self.cache_threshold * request.num_blocks)  # m > x: m > floor(x)
            self._last_match = (request.id, healthy_matches(request, view, more_than=enough))
        return self._last_match[1]

    def route(self, request: Request, view: ClusterView) -> Decision:
        matched = self._holders(request, view)
        self._last_match = (-1, {})
        holders = list(matched)
        if is_imbalanced(view, *self.balance):
            holders = []
        for w in holders:
            # A holder nobody is in credit at refills now: refilling only on dispatch would
            # starve it, since only clients in credit are sent to holders.
            self._refill(w)
        in_credit = [w for w in holders if self.deficit(request.client, w) > 0]
        if in_credit:
            target = min(in_credit, key=lambda w: (view.workers[w].num_outstanding, -matched[w], w))
            self._matched[request.id] = matched[target]
            return Decision(target, "holds prefix, client in credit: shortest queue")
        target = view.least(shortest_queue).id
        self._matched[request.id] = view.index.match_of(request.block_hashes, target)
        return Decision(target, "no holder in credit (or imbalanced): shortest queue")

    def on_dispatch(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        key = (request.client, worker)
        clients = self.active.setdefault(worker, {})
        granted = 0.0
        if request.client not in clients:
            before = self.deficits.get(key, 0.0)
            granted = self.deficit(request.client, worker) - before
            self.deficits.adjust(key, granted)  # this replica's own: see router.ledger
        self.deficits.setdefault(key, 0.0)
        clients[request.client] = clients.get(request.client, 0) + 1
        extend = request.prompt_len - self._matched.pop(request.id, 0) * view.block_size
        charge = self.meter.start(request, max(extend, 1))
        self._quantum.observe(charge)
        self.deficits[key] -= charge
        self._sent[request.id] = _Sent(worker, granted)
        self._refill(worker)

    def on_token(self, request: Request, worker: WorkerId, num_tokens: int, now: float) -> None:
        self.on_tokens((request,), worker, num_tokens, now)

    def on_tokens(
        self, requests: Sequence[Request], worker: WorkerId, num_tokens: int, now: float
    ) -> None:
        # Hooks come from failure paths too: a request this policy did not send is ignored.
        sent = self._sent
        mine = [r for r in requests if (s := sent.get(r.id)) is not None and s.worker == worker]
        self.meter.charge_tokens(mine, num_tokens, self.deficits, -1, lambda r: (r.client, worker))

    def on_finish(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        if self._forget(request, worker) is not None:
            self.deficits[(request.client, worker)] -= self.meter.finish(request)

    def on_withdraw(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        sent = self._forget(request, worker)
        if sent is None:
            return
        key = (request.client, worker)
        self.deficits[key] -= self.meter.refund(request)
        if request.client not in self.active.get(worker, ()):
            self.deficits.adjust(key, -sent.granted)

    def _forget(self, request: Request, worker: WorkerId) -> _Sent | None:
        """Drop an outstanding request from its worker's active counts; None (and nothing
        done) if this policy did not send it there or has already let it go."""
        self._matched.pop(request.id, None)
        sent = self._sent.get(request.id)
        if sent is None or sent.worker != worker:
            return None
        del self._sent[request.id]
        clients = self.active[worker]
        clients[request.client] -= 1
        if not clients[request.client]:
            del clients[request.client]
        return sent

    def _refill(self, worker: WorkerId) -> None:
        clients = self.active.get(worker)
        if clients:  # shared with the other replicas: a repeat finds one in credit (ledger)
            self.deficits.refill([(c, worker) for c in clients], self.quantum)
