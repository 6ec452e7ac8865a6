"""Deficit Longest Prefix Match (Cao et al., "Locality-aware Fair Scheduling in LLM Serving").

The waiting queue is ordered by cached prefix length, as LPM's, but a request is admitted only
while its client's deficit is positive. Admission charges the request's extend (uncached) tokens
x w_in, and each generated token charges w_out, divided by the client's weight. When every client
with waiting requests is in deficit (and the engine still has room, which is when it asks), each
of them gets the quantum Q^u, as often as needed for one to turn positive. A large Q^u lets the
longest-prefix order run long (locality); a small one rotates clients often (fairness).

Choices the paper leaves open, made here as in deficit round robin: a client whose queue empties
keeps its debt but loses unused credit; input is charged once per request (preemption recompute is
not service). VTC's cost options apply (`cost`, `charge_output`: policies/service_cost.py), with
the extend tokens as the input; the quantum is in the cost's units.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from policies.lpm import LongestPrefixMatch
from policies.queues import ClientQueues
from policies.service_params import DEFAULT_SERVICE_COST, ServiceCostParams
from router.ledger import Ledger
from router.policy import LocalPolicy
from router.registry import global_policies, local_policies
from router.request import Request


@local_policies.register("dlpm")
class DeficitLongestPrefixMatch(LocalPolicy):
    """Longest cached prefix first among the clients in credit; refill when none is.

    The longest-prefix order looks at the first `max_scan` waiting requests in arrival order
    (matching every prompt on every step would cost more than it saves), and at every waiting
    client's oldest request besides: eligibility and refill are over all waiting clients, so a
    client in credit whose requests all wait behind another client's burst is still found.
    """

    def __init__(
        self,
        quantum: float = 2048,
        max_scan: int = 128,
        service_cost: ServiceCostParams = DEFAULT_SERVICE_COST,
    ) -> None:
        if quantum <= 0:
            raise ValueError(f"quantum: must be positive, got {quantum}")
        self.quantum, self.max_scan = quantum, max_scan
        self.meter = service_cost.meter()
        self.deficits = Ledger()  # client -> deficit; shared by router replicas
        self.waiting = ClientQueues()

    def push(self, request: Request) -> None:
        self.deficits.setdefault(request.client, 0.0)
        self.waiting.push(request)

    def push_front(self, request: Request) -> None:
        self.deficits.setdefault(request.client, 0.0)
        self.waiting.push(request, front=True)

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        if not self.waiting:
            return None
        if all(self.deficits[c] <= 0 for c in self.waiting.queues):
            self._refill()
        candidates = {r.id: r for r in self.waiting.oldest(self.max_scan)}
        candidates.update((r.id, r) for r in self.waiting.heads())
        in_credit = [r for r in candidates.values() if self.deficits[r.client] > 0]
        return min(in_credit, key=lambda r: (-cached_blocks(r), self.waiting.order(r)))

    def pop(self, request: Request, num_cached_tokens: int) -> None:
        if self.waiting.remove(request):
            self._leave(request.client)
        extend = request.prompt_len - num_cached_tokens
        self._charge(request, self.meter.start(request, extend))

    def remove(self, request: Request) -> None:
        # Withdrawn before it started: no charge (one preempted back here has run: settled as
        # at a finish). A client emptied by it leaves as on a pop.
        if request not in self.waiting:
            return
        self._charge(request, self.meter.finish(request))
        if self.waiting.remove(request):
            self._leave(request.client)

    def on_token(self, request: Request, num_tokens: int) -> None:
        self.on_tokens((request,), num_tokens)

    def on_tokens(self, requests: Sequence[Request], num_tokens: int) -> None:
        # The meter charges only requests this queue started: one rebuilt under running
        # requests (its worker was marked down) keeps accounts of what it admitted itself.
        self.meter.charge_tokens(requests, num_tokens, self.deficits, -1.0)

    def on_finish(self, request: Request) -> None:
        self._charge(request, self.meter.finish(request))

    def _charge(self, request: Request, amount: float) -> None:
        if amount:
            self.deficits[request.client] = self.deficits.get(request.client, 0.0) - amount

    def _refill(self) -> None:
        """No waiting client is in credit: add Q^u to each, as many times as the richest of
        them needs to pass zero (a refill that replicas repeat counts once: router.ledger)."""
        self.deficits.refill(self.waiting.queues, self.quantum)

    def _leave(self, client: str) -> None:
        """`client` has nothing waiting any more: it keeps its debt, not its unused credit."""
        self.deficits.lower_to(client, 0.0)

    def __len__(self) -> int:
        return len(self.waiting)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.waiting)


@global_policies.register("dlpm")
class DLPMRouter(LongestPrefixMatch):
    """LPM routing across workers, DLPM on each worker's queue."""

    default_local = "dlpm"
