"""Preble's E2 scheduler (Srivatsa et al., "Preble: Efficient Distributed Prompt Scheduling for
LLM Serving", ICLR'25), as its reference implementation runs it (WukLab/preble,
`preble/global_scheduler_with_time.py`, GlobalSchedulerWithTime): exploit cached prefixes,
explore by a prompt-aware load cost, rebalance prefix groups, replicate an overloaded one.

For each request, find the longest prefix any worker holds.
- Exploit, when that cached part is longer than the missed part: send to the holders of that
  prefix (or where rebalancing moved or replicated its group), the one with least L + M.
- Explore, otherwise: send to the worker with the least L + M + P, where
    L  the worker's load over a recent window: each prefix group's prefill of what was new to
       the cluster, split evenly over the workers the group is allocated to, plus the decode of
       the requests sent there (output tokens x the worker's measured time per output token);
    M  the eviction cost of placing this request there: the prefill time of each prefix it would
       evict (the worker's least recently used) times that prefix's hits within the window;
    P  this request's own missed prefill time there.
Post-assignment rebalancing, after a warm-up: while the heaviest worker's L is at least
`rebalance_ratio` x the lightest's, its cheapest groups move to the lightest worker, their load
with them, as long as that does not overshoot. A group whose TTFT there doubled between the two
halves of the window is overloaded: if moves could not even the pair, the lightest worker
becomes a replica for it. The window and the TTFT detector live in policies/preble_load.py. The
local discipline (`preble`, policies/preble_local.py) serves priority groups by cache-hit ratio
in proportion to their priority, so low-hit requests never starve.

What the paper leaves open, what the reference does, and what this module does:

| question          | reference (WukLab/preble)              | here                             |
|-------------------|----------------------------------------|----------------------------------|
| window            | 3 minutes (SlidingWindowHistogram)     | `window` = 180 s, caller's clock |
| prefix group      | the deepest radix node longer than the | exploit: the group of the        |
|                   | context before it ("important node");  | request that brought the deepest |
|                   | a split hands a leaf's entry to a new  | cached block into the cluster;   |
|                   | parent (handle_split_node_histogram)   | explore: a group of its own      |
| exploit target    | the allocation of the deepest node     | the holders of the match (the    |
|                   | matched (get_parent_gpu_allocation),   | index learns routed prompts), or |
|                   | least load cost                        | the group's moved-to workers     |
| L: prefill        | group miss rate (tokens new to the     | each request's prefill of the    |
|                   | tree) x count x prefill / len(alloc)   | tokens new to the cluster, per   |
|                   | (get_node_cost)                        | group, / len(allocation)         |
| L: decode         | requests in flight there x output      | output tokens x that median at   |
|                   | length x median TPOT of the worker's   | dispatch, summed over the window |
|                   | last 200 finished requests (0.15 s     | where it runs (the paper's L);   |
|                   | until measured)                        | cost model's step until measured |
| M                 | memory assumed always full: evict the  | once the worker's holdings reach |
|                   | new leaf's size in LRU order; victims  | `full_fraction` of its KV, evict |
|                   | x miss rate x count x prefill          | the request's missed blocks      |
|                   | (virtual_evict_for_routing)            | (below: only the shortfall);     |
|                   |                                        | victims x window hits x prefill  |
| P                 | not in calculate_min_load_cost         | kept, as in the paper            |
| rebalancing start | 50 x workers requests routed           | `warmup` x workers               |
| imbalance         | heavier >= 1.5 x lighter; pairs the    | `rebalance_ratio` = 1.5; pairs   |
|                   | heaviest with the lightest, then the   | re-sorted after each pair        |
|                   | next heaviest (recursively)            |                                  |
| what moves        | groups with > 1 request, cheapest      | the same; the light worker takes |
|                   | first, while it does not overshoot;    | the heavy one's place in the     |
|                   | allocation := {light} for the node and | group's allocation, its decode   |
|                   | its subtree (update_children)          | too, all its requests follow     |
| replication       | TTFTWindowedOverloadedDetector: later  | same detector (`ttft_factor`,    |
|                   | half-window mean TTFT >= 2 x earlier;  | `ttft_window`); the heavy one's  |
|                   | only when the heavy GPU has a single   | costliest group if moves left    |
|                   | group; adds light to the node only     | the pair uneven; the replica     |
|                   |                                        | serves the shared prefix only    |
| long chains       | no rebalancing 3+ nodes below the      | not modelled                     |
|                   | group (left to Infercept)              |                                  |

Decode in flight (the reference's L) changes with every completion, and the balance test then
fires on that noise: on the shared-prefix experiment it moved thousands of groups, each move
recomputing an 8k-token document. Decode set at dispatch and kept for the window moves with its
group exactly and does not change when requests finish.

The policy reads no clock: dispatch-to-first-token and first-to-last-token times are in the
caller's clock (`view.now` and the hooks' `now`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median

import numpy as np

from policies.lpm import healthy_matches
from policies.preble_load import Group, GroupWindow, PerWorker, TTFTOverloadDetector, WindowEntry
from router.policy import Decision, GlobalPolicy
from router.prefix_index import Node, WorkerId
from router.registry import global_policies
from router.request import BlockHash, Request
from router.traits import PolicyTraits
from router.view import ClusterView, CostEstimates, WorkerState


@dataclass(slots=True)
class _InFlight:
    group: Group
    dispatched_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_tokens: int = 0  # output tokens, the first included


@global_policies.register("preble")
class PrebleE2(GlobalPolicy):
    """Exploit the longest cached prefix, else explore by load + eviction + prefill cost."""

    default_local = "preble"
    # on_token feeds only the time per output token, which on_finish reads
    traits = PolicyTraits(tokens_read_at_finish=True)

    def __init__(
        self,
        window: float = 180.0,
        rebalance_ratio: float = 1.5,
        warmup: int = 50,
        ttft_factor: float = 2.0,
        ttft_window: float = 180.0,
        tpot_samples: int = 200,
        full_fraction: float = 0.95,
    ) -> None:
        self._slots: dict[WorkerId, int] = {}  # the numpy vectors' positions of workers
        self.window = GroupWindow(window, self._slots)
        self.overload = TTFTOverloadDetector(ttft_window, ttft_factor)
        self.rebalance_ratio = rebalance_ratio
        self.warmup = warmup  # requests routed per worker before rebalancing starts
        self.tpot_samples = tpot_samples
        self.full_fraction = full_fraction
        # Per group: the workers its prefill is split over (where its requests went, as
        # rebalancing changed it); where rebalancing moved it, for all its requests; where it
        # was replicated, for requests that match no deeper than its shared prefix.
        self.alloc: dict[Group, set[WorkerId]] = {}
        self.moved: dict[Group, set[WorkerId]] = {}
        self.replicas: dict[Group, set[WorkerId]] = {}
        # Per worker, the measured time per output token of its last finished requests.
        self.tpot: dict[WorkerId, deque[float]] = {}
        self.num_routed = 0
        self._prefill_share = PerWorker(self._slots)  # sum of prefill / len(alloc)
        self._share_of: dict[Group, float] = {}  # the group's prefill / len(alloc)
        self._groups_on: dict[WorkerId, set[Group]] = {}
        # Each block the cluster learnt from a request in the window -> that request's group,
        # and each group's shared prefix: the shortest match that sent a request to it.
        self._origin: dict[BlockHash, Group] = {}
        self._introduced: dict[Group, list[BlockHash]] = {}
        self._shared: dict[Group, int] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._routed: dict[int, tuple[dict[WorkerId, int], Group]] = {}
        self._kept_victims: dict[WorkerId, tuple] = {}  # see _victims
        self._kept_positions: tuple[list[WorkerId], np.ndarray, dict[WorkerId, int]] | None = (
            None  # see _positions
        )

    # ------------------------------------------------------------------ route

    def route(self, request: Request, view: ClusterView) -> Decision:
        _require_cost(view)
        workers = view.healthy_ids()
        if not workers:
            raise RuntimeError("no healthy worker to route to")
        self._expire(view.now)
        hashes = request.block_hashes
        matched = healthy_matches(request, view)
        best = max(matched.values(), default=0)
        cached = best * view.block_size
        if best and cached > request.prompt_len - cached:
            group = self._group_of(hashes[best - 1])
            self._routed[request.id] = (matched, group)
            holders = [w for w, m in matched.items() if m == best]
            candidates = [w for w in self._placement(group, best, holders) if view.is_healthy(w)]
            terms = self.explore_costs(request, view, matched, candidates or holders)
            target = min(terms, key=lambda w: (terms[w][0] + terms[w][1], w))
            return Decision(target, "exploit" if target in holders else "exploit: rebalanced")
        self._routed[request.id] = (matched, _own_group(request))
        return Decision(self._cheapest(request, view, matched, workers), "explore")

    def _placement(self, group: Group, best: int, holders: list[WorkerId]) -> set[WorkerId]:
        """Where an exploited request goes (the reference: the allocation of the deepest node
        it matches): the holders of its match, unless rebalancing moved its group; a replica
        joins them for requests that match only the group's shared prefix."""
        if group in self.moved:
            return self.moved[group]
        if best <= self._shared.get(group, 0):
            return set(holders) | self.replicas.get(group, set())
        return set(holders)

    def load(self, worker: WorkerId) -> float:
        """L: the worker's share of its groups' windowed prefill, plus its windowed decode."""
        return self._prefill_share.get(worker, 0.0) + self.window.decode.get(worker, 0.0)

    def explore_costs(
        self,
        request: Request,
        view: ClusterView,
        matched: dict[WorkerId, int],
        candidates: list[WorkerId] | None = None,
    ) -> dict[WorkerId, tuple[float, float, float]]:
        """(L, M, P) for each candidate (by default every healthy worker)."""
        cost = _require_cost(view)
        if candidates is None:
            candidates = view.healthy_ids()
        bs, out = view.block_size, {}
        num_blocks, workers = request.num_blocks, view.workers
        shares, decode = self._prefill_share, self.window.decode  # load(w), inlined: O(W) calls
        prefill_for: dict[int, float] = {}  # by blocks hit: most workers hit nothing
        for w in sorted(candidates):
            hit = matched.get(w, 0)
            prefill = prefill_for.get(hit)
            if prefill is None:
                prefill = prefill_for[hit] = cost.prefill_time(
                    request.prompt_len - hit * bs, hit * bs
                )
            evict = self._eviction_cost(view, workers[w], num_blocks - hit, cost)
            out[w] = (shares.get(w, 0.0) + decode.get(w, 0.0), evict, prefill)
        return out

    def _cheapest(
        self,
        request: Request,
        view: ClusterView,
        matched: dict[WorkerId, int],
        workers: list[WorkerId],
    ) -> WorkerId:
        """The worker with the least L + M + P, ties to the smaller id: `explore_costs`'s
        argmin, in the same float arithmetic. L and P are vectors over the fleet; M, a walk of
        a worker's LRU victims, is at least 0, so it is taken only for workers whose L + P
        could still beat the best total found, cheapest L + P first."""
        cost, bs = _require_cost(view), view.block_size
        loads = self._loads(workers)
        prefill = np.full(len(workers), cost.prefill_time(request.prompt_len, 0))
        if matched:
            position = self._positions(workers)[1]
            prefill_for: dict[int, float] = {}  # by blocks hit: a shared prefix, one value
            for w, hit in matched.items():
                if hit not in prefill_for:
                    prefill_for[hit] = cost.prefill_time(request.prompt_len - hit * bs, hit * bs)
                prefill[position[w]] = prefill_for[hit]
        bound = loads + prefill
        best, best_w = np.inf, -1
        for k in np.argsort(bound, kind="stable").tolist():
            w = workers[k]
            # Equal bounds come in id order: past the best's own id, none of them can win.
            if bound[k] > best or (bound[k] == best and w > best_w):
                break
            missed = request.num_blocks - matched.get(w, 0)
            load, own = float(loads[k]), float(prefill[k])
            evict = self._eviction_cost(view, view.workers[w], missed, cost, (load, own, best))
            total = load + evict + own
            if total < best or (total == best and w < best_w):
                best, best_w = total, w
        return best_w

    def _eviction_cost(
        self,
        view: ClusterView,
        worker: WorkerState,
        missed: int,
        cost: CostEstimates,
        beaten: tuple[float, float, float] | None = None,
    ) -> float:
        """M: what placing `missed` new blocks on `worker` pushes out, weighed by reuse. A full
        cache (an LRU cache's steady state) gives up as many blocks as it takes in.
        `beaten` = (L, P, best): stop once L + M + P exceeds `best`, M then only part-summed
        (its terms are not negative, so the whole cannot come back under)."""
        capacity = worker.kv_capacity_blocks
        if missed <= 0 or capacity <= 0:
            return 0.0
        held = max(view.index.num_blocks(worker.id), worker.kv_used_blocks)
        is_full = held >= self.full_fraction * capacity
        to_evict = missed if is_full else missed - (capacity - held)
        if to_evict <= 0:
            return 0.0
        total, index, now = 0.0, view.index, view.now
        for node, freed_before, prefill in self._victims(view, worker.id, to_evict, cost):
            if freed_before >= to_evict:
                break
            hits = index.hit_count(node, now)
            if hits:  # a prefix nobody reused lately costs nothing to lose
                total += prefill * hits
                if beaten is not None and beaten[0] + total + beaten[1] > beaten[2]:
                    break
        return total

    def _victims(
        self, view: ClusterView, worker: WorkerId, num_blocks: int, cost: CostEstimates
    ) -> list[tuple[Node, int, float]]:
        """The index's `eviction_victims(worker, num_blocks)`, each with the blocks freed
        before it and its prefill time. Kept until the worker's eviction order changes (the
        index's `version`): explore prices victims across the fleet for every request, and a
        worker's change only when requests go there."""
        index, version = view.index, view.index.version(worker)
        kept = self._kept_victims.get(worker)
        if kept is not None and kept[:3] == (index, version, cost) and kept[3] >= num_blocks:
            return kept[4]
        bs, victims, freed = view.block_size, [], 0
        for node in index.eviction_victims(worker, num_blocks):
            length = len(node.key) * bs
            victims.append((node, freed, cost.prefill_time(length, node.depth * bs - length)))
            freed += len(node.key)
        self._kept_victims[worker] = (index, version, cost, num_blocks, victims)
        return victims

    # ------------------------------------------------------------------ hooks

    def on_dispatch(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        cost = _require_cost(view)
        matched, group = self._routed.pop(request.id, ({}, _own_group(request)))
        # A group's prefill is what is new to the cluster, wherever it runs (the reference's
        # miss rate is the tree's): a group that moved does not look heavier for having moved.
        best = max(matched.values(), default=0)
        prefill = cost.prefill_time(
            request.prompt_len - best * view.block_size, best * view.block_size
        )
        measured = self.tpot.get(worker)
        # Not measured yet: the cost model's decode step.
        tpot = median(measured) if measured else cost.decode_time(1, request.prompt_len)
        self._expire(view.now)
        entry = WindowEntry(request.id, view.now, group, worker, prefill, request.output_len * tpot)
        self.window.add(entry)
        self._reshare(group, self.alloc.get(group, set()) | {worker})
        if best:
            self._shared[group] = min(self._shared.get(group, best), best)
        introduced = self._introduced.setdefault(group, [])
        for h in request.block_hashes[best:]:  # the blocks new to the cluster join the group
            if self._group_of(h) == h:
                self._origin[h] = group
                introduced.append(h)
        self._in_flight[request.id] = _InFlight(group, view.now)
        self.num_routed += 1
        self._rebalance(view)

    def on_first_token(self, request: Request, worker: WorkerId, now: float) -> None:
        flight = self._in_flight.get(request.id)
        if flight is not None and flight.first_token_at is None:
            if flight.group in self.window.count:  # else its group is forgotten already
                self.overload.add(flight.group, worker, now, now - flight.dispatched_at)
            flight.first_token_at = flight.last_token_at = now

    def on_token(self, request: Request, worker: WorkerId, num_tokens: int, now: float) -> None:
        # Only a count and the latest time: tokens may come summed and late (before finish).
        flight = self._in_flight.get(request.id)
        if flight is not None and flight.last_token_at is not None:
            flight.last_token_at = max(flight.last_token_at, now)
            flight.num_tokens += num_tokens

    def on_finish(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        """A finished request's time per output token (first to last token) joins its
        worker's samples."""
        self._routed.pop(request.id, None)
        flight = self._in_flight.pop(request.id, None)
        if flight is not None and flight.num_tokens > 1:  # the first token's gap is the TTFT
            samples = self.tpot.setdefault(worker, deque(maxlen=self.tpot_samples))
            gap = flight.last_token_at - flight.first_token_at  # type: ignore[operator]
            samples.append(gap / (flight.num_tokens - 1))

    def on_withdraw(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        """It never ran: its windowed work is taken back, as if it had never been sent."""
        self.on_finish(request, worker, view)
        group = self.window.withdraw(request.id)
        if group is not None:
            self.num_routed -= 1
            self._reshare(group, self.alloc.get(group, set()))

    # ------------------------------------------------------------------ rebalancing

    def _rebalance(self, view: ClusterView) -> None:
        """Pair the heaviest worker with the lightest and move the heaviest's cheapest groups
        while that does not overshoot, or replicate an overloaded one if moves were not
        enough; then the next heaviest, until a pair is within `rebalance_ratio`."""
        workers = view.healthy_ids()
        if len(workers) < 2 or self.num_routed < self.warmup * len(view.workers):
            return
        vector = self._loads(workers)
        if vector.max() < self.rebalance_ratio * vector.min():
            return
        loads = dict(zip(workers, vector.tolist(), strict=True))
        order = sorted(workers, key=lambda w: (-loads[w], w))
        while len(order) >= 2:
            heavy, light = order[0], order[-1]
            if loads[heavy] < self.rebalance_ratio * loads[light]:
                return
            movable = [
                (self._group_cost(g, heavy), g)
                for g in self._groups_on.get(heavy, ())
                if self.window.count[g] > 1 and light not in self.alloc[g]
            ]
            movable.sort(key=lambda cg: cg[0])
            for group_cost, group in movable:
                if loads[heavy] - group_cost < loads[light] + group_cost:
                    break
                self._move(group, heavy, light)
                loads[heavy], loads[light] = self.load(heavy), self.load(light)
                if loads[heavy] < self.rebalance_ratio * loads[light]:
                    break
            if movable and loads[heavy] >= self.rebalance_ratio * loads[light]:
                self._replicate(movable[-1][1], heavy, light, view.now)
                loads[heavy], loads[light] = self.load(heavy), self.load(light)
            order = sorted(order[1:], key=lambda w: (-loads[w], w))

    def _loads(self, workers: list[WorkerId]) -> np.ndarray:
        """L of each of `workers`, as `load` computes it."""
        at = self._positions(workers)[0]
        return (self._prefill_share.values() + self.window.decode.values())[at]

    def _positions(self, workers: list[WorkerId]) -> tuple[np.ndarray, dict[WorkerId, int]]:
        """Each of `workers`' slot in the vectors, and its place in the list. Kept while
        routing is handed the same list (a tracked view's, until its roster changes): the
        fleet is not walked per request."""
        kept = self._kept_positions
        if kept is None or kept[0] is not workers:
            slots = self._slots
            for w in workers:
                if w not in slots:
                    self._prefill_share[w] = 0.0
            at = np.fromiter((slots[w] for w in workers), dtype=np.intp, count=len(workers))
            kept = self._kept_positions = (workers, at, {w: k for k, w in enumerate(workers)})
        return kept[1], kept[2]

    def _move(self, group: Group, heavy: WorkerId, light: WorkerId) -> None:
        """All the group's requests go to `light` in place of `heavy` from now on, and its
        load there goes too: its share of the prefill, and the decode it brought."""
        alloc = self.alloc[group] - {heavy} | {light}
        self.moved[group] = alloc
        self._reshare(group, alloc)
        self.window.move_decode(group, heavy, light)

    def _replicate(self, group: Group, heavy: WorkerId, light: WorkerId, now: float) -> None:
        alloc = self.alloc.get(group, set())
        if heavy in alloc and light not in alloc and self.overload.is_overloaded(group, heavy, now):
            if group in self.moved:
                self.moved[group].add(light)
            else:
                self.replicas.setdefault(group, set()).add(light)
            self._reshare(group, alloc | {light})
            self.overload.forget(group, heavy)

    # ------------------------------------------------------------------ bookkeeping

    def _group_cost(self, group: Group, worker: WorkerId) -> float:
        """What `group` adds to `worker`'s L."""
        share = self._share_of.get(group, 0.0) if worker in self.alloc.get(group, ()) else 0.0
        return share + self.window.decode_of.get((worker, group), 0.0)

    def _reshare(self, group: Group, alloc: set[WorkerId]) -> None:
        """Allocate `group` to `alloc` and split its windowed prefill evenly over it. A group
        with nothing left in the window is forgotten (the reference resets its allocation)."""
        old_share = self._share_of.pop(group, 0.0)
        for w in self.alloc.pop(group, ()):
            on = self._groups_on[w]
            on.discard(group)
            # nothing left here: drop the rounding the adds and subtractions left
            self._prefill_share[w] = self._prefill_share[w] - old_share if on else 0.0
        prefill = self.window.prefill.get(group)
        if prefill is None:
            for placement in (self.moved, self.replicas, self._shared):
                placement.pop(group, None)
            self.overload.forget(group)
            for h in self._introduced.pop(group, ()):
                if self._origin.get(h) == group:
                    del self._origin[h]
            return
        if not alloc:
            return
        self.alloc[group] = alloc
        share = self._share_of[group] = prefill / len(alloc)
        for w in alloc:
            self._prefill_share[w] = self._prefill_share.get(w, 0.0) + share
            self._groups_on.setdefault(w, set()).add(group)

    def _group_of(self, block: BlockHash) -> Group:
        """The group of the request that brought `block` into the cluster, while that group
        is in the window; else a group named by the block itself."""
        origin = self._origin.get(block)
        return origin if origin is not None and origin in self.window.count else block

    def _expire(self, now: float) -> None:
        for group in self.window.expire(now):
            self._reshare(group, self.alloc.get(group, set()))


def _own_group(request: Request) -> Group:
    """An explored request heads a group of its own: its whole prompt."""
    return request.block_hashes[-1] if request.block_hashes else ("request", request.id)


def _require_cost(view: ClusterView) -> CostEstimates:
    if view.cost is None:
        raise RuntimeError("preble needs cost estimates in the ClusterView (a cost model)")
    return view.cost
