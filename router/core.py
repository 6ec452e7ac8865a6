"""The routing sequence, written once: the simulator and the live proxy are its drivers.

    arrival ─▶ route: policy.route(req, view) ─▶ indexes ─▶ on_dispatch ─▶ DispatchQueue[w]
                                                                            │ window has room
    driver sends it (SimPy engine | HTTP to a vLLM server) ◀── released ────┘
       └─▶ first_token / tokens / finish / withdraw / worker_down ─▶ hooks, load, release

A driver supplies only time (`now` on every call), what a worker reports of itself (`report`:
requests waiting inside the server, KV blocks used) and the transport: it sends what a call
returns as released, and tells the router what came back. Everything a policy sees is computed
here from those events, so the same events give the same decisions in both backends.

The Router keeps the sequence (route, release, finish, withdraw) and the requests in flight;
each other concern is a part of its own, composed here:

    roster       router.roster       the workers, their queues and health; what they report
    pools        router.pools        which workers a request may go to (model groups, split pools)
    indexes      router.indexes      what routing believes each worker holds, and what it computed
    latency      router.latency      predicted TTFT, routing by latency targets, admission control
    load         router.load         each worker's load figures, exact from the router's own events
    progress     router.progress     each request's work left as its tokens come; token hooks
    handoff      router.handoff      a split request's move to its decode worker (router.decode)
    adapters     router.adapters     which LoRA adapters each worker holds
    replication  router.replication  what replicas share: indexes and policies' counters
    hooks        router.hooks        running a policy's hooks, strict or forgiving

A driver calls the Router alone; the Router's methods for membership, progress and replicas hand
the call to their part.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Final

from mypy_extensions import mypyc_attr

from router.adapters import AdapterSlots
from router.classes import QUEUE_TIME
from router.config import RouterConfig
from router.dispatch import DispatchQueue
from router.drift import DriftGuard
from router.flight import Flight, Handoff, Routed
from router.handoff import DecodeHandoff
from router.hooks import Hooks
from router.indexes import Indexes
from router.latency import LatencyTargets
from router.ledger import Ledger
from router.load import Load
from router.policy import GlobalPolicy, LocalPolicy, overridden_hook
from router.pools import Pools
from router.prefix_index import PrefixIndex, WorkerId
from router.progress import Progress
from router.replication import Replication
from router.request import Request
from router.roster import Roster
from router.traits import IndexLevel, Role
from router.view import ClusterView, boxed_id

# The enum members a decision reads, as module constants: an Enum class's attribute is looked
# up through its metaclass's __getattr__ hook (about 800 instructions a read, compiled or not).
_PRECISE: Final = IndexLevel.PRECISE
_APPROXIMATE: Final = IndexLevel.APPROXIMATE
_MIXED: Final = Role.MIXED
_PREFILL: Final = Role.PREFILL


@mypyc_attr(native_class=False)  # compiled, a class may not extend a builtin exception
class NoHealthyWorker(RuntimeError):
    """Nothing to route to: every worker (not excluded) is down."""


@mypyc_attr(allow_interpreted_subclasses=True)  # a test records a driver's calls in one
class Router:
    """The routing sequence over its parts, and the one object a driver calls.

    `config` (router.config.RouterConfig) holds every setting; `policy` routes, and each
    worker's queue gets its own discipline from `local_factory`. With `config.window` None the
    engine's own scheduler runs the discipline (the simulator's engine placement). Strict
    configs re-raise what a policy hook raises; live, a faulty hook is logged and counted, and
    the request goes on (router.hooks).

    Split fleets (router.traits.Role): a request is routed among the workers that prefill
    (mixed and prefill ones) by the global policy, unchanged. On a prefill worker it computes
    its prompt only (the driver sends it with max_tokens 1); `prefilled` then ends that stage
    and queues it on a decode worker (router.handoff), whose queue discipline orders it there.
    Every policy hook names the prefill worker, which is charged the whole request (router.decode
    says why).
    """

    def __init__(
        self,
        policy: GlobalPolicy,
        local_factory: Callable[[], LocalPolicy],
        config: RouterConfig,
    ) -> None:
        self.config = config
        self.policy = policy
        self.local_factory = local_factory
        self.hooks = Hooks(config.strict)
        # Tracked: every change to a worker's state or index holdings below calls
        # view.changed, so policies' orders (least loaded, ...) are re-keyed, not rescanned.
        self.view = ClusterView(
            0.0, {}, PrefixIndex(), config.block_size, config.cost, tracked=True
        )
        self.pools = Pools(self.view)
        self.indexes = Indexes(
            self.view,
            config.is_precise,
            config.keep_approximate,
            tracks_held=config.window is not None and not config.is_precise,
            # What was routed is believed held there while anything reads it: the policy,
            # classes' TTFT predictions (by hit), or the hit estimates' users (`estimate_hits`).
            believes_routed=(
                policy.traits.reads_prefixes or config.is_banded or config.estimate_hits
            ),
        )
        # The policy's per-request hooks, None where it keeps GlobalPolicy's no-op.
        self._on_dispatch = overridden_hook(policy, "on_dispatch")
        self._on_finish = overridden_hook(policy, "on_finish")
        self.latency = LatencyTargets(self.view, config)
        self.load = Load(self.view)
        self.adapters = AdapterSlots(config.adapter_load_time, config.adapter_affinity)
        self.roster = Roster(
            config, local_factory, self.view, self.pools, self.indexes, self.latency, self.load,
            self.adapters,
        )  # fmt: skip
        self.queues = self.roster.queues
        self._flights: dict[int, Flight] = {}
        self.progress = Progress(self._flights, policy, self.load, self.latency, self.hooks)
        self.handoff = DecodeHandoff(
            config.decode_slack, self.view, self.pools, self.queues, self.indexes, self.load
        )
        self.replication = Replication(policy, self.queues, self.indexes)
        self.classes = self.latency.classes
        self.banded = config.is_banded
        self._predicts_latency = config.predicts_latency
        self.drift: DriftGuard | None = None  # set by a driver that hears actual hits
        self.decisions: Counter[str] = Counter()  # by the policy's stated reason
        self.routed: Counter[WorkerId] = Counter()
        self.handoffs = self.handoff.handoffs  # by decode worker
        self.refusals = self.latency.refusals  # (class, reason)
        self.predicted_hit_tokens = 0  # what routing expected to be cached, capped as engines cap

    @property
    def hook_errors(self) -> int:
        """Policy hooks that raised (live; a strict config stops at the first)."""
        return self.hooks.errors

    # ------------------------------------------------------------ membership (router.roster)

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
        queue = self.roster.add(wid, kv_capacity_blocks, model, adapter_slots, role)
        self.progress.queue_added(queue)
        return queue

    def worker_down(self, wid: WorkerId, now: float) -> list[Request]:
        """Stop routing to `wid` and forget what it cached. Its queued requests are withdrawn
        (uncharged) and returned for the driver to send elsewhere or fail; those in flight stay
        until the driver finishes them."""
        queued = self.roster.down(wid)
        for request in queued:
            self.withdraw(request, now)
        return queued

    def worker_up(self, wid: WorkerId) -> None:
        self.roster.up(wid)

    def remove_worker(self, wid: WorkerId, now: float) -> list[Request]:
        """As `worker_down`, then forget the worker; its requests in flight may still finish."""
        queued = self.worker_down(wid, now)
        self.roster.remove(wid)
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
        self.roster.report(wid, waiting, kv_used_blocks, kv_capacity_blocks)

    # --------------------------------------------------------------- routing

    def route(self, request: Request, now: float, exclude: Iterable[WorkerId] = ()) -> Routed:
        """Choose a worker (not in `exclude`) for `request` and queue it there: among its
        model group's workers, and those holding its adapter unless a load elsewhere would
        start it sooner."""
        view = self.view
        view.now = now
        candidates = self.pools.routing_pool(request)
        candidates.now = now
        excluded = set(exclude)
        if self.pools.is_split and not self.pools.has_decode(request):
            # No decode worker to hand a prefill worker's requests to: mixed workers only.
            excluded.update(w for w, s in candidates.workers.items() if s.role != _MIXED)
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
        if self._predicts_latency:
            decision, ttft = self.latency.route(request, candidates, decision, self.policy.route)
        wid = decision.worker
        key = boxed_id(wid)  # for the maps below: one boxed int, not one each
        state = candidates.workers.get(key)
        if state is None or not state.healthy:
            raise RuntimeError(f"policy {self.policy.name} chose unusable worker {wid}")
        self.decisions[decision.reason] += 1
        self.routed[key] += 1

        precise, approximate = self.indexes.routed(request, wid, now)
        # Capped as an engine caps a hit: the last prompt token is always computed.
        bs, cap = view.block_size, request.reusable_blocks(view.block_size)
        predicted_hits: dict[str, int] = {_APPROXIMATE: min(approximate, cap) * bs}
        if self.indexes.precise:
            predicted_hits[_PRECISE] = min(precise, cap) * bs
        level = self.indexes.level
        hit = precise if level is _PRECISE else approximate if level is _APPROXIMATE else 0
        self.predicted_hit_tokens += min(hit, cap) * bs

        queue = self.queues[key]
        split = state.role == _PREFILL
        work = request.prompt_len if split else request.prompt_len + request.output_len
        best = predicted_hits.get(_PRECISE, predicted_hits[_APPROXIMATE])
        flight = Flight(request, wid, queue, work, predicted_hits, best, wid, split)
        if self.banded:
            flight.predicted_ttft = ttft
            self.latency.queued(flight, state, min(hit, cap))
        self._flights[request.id] = flight
        self.load.add(wid, work)
        load = request.adapter is not None and not self.adapters.use(wid, request.adapter)
        if self._on_dispatch is not None:
            self.hooks.run(self._on_dispatch, request, wid, view)
        queue.push(request)
        released = self._release(wid, now)
        approximate_hit = approximate if self.indexes.approximate is not None else hit
        return Routed(decision, hit, approximate_hit, released, load, flight.predicted_ttft, split)

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
        self.progress.done(flight, flight.remaining)
        self.latency.prefilled(flight)
        self.hooks.run(flight.queue.handed_off, request)
        released_prefill = self._release(prefill, now)
        decode = self.handoff.hand_off(flight, now, exclude)
        if decode is None:
            del self._flights[request.id]
            self.hooks.run(flight.queue.done_elsewhere, request)
            self.view.now = now
            self.hooks.run(self.policy.on_finish, request, flight.charged_to, self.view)
            return Handoff(None, released_prefill, [])
        return Handoff(decode, released_prefill, self._release(decode, now))

    # ------------------------------------------------------ latency targets

    def queue_limit(self, request: Request) -> float | None:
        """How long `request` may wait in a queue before admission control refuses it."""
        return self.latency.queue_limit(request)

    def time_out(self, request: Request, now: float) -> bool:
        """`request` has waited its class's limit: withdrawn and counted as refused if it has
        not been released to its worker (False: it has, and goes on). A split request waiting
        for its decode worker has started: it goes on too."""
        flight = self._flights.get(request.id)
        if flight is None or flight.handed_off or not self.withdraw(request, now):
            return False
        self.latency.refused(request, QUEUE_TIME)
        return True

    def never_started(self, request: Request, now: float) -> list[Request]:
        """A released request its worker dropped from its own queue before starting it (the
        simulated engine placement's queue-time limit): freed and charged nothing, as a
        withdrawal. Returns what the worker's queue releases next."""
        flight = self._flights.get(request.id)
        if flight is None:
            return []
        self.latency.refused(request, QUEUE_TIME)
        return self._end(flight, now, self.policy.on_withdraw)

    # ------------------------------------------------------ progress (router.progress)

    def first_token(self, request: Request, now: float) -> None:
        self.progress.first_token(request, now)

    def tokens(self, request: Request, num_tokens: int, now: float) -> None:
        """`num_tokens` more output tokens (negative: a correction to an earlier estimate)."""
        self.progress.tokens_many((request,), num_tokens, now, False)

    def work_done_on(
        self, wid: WorkerId, num_tokens: int, kv_used_blocks: int | None = None
    ) -> None:
        """`num_tokens` of `wid`'s work done, before it is known whose: a simulated engine
        part-way through a decode run, with its KV use (as `report` would take it) since
        nothing else moves. `tokens_many(..., credited=True)` settles the tokens on their
        requests later, without counting them on the worker again."""
        self.progress.work_done_on(wid, num_tokens, kv_used_blocks)

    def tokens_many(
        self, requests: Iterable[Request], num_tokens: int, now: float, credited: bool = False
    ) -> None:
        """`num_tokens` more for each of `requests`: a simulated engine's batch, one call per
        step or run applied (the hot path of a simulation: hooks that do nothing are skipped).
        `credited`: the worker's load already counts them (`work_done_on`)."""
        self.progress.tokens_many(requests, num_tokens, now, credited)

    # ------------------------------------------------------------------ ending

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
        return self._end(flight, now, self._on_finish)

    def withdraw(self, request: Request, now: float) -> bool:
        """Take back a request that was routed but never released (its caller gave up, or its
        worker went down). Nothing is charged for it. False if it was released already."""
        flight = self._flights.get(request.id)
        if flight is None or flight.released:
            return False
        del self._flights[request.id]
        self.progress.done(flight, flight.remaining)
        self.latency.prefilled(flight)
        self.hooks.run(flight.queue.withdraw, request)
        self.roster.count(flight.worker)
        self.view.now = now
        # Withdrawn from a decode queue, it did run: its prefill is charged, as a finish.
        if flight.prefill_queue is not None:
            self.hooks.run(flight.prefill_queue.done_elsewhere, request)
        hook = self.policy.on_finish if flight.handed_off else self.policy.on_withdraw
        self.hooks.run(hook, request, flight.charged_to, self.view)
        return True

    def prediction(self, request: Request) -> int | None:
        """The hit tokens the best index this router keeps expected for `request`, whether or
        not routing uses it now (None once the request is gone)."""
        flight = self._flights.get(request.id)
        return None if flight is None else flight.best

    def is_released(self, request: Request) -> bool:
        flight = self._flights.get(request.id)
        return flight is not None and flight.released

    # --------------------------------------------------- replicas (router.replication)

    def share_indexes(self, other: Router) -> None:
        """Route by `other`'s approximate and held indexes (replicas sharing one store)."""
        self.replication.share_indexes(other.replication)

    def ledgers(self) -> dict[tuple[object, ...], Ledger]:
        """The shareable counters of this router's policies: the global policy's, and each
        worker's queue discipline's (keyed so that replicas' keys for the same thing match)."""
        return self.replication.ledgers()

    # -------------------------------------------------------------- internals

    def _observe_hit(self, flight: Flight, cached_tokens: int | None, now: float) -> None:
        """Score the indexes' predicted hit against what the worker reports it reused, and
        fall back (or climb) a level when the drift guard says so."""
        if cached_tokens is not None and self.drift is not None:
            level = self.drift.observe(flight.predicted, cached_tokens)
            if level is not None:
                self.indexes.set_level(level, now)

    def _end(
        self,
        flight: Flight,
        now: float,
        hook: Callable[[Request, WorkerId, ClusterView], None] | None,
    ) -> list[Request]:
        """A released request is gone from its worker: its work, prompt and slot freed, the
        policy told by `hook` (None: nothing to tell); returns what the worker's queue
        releases next."""
        request = flight.request
        del self._flights[request.id]
        self.progress.done(flight, flight.remaining)
        self.latency.prefilled(flight)
        self.hooks.run(flight.queue.done, request)
        if flight.prefill_queue is not None:
            self.hooks.run(flight.prefill_queue.done_elsewhere, request)
        self.view.now = now
        if hook is not None:
            self.hooks.run(hook, request, flight.charged_to, self.view)
        return self._release(flight.worker, now)

    def _release(self, wid: WorkerId, now: float) -> list[Request]:
        key = boxed_id(wid)
        state = self.view.workers.get(key)
        if state is None or not state.healthy:
            self.roster.count(wid)
            return []
        out = self.queues[key].release(self.indexes.held, self.view.block_size)
        for request in out:
            self._flights[request.id].released = True
            self.indexes.computed(request, wid, now)  # the worker computes it from now on
        self.roster.count(wid)
        return out
