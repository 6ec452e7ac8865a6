"""Deficit Longest Prefix Match (Cao et al., "Locality-aware Fair Scheduling in LLM Serving").

The waiting queue is ordered by cached prefix length, as LPM's, but a request is admitted only
while its client's deficit is positive. Admission charges the request's extend (uncached) tokens
x w_in, and each generated token charges w_out, divided by the client's weight. When every client
with waiting requests is in deficit (and the engine still has room, which is when it asks), each
of them gets the quantum Q^u, as often as needed for one to turn positive. A large Q^u lets the
longest-prefix order run long (locality); a small one rotates clients often (fairness).

Choices the paper leaves open, made here as in deficit round robin: a client whose queue empties
keeps its debt but loses unused credit; input is charged once per request (preemption recompute is
not service).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from policies.lpm import LongestPrefixMatch
from policies.queues import FifoQueue, by_longest_prefix
from router.registry import global_policies, local_policies
from router.request import Request


@local_policies.register("dlpm")
class DeficitLongestPrefixMatch(FifoQueue):
    def __init__(
        self, quantum: float = 2048, w_in: float = 1.0, w_out: float = 2.0, max_scan: int = 128
    ) -> None:
        super().__init__()
        if quantum <= 0:
            raise ValueError(f"quantum: must be positive, got {quantum}")
        self.quantum, self.w_in, self.w_out, self.max_scan = quantum, w_in, w_out, max_scan
        self.deficits: dict[str, float] = {}
        self._num_waiting: dict[str, int] = {}
        self._admitted: set[int] = set()  # started, not finished: input charged once

    def push(self, request: Request) -> None:
        super().push(request)
        self._count(request.client, +1)

    def push_front(self, request: Request) -> None:
        super().push_front(request)
        self._count(request.client, +1)

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        if not self._queue:
            return None
        ordered = by_longest_prefix(self._queue, cached_blocks, self.max_scan)
        for request in ordered:
            if self.deficits[request.client] > 0:
                return request
        self._refill(richest=max(self.deficits[r.client] for r in ordered))
        return next(r for r in ordered if self.deficits[r.client] > 0)

    def pop(self, request: Request, num_cached_tokens: int) -> None:
        super().pop(request, num_cached_tokens)
        self._count(request.client, -1)
        if request.id not in self._admitted:
            self._admitted.add(request.id)
            extend = request.prompt_len - num_cached_tokens
            self.deficits[request.client] -= self.w_in * extend / request.weight

    def remove(self, request: Request) -> None:
        # Withdrawn before it started: no charge; the client leaves the waiting count (and,
        # if that was its last request, its unused credit, as when its queue empties on a pop).
        if request in self._queue:
            super().remove(request)
            self._count(request.client, -1)

    def on_token(self, request: Request, num_tokens: int) -> None:
        # Only requests this queue admitted (see VirtualTokenCounter.on_token).
        if request.id in self._admitted:
            self.deficits[request.client] -= self.w_out * num_tokens / request.weight

    def on_finish(self, request: Request) -> None:
        self._admitted.discard(request.id)

    def _refill(self, richest: float) -> None:
        """Every waiting client is in deficit: add Q^u to each, as many times as the richest
        client among the requests in view needs to pass."""
        rounds = math.floor(-richest / self.quantum) + 1
        for client in self._num_waiting:
            self.deficits[client] += rounds * self.quantum

    def _count(self, client: str, delta: int) -> None:
        n = self._num_waiting.get(client, 0) + delta
        if n:
            self._num_waiting[client] = n
            self.deficits.setdefault(client, 0.0)
        else:
            del self._num_waiting[client]
            self.deficits[client] = min(self.deficits[client], 0.0)  # no banked credit


@global_policies.register("dlpm")
class DLPMRouter(LongestPrefixMatch):
    """LPM routing across workers, DLPM on each worker's queue."""

    default_local = "dlpm"
