"""Longest prefix match: SGLang's cache-aware routing, and its `lpm` queue order.

Global rule (SGLang router, `cache_aware`): when the cluster is imbalanced — the longest and
shortest queues differ by more than `balance_abs_threshold` requests AND the longest is more than
`balance_rel_threshold` times the shortest — send to the shortest queue. Otherwise send to the
worker with the longest cached match if it covers more than `cache_threshold` of the prompt, else
to the worker whose cache holds the least (the most room to grow a new prefix). Defaults are
SGLang's: 0.3, 64, 1.5. Load is counted in requests, as SGLang counts it.

The queue order is SGLang's scheduler's, in-batch prefix de-duplication included (see
LongestPrefixFirst).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from policies.queues import FifoQueue
from router.policy import Decision, GlobalPolicy
from router.prefix_index import WorkerId
from router.registry import global_policies, local_policies
from router.request import Request
from router.traits import DisciplineTraits, PolicyTraits, ReordersOn
from router.view import ClusterView, WorkerState


def shortest_queue(view: ClusterView, worker: WorkerState) -> tuple[int, int]:
    return (worker.num_outstanding, worker.id)


def smallest_cache(view: ClusterView, worker: WorkerState) -> tuple[int, int, int]:
    return (view.index.num_blocks(worker.id), worker.num_outstanding, worker.id)


def healthy_matches(request: Request, view: ClusterView, more_than: int = 0) -> dict[WorkerId, int]:
    """Blocks of `request`'s prefix each healthy worker holds (those holding more than
    `more_than`)."""
    healthy = view.healthy_set()  # not view.is_healthy: a call per holder costs 45 % more
    return {
        w: m for w, m in view.index.match(request.block_hashes, more_than).items() if w in healthy
    }


def is_imbalanced(view: ClusterView, abs_threshold: float, rel_threshold: float) -> bool:
    """SGLang's test: the longest and shortest queues (in requests) differ by more than
    `abs_threshold` and the longest is more than `rel_threshold` times the shortest."""
    high = view.most(shortest_queue).num_outstanding
    low = view.least(shortest_queue).num_outstanding
    return high - low > abs_threshold and high > low * rel_threshold


def shortest_queue_among(view: ClusterView, candidates: Collection[WorkerId]) -> WorkerId:
    """The healthy candidate with the shortest queue (then the lowest id); one must be healthy.
    Many candidates (a prefix held everywhere): walk the fleet's queue order, healthy workers
    only, to the first one; few: compare the healthy ones."""
    if 8 * len(candidates) < len(view.workers):
        healthy = view.healthy_set()
        return min(
            (w for w in candidates if w in healthy),
            key=lambda w: shortest_queue(view, view.workers[w]),
        )
    return next(key[-1] for key in view.ordered(shortest_queue) if key[-1] in candidates)


@global_policies.register("lpm")
class LongestPrefixMatch(GlobalPolicy):
    """Longest cached prefix above a match ratio, least load when imbalanced (SGLang)."""

    default_local = "lpm"
    traits = PolicyTraits(counts_tokens=False)

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: float = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def progress_read(self, request: Request, view: ClusterView) -> tuple[()]:
        return ()  # queues in requests and what caches hold: neither moves while decoding

    def route(self, request: Request, view: ClusterView) -> Decision:
        if is_imbalanced(view, self.balance_abs_threshold, self.balance_rel_threshold):
            return Decision(view.least(shortest_queue).id, "imbalanced: shortest queue")

        # The longest match first, then the shorter queue: found in two passes so that a prefix
        # every worker holds (a shared system prompt) costs no per-worker key.
        longest, holders = view.index.longest_match(request.block_hashes, view.healthy_set())
        if longest and longest > self.cache_threshold * request.num_blocks:
            return Decision(shortest_queue_among(view, holders), "longest prefix match")
        return Decision(view.least(smallest_cache).id, "low match: smallest cache")


@local_policies.register("lpm")
class LongestPrefixFirst(FifoQueue):
    """SGLang's `lpm` schedule policy: longest cached prefix first, FIFO among equals.

    As SGLang's scheduler (`schedule_policy.py`) does it:
    - More than `max_scan` (128) waiting: FCFS for the whole queue. Matching every waiting
      prompt on every step would cost more than it saves.
    - In-batch prefix de-duplication. Of waiting requests that have at most
      `in_batch_check_blocks` cached, one that shares at least `in_batch_deprioritize_blocks`
      leading blocks with an earlier such request goes behind everything else: one of them
      computes the shared prefix, the others then hit it instead of computing it again at the
      same time. SGLang's thresholds are 32 tokens; here they are blocks, and the defaults (2)
      are 32 tokens at vLLM's block size of 16. None turns the check off.

    SGLang sorts once per scheduling round, so a request admitted in a round still holds its
    siblings back for the rest of that round. Here the owner asks one `peek` at a time, so a
    request popped but not yet computed stays in the in-batch set (as if still first among its
    siblings) until `cached_blocks` shows the blocks its siblings match it on computed (by
    then they see them as their own cache hit), or it finishes, or it is preempted. Held back
    means last, not blocked: with nothing else waiting, a sibling still goes (so does SGLang's).

    Chained block hashes make the in-batch match a lookup: two prompts share their first k
    blocks exactly when their k-th hashes are equal.
    """

    traits = DisciplineTraits(counts_tokens=False, reorders_on=ReordersOn.CACHE)

    def __init__(
        self,
        max_scan: int = 128,
        in_batch_check_blocks: int | None = 2,
        in_batch_deprioritize_blocks: int = 2,
    ) -> None:
        super().__init__()
        if in_batch_deprioritize_blocks < 1:
            raise ValueError(
                "in_batch_deprioritize_blocks: must be at least 1, "
                f"got {in_batch_deprioritize_blocks}"
            )
        self.max_scan = max_scan
        self.check_blocks = in_batch_check_blocks
        self.deprioritize_blocks = in_batch_deprioritize_blocks
        self._prefilling: dict[int, Request] = {}  # popped, prompt not yet seen computed

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        if not self._queue:
            return None
        if len(self._queue) > self.max_scan:
            return self._queue[0]
        cached = {r.id: cached_blocks(r) for r in self._queue}
        held_back = self._in_batch_duplicates(cached, cached_blocks)
        best = min(
            range(len(self._queue)),
            key=lambda i: (self._queue[i].id in held_back, -cached[self._queue[i].id], i),
        )
        return self._queue[best]

    def pop(self, request: Request, num_cached_tokens: int) -> None:
        super().pop(request, num_cached_tokens)
        if self.check_blocks is not None and request.num_blocks >= self.deprioritize_blocks:
            self._prefilling[request.id] = request

    def push_front(self, request: Request) -> None:
        self._prefilling.pop(request.id, None)  # preempted: its blocks are freed
        super().push_front(request)

    def on_finish(self, request: Request) -> None:
        self._prefilling.pop(request.id, None)

    def _in_batch_duplicates(
        self, cached: dict[int, int], cached_blocks: Callable[[Request], int]
    ) -> set[int]:
        """Ids of waiting requests to hold back: SGLang's waiting-queue tree, walked in arrival
        order after the prompts still being computed."""
        if self.check_blocks is None:
            return set()
        k = self.deprioritize_blocks - 1  # sharing hash k = sharing the first k + 1 blocks
        for rid, r in list(self._prefilling.items()):
            if cached_blocks(r) > k:
                del self._prefilling[rid]  # computed: siblings now see it as cached
        seen = {r.block_hashes[k] for r in self._prefilling.values()}
        held_back = set()
        for r in self._queue:
            if cached[r.id] > self.check_blocks or r.num_blocks <= k:
                continue
            if r.block_hashes[k] in seen:
                held_back.add(r.id)
            else:
                seen.add(r.block_hashes[k])
        return held_back
