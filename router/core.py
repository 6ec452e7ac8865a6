"""The routing sequence, written once: the simulator and the live proxy are its drivers.

    arrival ─▶ route: policy.route(req, view) ─▶ indexes ─▶ on_dispatch ─▶ DispatchQueue[w]
                                                                            │ window has room
    driver sends it (SimPy engine | HTTP to a vLLM server) ◀── released ────┘
       └─▶ first_token / tokens / finish / withdraw / worker_down ─▶ hooks, load, release

A driver supplies only time (`now` on every call), what a worker reports of itself (`report`:
requests waiting inside the server, KV blocks used) and the transport: it sends what a call
returns as released, and tells the router what came back. Everything a policy sees is computed
here from those events, so the same events give the same decisions in both backends.

Two indexes for two different facts:
- `view.index`, what routing believes a worker holds: the approximate index inserts each prompt
  on the worker it is routed to (within capacity); the precise one hears the workers' KV events.
- `held`, what a worker has computed, which a queue discipline orders by and DLPM charges by.
  Precise: the same KV-event index. Approximate: a prompt joins it when its request is sent to
  the worker, not when it is routed, so a waiting request never counts its own prompt as cached.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mypy_extensions import mypyc_attr

from router.adapters import AdapterSlots
from router.bands import Banded
from router.classes import QUEUE_TIME, UNMEETABLE, ClassTable, Refused, TrafficClass
from router.cost_model import StepShape, prefill_pairs
from router.decode import DEFAULT_SLACK, choose_decode
from router.dispatch import DispatchQueue
from router.drift import DriftGuard
from router.ledger import Ledger, ledgers_of
from router.policy import Decision, GlobalPolicy, LocalPolicy
from router.prefix_index import PrefixIndex, WorkerId
from router.request import Request
from router.traits import IndexLevel, Role
from router.view import ClusterView, CostEstimates, WorkerState

log = logging.getLogger(__name__)


@mypyc_attr(native_class=False)  # compiled, a class may not extend a builtin exception
class NoHealthyWorker(RuntimeError):
    """Nothing to route to: every worker (not excluded) is down."""


@mypyc_attr(native_class=False)
class UnknownModel(LookupError):
    """The request names a model group no worker serves."""


@dataclass(slots=True)
class Flight:
    """A routed request until it finishes or is withdrawn."""

    request: Request
    worker: WorkerId
    queue: DispatchQueue  # kept even if the worker is removed: its slot is freed on finish
    remaining: int  # tokens of work not yet done: the prompt until its first token, then output
    predicted: dict[str, int]  # hit tokens each index expected, for the drift guard
    best: int  # hit tokens the best index kept expected (scored even while not routed by)
    # The worker the global policy chose, which its hooks name: `worker` until a split
    # request is handed to its decode worker, the prefill worker after.
    charged_to: WorkerId
    split: bool = False  # on a prefill worker, to be handed to a decode worker (`prefilled`)
    handed_off: bool = False  # on its decode worker: its prompt was computed elsewhere
    # Handed off: the prefill worker's queue, whose discipline is charged its output too.
    prefill_queue: DispatchQueue | None = None
    prefill: int = 0  # prompt tokens it will compute, until its first token (ahead of others)
    prefill_pairs: float = 0.0  # their attention pairs, after its cached prefix
    predicted_ttft: float | None = None  # at routing, with classes on
    released: bool = False


@dataclass(slots=True)
class Routed:
    decision: Decision
    hit_blocks: int  # the routing index's expected hit on the chosen worker
    approximate_hit_blocks: int  # the approximate index's, when both are kept (else the same)
    released: list[Request]  # what the chosen worker's queue lets go now (this one, or others)
    adapter_load: bool = False  # the worker was not believed to hold the request's adapter
    predicted_ttft: float | None = None  # seconds from now, on the chosen worker (classes on)
    split: bool = False  # a prefill worker: the request goes on to a decode worker after


@dataclass(slots=True)
class Handoff:
    """A split request's prompt is computed: where it decodes, and what the queues release."""

    decode: WorkerId | None  # None: no decode worker is healthy, and the request has ended
    released_prefill: list[Request]  # what the prefill worker's queue lets go now
    released: list[Request]  # what the decode worker's queue lets go now (this one, or others)


