"""Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI'24).

Each client has a counter of the service it received, in weighted tokens: input tokens x w_in
charged when a request is admitted, w_out per output token as it is generated, divided by the
client's weight. The queue always admits from the backlogged client with the smallest counter,
FCFS within a client. A client arriving to an empty queue of its own has its counter lifted to
the smallest backlogged counter (or, with nobody backlogged, to the counter of the client that
left the queue last), so idling banks no credit. Over any interval in which two clients are both
backlogged, their service differs by at most about 2 x max(w_in x max input, w_out x max output).
Defaults w_in = 1, w_out = 2 are the paper's.

`cost="profiled"` charges the artifact's fitted h(input, output) instead of the linear one, and
`charge_output="predicted"` charges a predicted output length at admission, corrected at the
finish (policies/service_cost.py). Input is charged once per request: a preempted request's
recompute is not service.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from policies.baselines import LeastLoad
from policies.queues import ClientQueues
from policies.service_params import DEFAULT_SERVICE_COST, ServiceCostParams
from router.ledger import Ledger
from router.policy import LocalPolicy
from router.registry import global_policies, local_policies
from router.request import Request


@local_policies.register("vtc")
class VirtualTokenCounter(LocalPolicy):
    def __init__(self, service_cost: ServiceCostParams = DEFAULT_SERVICE_COST) -> None:
        self.meter = service_cost.meter()
        self.counters = Ledger()  # client -> counter; shared by router replicas
        self.waiting = ClientQueues()
        self._last_departed = 0.0  # counter of the client whose queue emptied last

    def push(self, request: Request) -> None:
        client = request.client
        if not self.waiting.is_backlogged(client):
            backlogged = [self.counters[c] for c in self.waiting.queues]
            lift = min(backlogged) if backlogged else self._last_departed
            self.counters.raise_to(client, lift)  # a max: lifted at two replicas, once
        self.waiting.push(request)

    def push_front(self, request: Request) -> None:
        self.counters.setdefault(request.client, 0.0)
        self.waiting.push(request, front=True)

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        if not self.waiting.queues:
            return None
        client = min(self.waiting.queues, key=lambda c: (self.counters[c], c))
        return self.waiting.head(client)

    def pop(self, request: Request, num_cached_tokens: int) -> None:
        self._charge(request, self.meter.start(request, request.prompt_len))
        if self.waiting.remove(request):
            self._last_departed = self.counters[request.client]

    def remove(self, request: Request) -> None:
        # Withdrawn before it started: no charge (one preempted back here has run: settled as
        # at a finish). A client whose queue empties leaves it as after a pop (its counter is
        # the last departed), so the next arrival is lifted right.
        if request not in self.waiting:
            return
        self._charge(request, self.meter.finish(request))
        if self.waiting.remove(request):
            self._last_departed = self.counters[request.client]

    def on_token(self, request: Request, num_tokens: int) -> None:
        self.on_tokens((request,), num_tokens)

    def on_tokens(self, requests: Sequence[Request], num_tokens: int) -> None:
        # The meter charges only requests this queue started: one rebuilt under running
        # requests (its worker was marked down) keeps accounts of what it admitted itself.
        self.meter.charge_tokens(requests, num_tokens, self.counters, 1.0)

    def on_finish(self, request: Request) -> None:
        self._charge(request, self.meter.finish(request))

    def _charge(self, request: Request, amount: float) -> None:
        if amount:
            self.counters[request.client] = self.counters.get(request.client, 0.0) + amount

    def __len__(self) -> int:
        return len(self.waiting)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.waiting)


@global_policies.register("vtc")
class VTCRouter(LeastLoad):
    """Least outstanding tokens across workers, VTC on each worker's queue (the paper's setup
    is one server; spreading by load keeps each worker's clients comparable)."""

    default_local = "vtc"
