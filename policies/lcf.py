"""Least counter first: VTC's counters without VTC's lift (the VTC paper's LCF baseline).

The client with the least service received so far goes first, as in VTC, but a client that
arrives to an empty queue keeps its old counter. A client that idled banks that credit, and on
returning takes everything until its counter catches up: the unfairness VTC's lift removes.
"""

from __future__ import annotations

from policies.vtc import VirtualTokenCounter
from router.registry import local_policies
from router.request import Request


@local_policies.register("lcf")
class LeastCounterFirst(VirtualTokenCounter):
    def push(self, request: Request) -> None:
        self.counters.setdefault(request.client, 0.0)
        self.waiting.push(request)