class Router:
    """Routing, indexes, per-worker dispatch queues, load accounting and policy hooks.

    `window=None` releases every request at once: the engine's own scheduler runs the local
    discipline (the simulator's engine placement). `strict` re-raises what a policy hook raises;
    live, a faulty hook is logged and counted, and the request goes on.

    `classes` (router.classes) puts each worker's queue discipline in strict priority bands and
    predicts each request's time to first token. `latency_routing`: a request whose class has
    a TTFT target is routed among the workers predicted to meet it, by the global policy's own
    preference, or to the best predicted if none does. `admission`: refuse a request no worker
    is predicted to serve within its target (`Refused`), and let drivers time requests out of
    the queues after their class's `max_queue_time` (`queue_limit`, `time_out`).

    Split fleets (router.traits.Role): a request is routed among the workers that prefill
    (mixed and prefill ones) by the global policy, unchanged. On a prefill worker it computes
    its prompt only (the driver sends it with max_tokens 1); `prefilled` then ends that stage
    and queues it on a decode worker (router.decode), whose queue discipline orders it there.
    The papers define a policy's service on one server; across two stages Fairway counts the
    whole of a request on the worker its policy chose: input at admission there, output as it
    is decoded elsewhere, and every hook names that prefill worker. So VTC's client counters
    mean what they mean on a mixed fleet, and D²LPM's (client, worker) deficits are the
    prefill worker's, the choice they steer. The prefill worker's queue discipline orders
    by the same service: it charges the prompt at admission and keeps the request's account
    open after the handoff, charged the output as it is decoded (DispatchQueue.handed_off).
    A decode worker's discipline orders its own queue by its own definition of the request,
    whose prompt is cached there (its KV arrived): DLPM, charging extend tokens, charges it
    the output; VTC, whose service is prompt and output, charges both, as that batch holds
    and reads the prompt.
    """

    def __init__(
        self,
        policy: GlobalPolicy,
        local_factory: Callable[[], LocalPolicy],
        block_size: int,
        *,
        window: int | None = 8,
        cost: CostEstimates | None = None,
        precise: bool = False,
        keep_approximate: bool = False,
        kv_capacity_blocks: int = 1 << 20,
        strict: bool = True,
        adapter_load_time: float = 0.0,
        adapter_affinity: bool = True,
        classes: ClassTable | None = None,
        latency_routing: bool = False,
        admission: bool = False,
        step_tokens: int = 2048,
        decode_slack: int = DEFAULT_SLACK,
    ) -> None:
        self.policy = policy
        # Token hooks run once per sequence per step: skip the ones that do nothing.
        self._policy_counts_tokens = policy.traits.counts_tokens
        self.local_factory = local_factory
        self.window = window
        self.precise = precise
        self.strict = strict
        self.default_capacity = kv_capacity_blocks
        # Tracked: every change to a worker's state or index holdings below calls
        # view.changed, so policies' orders (least loaded, ...) are re-keyed, not rescanned.
        self.view = ClusterView(0.0, {}, PrefixIndex(), block_size, cost, tracked=True)
        # Precise: KV events fill view.index; an approximate one is kept beside it on request
        # (the proxy exports both estimates). Approximate: view.index is the approximate one.
        self.approx_index: PrefixIndex | None = (
            PrefixIndex() if precise and keep_approximate else None if precise else self.view.index
        )
        self.held = self.view.index if precise else PrefixIndex()
        # What each fallback level routes by (router.drift): KV events, what was routed, nothing.
        self._level_index = {IndexLevel.LOAD: PrefixIndex()}
        if precise:
            self._level_index[IndexLevel.PRECISE] = self.view.index
        if self.approx_index is not None:
            self._level_index[IndexLevel.APPROXIMATE] = self.approx_index
        self.index_level = IndexLevel.PRECISE if precise else IndexLevel.APPROXIMATE
        self.drift: DriftGuard | None = None  # set by a driver that hears actual hits
        self.level_changes: list[tuple[float, IndexLevel, IndexLevel]] = []  # (time, from, to)
        # Engine placement never asks the router's queues what is cached.
        self._tracks_held = window is not None and not precise
        self.queues: dict[WorkerId, DispatchQueue] = {}
        self._reported_waiting: dict[WorkerId, int] = {}
        self._flights: dict[int, Flight] = {}
        self._queues_count_tokens = False  # any worker's queue discipline (set as they join)
        self.decisions: Counter[str] = Counter()  # by the policy's stated reason
        self.routed: Counter[WorkerId] = Counter()
        self.predicted_hit_tokens = 0  # what routing expected to be cached, capped as engines cap
        self.hook_errors = 0
        # A replica among several logs what it routed, for the others' approximate indexes.
        self.routing_log: list[tuple[list[int], WorkerId, float]] | None = None
        # A request naming a model is routed among that group's workers (router.adapters for
        # the adapter among them); a fleet whose workers name no model serves every request.
        self._groups: dict[str | None, ClusterView] = {}
        self.adapters = AdapterSlots(adapter_load_time, adapter_affinity)
        # Traffic classes: bands in every queue, predicted TTFT, admission control.
        self.classes = classes if classes is not None else ClassTable()
        self.banded = classes is not None
        if (latency_routing or admission) and cost is None:
            raise ValueError("latency routing and admission control need a step-cost model")
        self.latency_routing = latency_routing
        self.admission = admission
        self.step_tokens = step_tokens  # a step's token budget: prefills are chunked by it
        self._request_overhead = float(getattr(cost, "request_overhead", 0.0))
        # Prompt tokens each worker will compute before the first token of what it was sent,
        # and their attention pairs, by priority: what a new request waits behind in its band
        # and the ones above. Pairs are summed per prompt: the queue is many prompts, not one.
        self._prefill_ahead: dict[WorkerId, dict[int, tuple[int, float]]] = {}
        self.refusals: Counter[tuple[str, str]] = Counter()  # (class, reason)
        # Split fleets: each model group's (None: the one model's) decode workers apart from
        # the ones that prefill, which `_groups` then holds under the same key.
        self._split = False
        self._decode_pools: dict[str | None, ClusterView] = {}
        self.decode_slack = decode_slack
        self.handoffs: Counter[WorkerId] = Counter()  # by decode worker

    # ------------------------------------------------------------ membership

    def add_worker(
        self,
        wid: WorkerId,
        kv_capacity_blocks: int | None = None,
        model: str | None = None,
        adapter_slots: int = 0,
        role: str = Role.MIXED,
    ) -> DispatchQueue:
        """`model`: the model group it serves (None: the fleet's one model); `adapter_slots`:
        how many LoRA adapters it holds at once (0: no limit); `role`: router.traits.Role."""
        if wid in self.queues:
            raise ValueError(f"worker {wid} is already known")
        role = Role(role)
        if self.banded:
            discipline: LocalPolicy = Banded(self.local_factory, self.classes.priorities())
        else:
            discipline = self.local_factory()
        queue = DispatchQueue(wid, discipline, self.window, banded=self.banded)
        self.queues[wid] = queue
        self._prefill_ahead[wid] = {}
        self._queues_count_tokens |= queue.counts_tokens
        capacity = self.default_capacity if kv_capacity_blocks is None else kv_capacity_blocks
        self.view.workers[wid] = WorkerState(
            wid, kv_capacity_blocks=capacity, model=model, role=role.value
        )
        if role is not Role.MIXED and not self._split:
            self._split = True
            for other in self.view.workers.values():  # the one model's workers join a pool
                if other.model is None and other.id != wid:
                    self.view.join_part(other.id, self._pool(self._groups, None))
        if role is Role.DECODE:
            self.view.join_part(wid, self._pool(self._decode_pools, model))
        elif model is not None or self._split:
            self.view.join_part(wid, self._pool(self._groups, model))
        self.adapters.add_worker(wid, adapter_slots)
        self.view.changed(wid)
        self.view.roster_changed()
        return queue

    def _pool(self, pools: dict[str | None, ClusterView], model: str | None) -> ClusterView:
        pool = pools.get(model)
        if pool is None:
            pool = pools[model] = self.view.new_part()
        return pool

    def models(self) -> list[str]:
        """The model groups some worker serves (known workers, healthy or not)."""
        pools = [*self._groups.items(), *self._decode_pools.items()]
        return sorted({m for m, pool in pools if m is not None and pool.workers})

    def worker_down(self, wid: WorkerId, now: float) -> list[Request]:
        """Stop routing to `wid` and forget what it cached. Its queued requests are withdrawn
        (uncharged) and returned for the driver to send elsewhere or fail; those in flight stay
        until the driver finishes them."""
        state = self.view.workers.get(wid)
        if state is None or not state.healthy:
            return []
        state.healthy = False
        self.view.changed(wid)
        self.view.roster_changed()
        for index in self._indexes():
            index.remove_worker(wid)
        self.adapters.report(wid, ())  # a server that comes back has loaded none
        queued = list(self.queues[wid].discipline)
        for request in queued:
            self.withdraw(request, now)
        return queued

    def worker_up(self, wid: WorkerId) -> None:
        if wid in self.view.workers:
            self.view.workers[wid].healthy = True
            self.view.changed(wid)
            self.view.roster_changed()

    def remove_worker(self, wid: WorkerId, now: float) -> list[Request]:
        """As `worker_down`, then forget the worker; its requests in flight may still finish."""
        queued = self.worker_down(wid, now)
        self.queues.pop(wid, None)
        self.view.leave_part(wid)
        self.adapters.remove_worker(wid)
        self.view.workers.pop(wid, None)
        self.view.changed(wid)
        self.view.roster_changed()
        self._reported_waiting.pop(wid, None)
        self._prefill_ahead.pop(wid, None)
        return queued

    def report(
        self,
        wid: WorkerId,
        *,
        waiting: int | None = None,
        kv_used_blocks: int | None = None,
        kv_capacity_blocks: int | None = None,
    ) -> None:
        """What a worker says of itself (vLLM's gauges live, the engine in the simulator)."""
        state = self.view.workers.get(wid)
        if state is None:
            return
        if kv_used_blocks is not None and kv_used_blocks != state.kv_used_blocks:
            state.kv_used_blocks = kv_used_blocks
            self.view.changed(wid)
        if kv_capacity_blocks is not None and kv_capacity_blocks != state.kv_capacity_blocks:
            state.kv_capacity_blocks = kv_capacity_blocks
            self.view.changed(wid)
        if waiting is not None and waiting != self._reported_waiting.get(wid):
            self._reported_waiting[wid] = waiting
            self._count(wid)

    # --------------------------------------------------------------- routing

    def route(self, request: Request, now: float, exclude: Iterable[WorkerId] = ()) -> Routed:
        """Choose a worker (not in `exclude`) for `request` and queue it there: among its
        model group's workers, and those holding its adapter unless a load elsewhere would
        start it sooner."""
        view = self.view
        view.now = now
        candidates = self.routing_pool(request)
        candidates.now = now
        excluded = set(exclude)
        if self._split and not self._decodes(request):
            # No decode worker to hand a prefill worker's requests to: mixed workers only.
            excluded.update(w for w, s in candidates.workers.items() if s.role != Role.MIXED)
        if excluded:
            candidates = candidates.among(
                {k: v for k, v in candidates.workers.items() if k not in excluded}
            )
        if not any(w.healthy for w in candidates.workers.values()):
            raise NoHealthyWorker("no healthy worker")
        if request.adapter is not None:
            candidates = self.adapters.candidates(request.adapter, candidates)
        decision = self.policy.route(request, candidates)
        ttft: float | None = None  # predicted on the chosen worker
        if self.banded and (self.latency_routing or self.admission):
            traffic = self.classes.of_request(request)
            target = traffic.ttft
            if target is not None:
                ttft = self._predict_on(request, candidates, decision.worker)
            if target is not None and ttft is not None and ttft > target:
                # The policy's choice would miss: it chooses again among those that would not
                # (its preference among them), and admission control refuses if none would.
                # (A policy keeping a turn, round robin, moves on twice.)
                predicted = self._predict_all(request, candidates)
                meeting = self._meeting_target(request, traffic, candidates, predicted)
                if meeting is not candidates:
                    candidates = meeting
                    decision = self.policy.route(request, candidates)
                ttft = predicted.get(decision.worker)
        wid = decision.worker
        state = candidates.workers.get(wid)
        if state is None or not state.healthy:
            raise RuntimeError(f"policy {self.policy.name} chose unusable worker {wid}")
        self.decisions[decision.reason] += 1
        self.routed[wid] += 1

        bs = view.block_size
        hashes = request.prompt_blocks(bs)
        approximate = self._insert_routed(self.approx_index, hashes, wid, now)
        if self.routing_log is not None and self.approx_index is not None:
            self.routing_log.append((hashes, wid, now))
        # Precise: what it holds comes from KV events, and the reuse counts as a hit.
        precise = (
            self._level_index[IndexLevel.PRECISE].touch(hashes, wid, now) if self.precise else 0
        )
        # Capped as an engine caps a hit: the last prompt token is always computed.
        cap = request.reusable_blocks(bs)
        predicted_hits: dict[str, int] = {IndexLevel.APPROXIMATE: min(approximate, cap) * bs}
        if self.precise:
            predicted_hits[IndexLevel.PRECISE] = min(precise, cap) * bs
        hits = {IndexLevel.PRECISE: precise, IndexLevel.APPROXIMATE: approximate}
        hit = hits.get(self.index_level, 0)
        self.predicted_hit_tokens += min(hit, cap) * bs

        queue = self.queues[wid]
        split = state.role == Role.PREFILL
        work = request.prompt_len if split else request.prompt_len + request.output_len
        best = predicted_hits.get(IndexLevel.PRECISE, predicted_hits[IndexLevel.APPROXIMATE])
        flight = Flight(request, wid, queue, work, predicted_hits, best, wid, split)
        if self.banded:
            if ttft is None:
                ttft = self._predict(request, state, min(hit, cap))
            flight.predicted_ttft = ttft
            cached = min(hit, cap) * bs
            new = flight.prefill = request.prompt_len - cached
            flight.prefill_pairs = prefill_pairs(new, cached)
            ahead = self._prefill_ahead[wid]
            tokens, pairs = ahead.get(request.priority, (0, 0.0))
            ahead[request.priority] = (tokens + new, pairs + flight.prefill_pairs)
        self._flights[request.id] = flight
        state.tokens_in_flight += work
        view.changed(wid)
        load = request.adapter is not None and not self.adapters.use(wid, request.adapter)
        self._hook(self.policy.on_dispatch, request, wid, view)
        queue.push(request)
        released = self._release(wid, now)
        return Routed(
            decision,
            hit,
            approximate if self.approx_index else hit,
            released,
            load,
            flight.predicted_ttft,
            split,
        )

    # ------------------------------------------------------------ split fleets

    def prefilled(
        self,
        request: Request,
        now: float,
        cached_tokens: int | None = None,
        exclude: Iterable[WorkerId] = (),
    ) -> Handoff:
        """A split request's prompt is computed on its prefill worker (its max_tokens-1
        answer came back): that stage ends there (its slot freed, its queue told, the hit it
        reports scored) and the request is queued on a decode worker (not in `exclude`),
        chosen by router.decode. With none healthy it ends here, as finished."""
        flight = self._flights.get(request.id)
        if flight is None or not flight.split:
            raise ValueError(f"request {request.id} is not a split request at its prefill")
        self._observe_hit(flight, cached_tokens, now)
        prefill = flight.worker
        self._work_done(flight, flight.remaining)
        self._prefilled(flight)
        self._hook(flight.queue.handed_off, request)
        released_prefill = self._release(prefill, now)
        # The tracked pool keeps its orders over its healthy workers: a handoff costs the
        # same on any fleet. Exclusions (a decode worker that failed it) take a pass.
        among = self._decode_pools.get(request.model)
        if among is not None and exclude:
            excluded = set(exclude)
            among = among.among({w: s for w, s in among.workers.items() if w not in excluded})
        if among is None or not among.healthy_set():
            del self._flights[request.id]
            self._hook(flight.queue.done_elsewhere, request)
            self.view.now = now
            self._hook(self.policy.on_finish, request, flight.charged_to, self.view)
            return Handoff(None, released_prefill, [])
        among.now = now
        wid = choose_decode(request, among, self.decode_slack)
        flight.prefill_queue = flight.queue
        flight.worker, flight.queue = wid, self.queues[wid]
        flight.split, flight.handed_off, flight.released = False, True, False
        flight.remaining = request.output_len
        self.view.workers[wid].tokens_in_flight += request.output_len
        self.handoffs[wid] += 1
        # It holds the prompt's KV from now on: a later turn's decode may reuse it.
        hashes = request.prompt_blocks(self.view.block_size)
        self._insert_routed(self.approx_index, hashes, wid, now)
        if self.routing_log is not None and self.approx_index is not None:
            self.routing_log.append((hashes, wid, now))
        if self._tracks_held:  # computed, as far as its queue discipline is concerned
            self._insert_routed(self.held, hashes, wid, now)
        flight.queue.push(request)
        return Handoff(wid, released_prefill, self._release(wid, now))

    def _decodes(self, request: Request) -> bool:
        """Some decode worker of `request`'s model group is healthy."""
        pool = self._decode_pools.get(request.model)
        return pool is not None and bool(pool.healthy_set())

    def routing_pool(self, request: Request) -> ClusterView:
        """The tracked view `route` starts from for `request`: its model group's workers, and
        of them the ones that prefill in a split fleet (the whole fleet otherwise). Exclusions
        and an adapter narrow it further, inside `route`."""
        if self._groups and (request.model is not None or self._split):
            group = self._groups.get(request.model)
            if group is None or not group.workers:
                raise UnknownModel(f"no worker serves model {request.model!r}")
            return group
        return self.view

    # ------------------------------------------------------ latency targets

    def predict_ttft(self, request: Request, wid: WorkerId) -> float | None:
        """Seconds until `request` would have its first token on `wid` if sent there now: the
        prompt tokens it would wait behind (its band's and higher ones' not yet prefilled),
        plus its own missed prefix, chunked into steps that also advance the running decodes,
        priced by the step-cost model. None without a cost model or for an unknown worker."""
        if wid not in self.view.workers or self.view.cost is None:
            return None
        return self._predict_on(request, self.view, wid)

    def _predict_on(self, request: Request, view: ClusterView, wid: WorkerId) -> float:
        hit = view.index.match_of(request.block_hashes, wid)
        cap = request.reusable_blocks(view.block_size)
        return self._predict(request, view.workers[wid], min(hit, cap))

    def _predict(self, request: Request, state: WorkerState, hit_blocks: int) -> float:
        cost = self.view.cost
        assert cost is not None
        cached = hit_blocks * self.view.block_size
        own = request.prompt_len - cached
        new, pairs = own, prefill_pairs(own, cached)
        for priority, (tokens, their_pairs) in self._prefill_ahead[state.id].items():
            if priority <= request.priority:
                new += tokens
                pairs += their_pairs
        # Chunked into steps of the engine's token budget, each also decoding what runs there
        # (a decoding sequence takes a token of each step's budget first).
        running = state.num_running
        steps = -(-new // max(self.step_tokens - running, self.step_tokens // 4))
        context = state.kv_used_blocks * self.view.block_size if running else 0
        step = StepShape(
            -(-new // steps) + running,
            pairs / steps + context,
            -(-(cached + new) // steps) + context,
            running,
        )
        seconds = steps * cost.step_time(step) + self._request_overhead
        if running:  # it joins at the end of the step in progress, half of one on average
            seconds += 0.5 * cost.decode_time(running, context)
        return seconds

    def _predict_all(self, request: Request, view: ClusterView) -> dict[WorkerId, float]:
        """Predicted TTFT on each healthy worker of `view`, from one walk of the index."""
        cap = request.reusable_blocks(view.block_size)
        hits = view.index.match(request.block_hashes[:cap])
        return {
            w.id: self._predict(request, w, hits.get(w.id, 0))
            for w in view.workers.values()
            if w.healthy
        }

    def _meeting_target(
        self,
        request: Request,
        traffic: TrafficClass,
        view: ClusterView,
        predicted: dict[WorkerId, float],
    ) -> ClusterView:
        """The workers of `view` predicted to meet the class's TTFT target (routing by
        latency), or the best predicted if none does; admission control refuses then."""
        target = traffic.ttft
        assert target is not None
        meeting = [wid for wid, t in predicted.items() if t <= target]
        if not meeting:
            best = min(predicted, key=lambda wid: (predicted[wid], wid))
            if self.admission:
                self.refusals[(traffic.name, UNMEETABLE)] += 1
                excess = predicted[best] - target
                raise Refused(
                    UNMEETABLE,
                    f"no worker can start this {traffic.name} request within its "
                    f"{target:g} s target (best predicted {predicted[best]:.3g} s)",
                    retry_after=max(1.0, excess),
                )
            meeting = [best]
        if not self.latency_routing or len(meeting) == len(view.workers):
            return view
        return view.among({wid: view.workers[wid] for wid in meeting})

    def queue_limit(self, request: Request) -> float | None:
        """How long `request` may wait in a queue before admission control refuses it."""
        if not self.admission:
            return None
        return self.classes.of_request(request).max_queue_time

    def time_out(self, request: Request, now: float) -> bool:
        """`request` has waited its class's limit: withdrawn and counted as refused if it has
        not been released to its worker (False: it has, and goes on). A split request waiting
        for its decode worker has started: it goes on too."""
        flight = self._flights.get(request.id)
        if flight is None or flight.handed_off or not self.withdraw(request, now):
            return False
        self.refusals[(self.classes.of_request(request).name, QUEUE_TIME)] += 1
        return True

    def never_started(self, request: Request, now: float) -> list[Request]:
        """A released request its worker dropped from its own queue before starting it (the
        simulated engine placement's queue-time limit): freed and charged nothing, as a
        withdrawal. Returns what the worker's queue releases next."""
        flight = self._flights.get(request.id)
        if flight is None:
            return []
        self.refusals[(self.classes.of_request(request).name, QUEUE_TIME)] += 1
        return self._end(flight, now, self.policy.on_withdraw)

    def _insert_routed(
        self, index: PrefixIndex | None, hashes: list[int], wid: WorkerId, now: float
    ) -> int:
        """Believe `wid` now holds `hashes`, within its capacity; returns the blocks it held
        already (what a worker holds is prefix-closed, so that is its expected hit)."""
        if index is None:
            return 0
        held_before = len(hashes) - index.insert(hashes, wid, now)
        index.evict(wid, self.view.workers[wid].kv_capacity_blocks)
        self.view.changed(wid)
        return held_before

    # ------------------------------------------------------------- progress

    def first_token(self, request: Request, now: float) -> None:
        flight = self._flights.get(request.id)
        if flight is None:
            return
        if not flight.handed_off:  # its prompt is done (a decode worker had none to do)
            self._work_done(flight, min(request.prompt_len, flight.remaining))
        self._prefilled(flight)
        self._hook(self.policy.on_first_token, request, flight.charged_to, now)

    def tokens(self, request: Request, num_tokens: int, now: float) -> None:
        """`num_tokens` more output tokens (negative: a correction to an earlier estimate)."""
        self.tokens_many((request,), num_tokens, now)

    def work_done_on(
        self, wid: WorkerId, num_tokens: int, kv_used_blocks: int | None = None
    ) -> None:
        """`num_tokens` of `wid`'s work done, before it is known whose: a simulated engine
        part-way through a decode run, with its KV use (as `report` would take it) since
        nothing else moves. `tokens_many(..., credited=True)` settles the tokens on their
        requests later, without counting them on the worker again."""
        self._credit(wid, num_tokens, kv_used_blocks)

    def tokens_many(
        self, requests: Iterable[Request], num_tokens: int, now: float, credited: bool = False
    ) -> None:
        """`num_tokens` more for each of `requests`: a simulated engine's batch, one call per
        step or run applied (the hot path of a simulation: hooks that do nothing are skipped).
        `credited`: the worker's load already counts them (`work_done_on`)."""
        flights, counts_tokens = self._flights, self._policy_counts_tokens
        hooks = counts_tokens or self._queues_count_tokens
        worker, done_there = None, 0  # a batch is one worker's: its load changes once
        counted: list[Request] = []  # for the policy, in one call per worker as well
        counted_on: WorkerId | None = None
        for request in requests:  # per sequence per step: plain arithmetic (a min() was 5 %)
            flight = flights.get(request.id)
            if flight is None:
                continue
            remaining = flight.remaining
            done = num_tokens if num_tokens < remaining else remaining
            if done > 0:
                flight.remaining = remaining - done
                if not credited:
                    if flight.worker != worker:
                        self._credit(worker, done_there)
                        worker, done_there = flight.worker, 0
                    done_there += done
            if hooks:
                if counts_tokens:
                    if flight.charged_to != counted_on:
                        if counted:
                            self._hook(self.policy.on_tokens, counted, counted_on, num_tokens, now)
                        counted, counted_on = [], flight.charged_to
                    counted.append(request)
                if flight.released and flight.queue.counts_tokens:
                    self._hook(flight.queue.on_token, request, num_tokens)
                stage = flight.prefill_queue
                if stage is not None and stage.counts_tokens:
                    self._hook(stage.on_token, request, num_tokens)
        if counted:
            self._hook(self.policy.on_tokens, counted, counted_on, num_tokens, now)
        self._credit(worker, done_there)

    def finish(
        self, request: Request, now: float, cached_tokens: int | None = None
    ) -> list[Request]:
        """`request` is done (answered or failed). Returns what its worker releases next.
        `cached_tokens`, what the worker says it reused, scores the indexes' predictions."""
        flight = self._flights.get(request.id)
        if flight is None:
            return []
        # A split request's hit was scored at its prefill: its decode worker's is the KV sent.
        if not flight.handed_off:
            self._observe_hit(flight, cached_tokens, now)
        if not flight.released:
            self.withdraw(request, now)
            return []
        return self._end(flight, now, self.policy.on_finish)

    def _observe_hit(self, flight: Flight, cached_tokens: int | None, now: float) -> None:
        """Score the indexes' predicted hit against what the worker reports it reused, and
        fall back (or climb) a level when the drift guard says so."""
        if cached_tokens is not None and self.drift is not None:
            level = self.drift.observe(flight.predicted, cached_tokens)
            if level is not None:
                self.set_index_level(level, now)

    def _end(
        self, flight: Flight, now: float, hook: Callable[[Request, WorkerId, ClusterView], None]
    ) -> list[Request]:
        """A released request is gone from its worker: its work, prompt and slot freed, the
        policy told by `hook`; returns what the worker's queue releases next."""
        request = flight.request
        del self._flights[request.id]
        self._work_done(flight, flight.remaining)
        self._prefilled(flight)
        self._hook(flight.queue.done, request)
        if flight.prefill_queue is not None:
            self._hook(flight.prefill_queue.done_elsewhere, request)
        self.view.now = now
        self._hook(hook, request, flight.charged_to, self.view)
        return self._release(flight.worker, now)

    def withdraw(self, request: Request, now: float) -> bool:
        """Take back a request that was routed but never released (its caller gave up, or its
        worker went down). Nothing is charged for it. False if it was released already."""
        flight = self._flights.get(request.id)
        if flight is None or flight.released:
            return False
        del self._flights[request.id]
        self._work_done(flight, flight.remaining)
        self._prefilled(flight)
        self._hook(flight.queue.withdraw, request)
        self._count(flight.worker)
        self.view.now = now
        # Withdrawn from a decode queue, it did run: its prefill is charged, as a finish.
        if flight.prefill_queue is not None:
            self._hook(flight.prefill_queue.done_elsewhere, request)
        hook = self.policy.on_finish if flight.handed_off else self.policy.on_withdraw
        self._hook(hook, request, flight.charged_to, self.view)
        return True

    # ------------------------------------------------------------- replicas

    def share_indexes(self, other: Router) -> None:
        """Route by `other`'s approximate and held indexes (replicas sharing one store)."""
        self.view.index = self.approx_index = other.view.index
        self._level_index[IndexLevel.APPROXIMATE] = other.view.index
        self.held = other.held
        self.view.changed_all()

    def ledgers(self) -> dict[tuple[object, ...], Ledger]:
        """The shareable counters of this router's policies: the global policy's, and each
        worker's queue discipline's (keyed so that replicas' keys for the same thing match)."""
        out: dict[tuple[object, ...], Ledger] = {
            ("global", name): ledger for name, ledger in ledgers_of(self.policy).items()
        }
        for wid, queue in self.queues.items():
            discipline = queue.discipline
            if isinstance(discipline, Banded):  # each band keeps its own counters
                for priority, band in discipline.bands.items():
                    for name, ledger in ledgers_of(band).items():
                        out[("queue", wid, priority, name)] = ledger
                continue
            for name, ledger in ledgers_of(discipline).items():
                out[("queue", wid, name)] = ledger
        return out

    def learn_routed(self, routed: list[tuple[list[int], WorkerId, float]]) -> None:
        """Other replicas' routing decisions, into this one's approximate index."""
        if self.approx_index is None:
            return
        for hashes, wid, at in routed:
            if wid in self.view.workers:
                self._insert_routed(self.approx_index, hashes, wid, at)

    def set_index_level(self, level: str, now: float) -> None:
        """Route by the precise index, the approximate one, or none (load only); `level` is
        an `IndexLevel` or the string it names."""
        if level not in self._level_index:
            have = sorted(str(lvl) for lvl in self._level_index)
            raise ValueError(f"index level {str(level)!r}: this router has {have}")
        new = IndexLevel(level)
        if new is not self.index_level:
            self.level_changes.append((now, self.index_level, new))
            self.index_level = new
            self.view.index = self._level_index[new]
            self.view.changed_all()

    def index_levels(self) -> tuple[IndexLevel, ...]:
        """The fallback levels this router has, best first."""
        return tuple(lvl for lvl in IndexLevel if lvl in self._level_index)

    def prediction(self, request: Request) -> int | None:
        """The hit tokens the best index this router keeps expected for `request`, whether or
        not routing uses it now (None once the request is gone)."""
        flight = self._flights.get(request.id)
        return None if flight is None else flight.best

    def is_released(self, request: Request) -> bool:
        flight = self._flights.get(request.id)
        return flight is not None and flight.released

    # -------------------------------------------------------------- internals

    def _release(self, wid: WorkerId, now: float) -> list[Request]:
        state = self.view.workers.get(wid)
        if state is None or not state.healthy:
            self._count(wid)
            return []
        bs = self.view.block_size
        out = list(self.queues[wid].release(self.held, bs))
        for request in out:
            self._flights[request.id].released = True
            if self._tracks_held:  # the worker computes this prompt from now on
                self._insert_routed(self.held, request.prompt_blocks(bs), wid, now)
        self._count(wid)
        return out

    def _indexes(self) -> list[PrefixIndex]:
        out: list[PrefixIndex] = []
        for index in (*self._level_index.values(), self.held, self.approx_index):
            if index is not None and all(index is not o for o in out):
                out.append(index)
        return out

    def _count(self, wid: WorkerId) -> None:
        """Requests waiting (in the router, or inside the server as it reports) and running."""
        state, queue = self.view.workers.get(wid), self.queues.get(wid)
        if state is None or queue is None:
            return
        inside = min(self._reported_waiting.get(wid, 0), queue.in_flight)
        waiting, running = len(queue) + inside, queue.in_flight - inside
        if waiting != state.num_waiting or running != state.num_running:
            state.num_waiting, state.num_running = waiting, running
            self.view.changed(wid)

    def _prefilled(self, flight: Flight) -> None:
        """Its prompt is no longer ahead of anyone on its worker."""
        if flight.prefill:
            ahead = self._prefill_ahead.get(flight.worker)
            if ahead is not None:
                tokens, pairs = ahead[flight.request.priority]
                ahead[flight.request.priority] = (
                    tokens - flight.prefill,
                    pairs - flight.prefill_pairs,
                )
            flight.prefill, flight.prefill_pairs = 0, 0.0

    def _work_done(self, flight: Flight, tokens: int) -> None:
        tokens = max(tokens, 0)
        flight.remaining -= tokens
        self._credit(flight.worker, tokens)

    def _credit(self, wid: WorkerId | None, tokens: int, kv_used_blocks: int | None = None) -> None:
        """`tokens` of work done on `wid` (None: nowhere), and its KV use if known."""
        state = self.view.workers.get(wid) if wid is not None else None
        if state is not None:
            state.tokens_in_flight -= tokens
            if kv_used_blocks is not None:
                state.kv_used_blocks = kv_used_blocks
            self.view.changed(state.id)

    def _hook(self, hook: Callable[..., object], *args: object) -> None:
        """Run a policy hook; live, one that raises must not take the request down with it."""
        try:
            hook(*args)
        except Exception:
            if self.strict:
                raise
            self.hook_errors += 1
            log.exception("policy hook %s failed", getattr(hook, "__qualname__", hook))
