"""Preble's E2 scheduler (Srivatsa et al., "Preble: Efficient Distributed Prompt Scheduling for
LLM Serving", ICLR'25): exploit cached prefixes, explore by a prompt-aware load cost.

For each request, find the longest prefix any worker holds.
- Exploit, when that cached part is longer than the missed part: send to the holders of that
  prefix, the least loaded of them (L below).
- Explore, otherwise: send to the worker with the least L + M + P, where
    L  the worker's load over a recent window: for each request sent there, the prefill time of
       its missed tokens (cache hits cost nothing) plus its decode time;
    M  the eviction cost of placing this request there: the prefill time of each prefix it would
       evict (the worker's least recently used, to make room for the missed blocks) times that
       prefix's hits within the window;
    P  this request's own missed prefill time there.
Post-assignment rebalancing: when the heaviest worker's L exceeds `rebalance_ratio` x the
lightest's, the heaviest worker's prefix group whose load best fits half the gap is moved: its
later requests go to the lightest worker. Hot-prefix replication: when requests queue at the
chosen holder (`hot_queue` waiting) and the prefix alone brings it at least an average worker's
windowed load, the request is explored among the workers without the prefix, which places a
second copy where it is cheapest. The local discipline (`preble`) serves priority groups by
cache-hit ratio in proportion to their priority, so low-hit requests are never starved.

Choices made where the paper leaves them: the window is 180 s of the caller's clock; decode time
is output tokens x one decode step at the prompt's context (a conservative per-request figure);
a prefix group is named by the deepest block it shares with anything already routed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from router.cluster import ClusterView, CostEstimates
from router.policy import Decision, GlobalPolicy, LocalPolicy
from router.prefix_index import WorkerId
from router.registry import global_policies, local_policies
from router.request import BlockHash, Request


class WindowedLoad:
    """Per-worker sums of (time, cost, group) entries over the last `window` seconds."""

    def __init__(self, window: float) -> None:
        self.window = window
        self._entries: dict[WorkerId, deque[tuple[float, float, BlockHash | None]]] = {}
        self.total: dict[WorkerId, float] = {}
        self.by_group: dict[WorkerId, dict[BlockHash | None, float]] = {}

    def add(self, worker: WorkerId, now: float, cost: float, group: BlockHash | None) -> None:
        self._entries.setdefault(worker, deque()).append((now, cost, group))
        self.total[worker] = self.total.get(worker, 0.0) + cost
        groups = self.by_group.setdefault(worker, {})
        groups[group] = groups.get(group, 0.0) + cost

    def expire(self, now: float) -> None:
        horizon = now - self.window
        for worker, entries in self._entries.items():
            groups = self.by_group[worker]
            while entries and entries[0][0] < horizon:
                _, cost, group = entries.popleft()
                self.total[worker] -= cost
                groups[group] -= cost
                if groups[group] <= 1e-12:
                    del groups[group]
            if not entries:
                self.total[worker] = 0.0  # drop accumulated rounding

    def move(self, group: BlockHash, src: WorkerId, dst: WorkerId) -> None:
        """Charge `group`'s entries on `src` to `dst` instead: its load follows it."""
        entries = self._entries.get(src, deque())
        moving = [e for e in entries if e[2] == group]
        if not moving:
            return
        self._entries[src] = deque(e for e in entries if e[2] != group)
        cost = sum(e[1] for e in moving)
        self.total[src] -= cost
        del self.by_group[src][group]
        merged = sorted([*self._entries.get(dst, ()), *moving], key=lambda e: e[0])
        self._entries[dst] = deque(merged)
        self.total[dst] = self.total.get(dst, 0.0) + cost
        groups = self.by_group.setdefault(dst, {})
        groups[group] = groups.get(group, 0.0) + cost

    def of(self, worker: WorkerId) -> float:
        return self.total.get(worker, 0.0)


