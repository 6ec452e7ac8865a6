"""Longest prefix match: SGLang's cache-aware routing, and its `lpm` queue order.

Global rule (SGLang router, `cache_aware`): when the cluster is imbalanced — the longest and
shortest queues differ by more than `balance_abs_threshold` requests AND the longest is more than
`balance_rel_threshold` times the shortest — send to the shortest queue. Otherwise send to the
worker with the longest cached match if it covers more than `cache_threshold` of the prompt, else
to the worker whose cache holds the least (the most room to grow a new prefix). Defaults are
SGLang's: 0.3, 64, 1.5. Load is counted in requests, as SGLang counts it.
"""

from __future__ import annotations

from collections.abc import Callable

from policies.queues import FifoQueue, by_longest_prefix
from router.cluster import ClusterView
from router.policy import Decision, GlobalPolicy
from router.registry import global_policies, local_policies
from router.request import Request


def is_imbalanced(loads: list[int], abs_threshold: float, rel_threshold: float) -> bool:
    high, low = max(loads), min(loads)
    return high - low > abs_threshold and high > low * rel_threshold


@global_policies.register("lpm")
class LongestPrefixMatch(GlobalPolicy):
    """Longest cached prefix above a match ratio, least load when imbalanced (SGLang)."""

    default_local = "lpm"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def route(self, request: Request, view: ClusterView) -> Decision:
        workers = view.routable_workers()
        loads = [w.num_outstanding for w in workers]
        if is_imbalanced(loads, self.balance_abs_threshold, self.balance_rel_threshold):
            target = min(workers, key=lambda w: (w.num_outstanding, w.id))
            return Decision(target.id, "imbalanced: shortest queue")

        matched = view.index.match(request.block_hashes)
        healthy = {w.id: w for w in workers}
        best = max(
            (w for w in matched if w in healthy),
            key=lambda w: (matched[w], -healthy[w].num_outstanding, -w),
            default=None,
        )
        if best is not None and matched[best] > self.cache_threshold * request.num_blocks:
            return Decision(best, "longest prefix match")
        target = min(workers, key=lambda w: (view.index.num_blocks(w.id), w.num_outstanding, w.id))
        return Decision(target.id, "low match: smallest cache")


@local_policies.register("lpm")
class LongestPrefixFirst(FifoQueue):
    """Waiting requests with the longest cached prefix on this worker first."""

    def __init__(self, max_scan: int = 128) -> None:
        super().__init__()
        self.max_scan = max_scan

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        if not self._queue:
            return None
        return by_longest_prefix(self._queue, cached_blocks, self.max_scan)[0]