@global_policies.register("preble")
class PrebleE2(GlobalPolicy):
    """Exploit the longest cached prefix, else explore by load + eviction + prefill cost."""

    default_local = "preble"

    def __init__(
        self, window: float = 180.0, rebalance_ratio: float = 2.0, hot_queue: int = 8
    ) -> None:
        self.load = WindowedLoad(window)
        self.rebalance_ratio = rebalance_ratio
        self.hot_queue = hot_queue
        self.moved: dict[BlockHash, WorkerId] = {}  # prefix group -> worker it was moved to
        self._routed: dict[int, tuple[dict[WorkerId, int], BlockHash | None]] = {}

    # ------------------------------------------------------------------ route

    def route(self, request: Request, view: ClusterView) -> Decision:
        _require_cost(view)
        workers = {w.id: w for w in view.routable_workers()}
        self.load.expire(view.now)
        hashes = request.block_hashes
        matched = {w: m for w, m in view.index.match(hashes).items() if w in workers}
        best = max(matched.values(), default=0)
        group = hashes[max(best, 1) - 1] if hashes else None
        self._routed[request.id] = (matched, group)

        cached = best * view.block_size
        if best and cached > request.prompt_len - cached:
            holders = [w for w, m in matched.items() if m == best]
            target = self.moved.get(group) if group is not None else None
            if target not in workers:
                target = min(holders, key=lambda w: (self.load.of(w), w))
            others = [w for w in workers if w not in holders]
            if not self._is_hot(group, target, others, view):
                return Decision(target, "exploit")
            return Decision(self._explore(request, view, matched, others), "hot prefix: replicate")
        return Decision(self._explore(request, view, matched, list(workers)), "explore")

    def _is_hot(
        self, group: BlockHash | None, holder: WorkerId, others: list[WorkerId], view: ClusterView
    ) -> bool:
        """Requests queue at the holder, and this prefix alone brings it at least an average
        worker's load: more than one worker should serve it. A queue that is long everywhere,
        or long for other reasons, is not cured by a replica."""
        if not others or view.workers[holder].num_waiting < self.hot_queue:
            return False
        mean = sum(self.load.of(w) for w in view.workers) / len(view.workers)
        return self.load.by_group.get(holder, {}).get(group, 0.0) >= mean

    def explore_costs(
        self, request: Request, view: ClusterView, matched: dict[WorkerId, int]
    ) -> dict[WorkerId, tuple[float, float, float]]:
        """(L, M, P) for every healthy worker: the terms E2's explore step adds up."""
        cost = _require_cost(view)
        bs, index, now = view.block_size, view.index, view.now
        out = {}
        for w in view.healthy_workers():
            hit = matched.get(w.id, 0)
            prefill = cost.prefill_time(request.prompt_len - hit * bs, hit * bs)
            room = w.kv_capacity_blocks - index.num_blocks(w.id)
            shortfall = (request.num_blocks - hit) - room
            evict = 0.0
            if shortfall > 0:
                for node in index.eviction_victims(w.id, shortfall):
                    length = len(node.key) * bs
                    evict += cost.prefill_time(length, node.depth * bs - length) * (
                        index.hit_count(node, now)
                    )
            out[w.id] = (self.load.of(w.id), evict, prefill)
        return out

    def _explore(
        self,
        request: Request,
        view: ClusterView,
        matched: dict[WorkerId, int],
        candidates: list[WorkerId],
    ) -> WorkerId:
        terms = self.explore_costs(request, view, matched)
        return min(candidates, key=lambda w: (sum(terms[w]), w))

    # ------------------------------------------------------------------ hooks

    def on_dispatch(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        cost = _require_cost(view)
        matched, group = self._routed.pop(request.id, ({}, None))
        hit = matched.get(worker, 0) * view.block_size
        work = cost.prefill_time(request.prompt_len - hit, hit)
        work += request.output_len * cost.decode_time(1, request.prompt_len)
        self.load.add(worker, view.now, work, group)
        self._rebalance(view)

    def _rebalance(self, view: ClusterView) -> None:
        workers = [w.id for w in view.healthy_workers()]
        if len(workers) < 2:
            return
        heavy = max(workers, key=lambda w: (self.load.of(w), -w))
        light = min(workers, key=lambda w: (self.load.of(w), w))
        high, low = self.load.of(heavy), self.load.of(light)
        if high <= self.rebalance_ratio * low:
            return
        half_gap = (high - low) / 2
        groups = self.load.by_group.get(heavy, {})
        movable = [
            (g, load)
            for g, load in groups.items()
            if g is not None and load <= half_gap and self.moved.get(g) != light
        ]
        if movable:
            group, _ = max(movable, key=lambda gl: gl[1])
            self.moved[group] = light
            self.load.move(group, heavy, light)


def _require_cost(view: ClusterView) -> CostEstimates:
    if view.cost is None:
        raise RuntimeError("preble needs cost estimates in the ClusterView (a cost model)")
    return view.cost


@local_policies.register("preble")
class HitRatioGroups(LocalPolicy):
    """Preble's local scheduler: priority groups by cache-hit ratio, served in proportion.

    A request joins group g = floor(hit ratio x num_groups) when the engine first looks at it;
    group g gets a share of admissions proportional to g + 1 (stride scheduling), so requests
    with more cached context go first more often, and zero-hit ones still progress.
    """

    def __init__(self, num_groups: int = 10) -> None:
        self.num_groups = num_groups
        self.groups: list[deque[Request]] = [deque() for _ in range(num_groups)]
        self.passes = [0.0] * num_groups  # stride scheduling: lowest pass goes next
        self._ungrouped: deque[Request] = deque()
        self._group_of: dict[int, int] = {}
        self._len = 0

    def push(self, request: Request) -> None:
        self._ungrouped.append(request)
        self._len += 1

    def push_front(self, request: Request) -> None:
        g = self._group_of.get(request.id)
        (self._ungrouped if g is None else self.groups[g]).appendleft(request)
        self._len += 1

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        while self._ungrouped:
            request = self._ungrouped.popleft()
            ratio = cached_blocks(request) / request.num_blocks if request.num_blocks else 0.0
            g = min(int(ratio * self.num_groups), self.num_groups - 1)
            self._join(g, request)
        live = [g for g in range(self.num_groups) if self.groups[g]]
        if not live:
            return None
        g = min(live, key=lambda g: (self.passes[g], -g))
        return self.groups[g][0]

    def pop(self, request: Request, num_cached_tokens: int) -> None:
        g = self._group_of[request.id]
        queue = self.groups[g]
        queue.popleft() if queue[0] is request else queue.remove(request)
        self.passes[g] += 1.0 / (g + 1)
        self._len -= 1

    def remove(self, request: Request) -> None:
        g = self._group_of.pop(request.id, None)
        # Ungrouped until the engine first peeks; a stranger is in neither queue.
        if _discard(self._ungrouped if g is None else self.groups[g], request):
            self._len -= 1

    def on_finish(self, request: Request) -> None:
        self._group_of.pop(request.id, None)

    def _join(self, g: int, request: Request) -> None:
        if not self.groups[g]:
            # A group that was empty starts level with the others: idling banks no priority.
            live = [self.passes[k] for k in range(self.num_groups) if self.groups[k]]
            self.passes[g] = max(self.passes[g], min(live, default=self.passes[g]))
        self.groups[g].append(request)
        self._group_of[request.id] = g

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        yield from self._ungrouped
        for queue in self.groups:
            yield from queue


def _discard(queue: deque[Request], request: Request) -> bool:
    """Take `request` itself (not an equal one) out of `queue`; False if it is not there."""
    for i, r in enumerate(queue):
        if r is request:
            del queue[i]
            return True
    return False
