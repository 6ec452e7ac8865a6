"""The live cluster: the router core (router.core.Router) driven from asyncio.

    request ─▶ Router.route ─▶ worker's dispatch queue (LocalPolicy order)
                                  │  at most `window` requests in flight per worker
                                  ▼
                      future resolved ─▶ proxy forwards ─▶ release() ─▶ next in queue

A split fleet's request (router.traits.Role) goes through two such queues: a prefill worker's,
then, once its prompt is computed (`prefilled`), a decode worker's, each with its own future.

The router's own accounting (queued, in flight, tokens outstanding) is exact and immediate;
worker-reported gauges (`/metrics`) and KV events refine the view in the background. Nothing
here does HTTP: the proxy forwards, the monitor polls, this module only keeps state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from router.classes import QUEUE_TIME, UNMEETABLE, Refused, TrafficClass
from router.config import RouterConfig
from router.core import NoHealthyWorker, Router
from router.dispatch import DispatchQueue
from router.drift import DriftGuard
from router.policy import GlobalPolicy, LocalPolicy
from router.prefix_index import PrefixIndex, WorkerId
from router.proxy.metrics import NO_DECODE, RouterMetrics
from router.request import Request
from router.runtime.collector import CollectorPacing
from router.scaling import Demand
from router.traits import IndexLevel, IndexMode, Role

log = logging.getLogger(__name__)
LEVEL_CODES = {IndexLevel.PRECISE: 2, IndexLevel.APPROXIMATE: 1, IndexLevel.LOAD: 0}


class WorkerDown(Exception):
    """The worker a request was queued for went down before it was dispatched."""


@dataclass
class LiveWorker:
    id: WorkerId
    url: str
    dispatch: DispatchQueue
    kv_events: str | None = None  # ZMQ endpoint publishing vLLM KV events, if any
    model: str | None = None  # its model group, in a fleet of several
    priority_scheduling: bool = False  # it runs --scheduling-policy priority: send `priority`
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    waiters: dict[int, asyncio.Future[LiveWorker]] = field(default_factory=dict)
    reported: dict[str, float] = field(default_factory=dict)  # last scraped vllm:* gauges
    role: Role = Role.MIXED
    kv_shape: str = "handshake"  # its KV connector's: router/proxy/split.py
    kv_warned: bool = False  # its prefill answers lacked kv_transfer_params: logged once
    adapter_slots: int = 0  # LoRA adapters it holds at once (its --max-loras; 0: no limit)

    @property
    def label(self) -> str:
        return str(self.id)


class LiveCluster:
    """The proxy's driver of the router core: monotonic time, HTTP workers, asyncio futures.

    Each routed request gets a future that resolves when its worker's dispatch queue releases it
    (or fails with WorkerDown); the proxy awaits it, forwards, and reports back here.
    """

    def __init__(
        self,
        policy: GlobalPolicy,
        local_factory: Callable[[], LocalPolicy],
        config: RouterConfig,
        metrics: RouterMetrics | None = None,
        fall: int = 2,
        clock: Callable[[], float] = time.monotonic,
        drift: DriftGuard | None = None,
        priority_scheduling: bool = False,
    ) -> None:
        """`config`: the router core's settings (router.config), run live: a policy hook that
        raises is logged and counted, not raised, and the approximate index is kept beside a
        precise one (both estimates are exported). `priority_scheduling`: what a worker added
        without saying runs (`add_worker`)."""
        self.fall = fall
        self.clock = clock
        self.metrics = metrics or RouterMetrics()
        self.precise = config.is_precise
        self.router = Router(
            policy, local_factory, replace(config, strict=False, keep_approximate=True)
        )
        self.router.hooks.on_error = lambda hook: self.metrics.policy_hook_errors.labels(hook).inc()
        self.view = self.router.view
        self.priority_scheduling = priority_scheduling
        # Each routed request's predicted time to first token (bands on), until it ends.
        self._predicted_ttft: dict[int, float] = {}
        # Metric labels of classes: the configured ones by name, the default band as the core
        # names it; any other priority (a gateway's choice) is folded into "other".
        self._class_labels = {c.priority: c.name for c in self.router.classes}
        self._class_labels.setdefault(0, self.router.classes.of_priority(0).name)
        if config.admission:  # zero series from the start: rate() needs them
            for c in self.router.classes:
                for reason in (QUEUE_TIME, UNMEETABLE):
                    self.metrics.refusals.labels(c.name, reason)
        self.policy = policy
        # Predicted against actual hits; `drift=None` builds the default guard over this
        # router's levels (pass a guard with other settings, or call indexes.set_level).
        self.router.drift = drift or DriftGuard(self.router.indexes.levels())
        self.metrics.index_level.set(LEVEL_CODES[self.router.indexes.level])
        self.workers: dict[WorkerId, LiveWorker] = {}
        self._next_id = 0  # ids are never reused: ledger keys and metrics labels hold them
        self._collector = CollectorPacing()  # a full GC pass over the index is a 10+ ms stall
        # Autoscaling (router/proxy/autoscale.py): workers routed nothing new while they finish
        # what they have, and the demand the planner hears (None: no autoscaling).
        self.draining: set[WorkerId] = set()
        self.demand: Demand | None = None

    @property
    def next_worker_id(self) -> WorkerId:
        """The id the next worker added without one gets (ids are never reused)."""
        return self._next_id

    @property
    def approx_index(self) -> PrefixIndex:
        assert self.router.indexes.approximate is not None
        return self.router.indexes.approximate

    # ------------------------------------------------------------ membership

    def add_worker(
        self,
        url: str,
        kv_events: str | None = None,
        wid: WorkerId | None = None,
        model: str | None = None,
        adapter_slots: int = 0,
        priority_scheduling: bool | None = None,
        role: str = Role.MIXED,
        kv_shape: str = "handshake",
    ) -> LiveWorker:
        """Add the worker at `url` as `wid`, by default the next id of this cluster's own
        (router replicas take ids from their store, so that every replica names it alike).
        `model`: its model group in a fleet of several; `adapter_slots`: its --max-loras;
        `priority_scheduling`: whether it runs vLLM's priority scheduling (None: the
        cluster's default); `role`: mixed, prefill or decode (router.traits.Role), and
        `kv_shape` its KV connector's shape (router/proxy/split.py)."""
        if wid is None:
            wid = self._next_id
        assert wid not in self.workers, f"worker id {wid} is taken"
        role = Role(role)
        self._next_id = max(self._next_id, wid + 1)
        dispatch = self.router.add_worker(wid, model=model, adapter_slots=adapter_slots, role=role)
        if priority_scheduling is None:
            priority_scheduling = self.priority_scheduling
        worker = LiveWorker(
            wid,
            url.rstrip("/"),
            dispatch,
            kv_events,
            model,
            priority_scheduling,
            role=role,
            kv_shape=kv_shape,
            adapter_slots=adapter_slots,
        )
        self.workers[wid] = worker
        self.metrics.healthy.labels(worker.label).set(1)
        self.metrics.retries.labels(worker.label)  # a zero series from the start, not on demand
        self.metrics.worker_role.labels(worker.label, role.value).set(1)
        if role is Role.DECODE:
            self.metrics.handoffs.labels(worker.label)
        return worker

    def add_worker_like_peers(
        self,
        url: str,
        kv_events: str | None = None,
        model: str | None = None,
        role: str = Role.MIXED,
        wid: WorkerId | None = None,
    ) -> LiveWorker:
        """Add a server started as the others of its model group were (the admin API's adds):
        their adapter slots and priority scheduling (a worker of its own role's first), and on a
        split fleet their KV connector's shape."""
        role = Role(role)
        peers = [w for w in self.workers.values() if w.model == model]
        peer = next((w for w in peers if w.role is role), peers[0] if peers else None)
        split = next((w for w in peers if w.role is not Role.MIXED), None)
        return self.add_worker(
            url,
            kv_events,
            wid,
            model,
            adapter_slots=peer.adapter_slots if peer else 0,
            priority_scheduling=peer.priority_scheduling if peer else None,
            role=role,
            kv_shape=split.kv_shape if split else "handshake",
        )

    def roles(self) -> list[str] | None:
        """A split fleet's worker roles by id (None for a fleet of mixed workers)."""
        if all(w.role is Role.MIXED for w in self.workers.values()):
            return None
        known, mixed = self.workers, Role.MIXED.value
        return [known[i].role.value if i in known else mixed for i in range(self._next_id)]

    def remove_worker(self, wid: WorkerId) -> None:
        self.mark_down(wid)
        self.router.remove_worker(wid, self.clock())
        self.draining.discard(wid)
        del self.workers[wid]

    def mark_down(self, wid: WorkerId) -> None:
        """Stop routing to `wid`, forget what it cached, and hand its queue back to callers."""
        state = self.view.workers.get(wid)
        if state is None or not state.healthy:
            return
        worker = self.workers[wid]
        withdrawn = self.router.worker_down(wid, self.clock())
        self.metrics.healthy.labels(worker.label).set(0)
        for request in withdrawn:
            fut = worker.waiters.pop(request.id, None)
            if fut is not None and not fut.done():
                fut.set_exception(WorkerDown(f"worker {wid} went down"))
        self._publish(worker)

    def mark_failure(self, worker: LiveWorker) -> None:
        """A request failed at `worker`: as a failed health check (`fall` in a row: down)."""
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        if worker.consecutive_failures >= self.fall:
            self.mark_down(worker.id)

    def mark_up(self, wid: WorkerId) -> None:
        state = self.view.workers.get(wid)
        if state is None or state.healthy:
            return
        self.router.worker_up(wid)
        self.metrics.healthy.labels(self.workers[wid].label).set(1)

    def healthy(self) -> list[LiveWorker]:
        return [w for w in self.workers.values() if self.view.workers[w.id].healthy]

    # --------------------------------------------------------------- routing

    def route(
        self, request: Request, exclude: Iterable[WorkerId] = ()
    ) -> tuple[LiveWorker, str, asyncio.Future[LiveWorker]]:
        """Choose a worker (not in `exclude`) and queue `request` there.

        The returned future resolves when the worker's dispatch queue releases the request
        (or fails with WorkerDown). It exists from the moment the request is queued: a queue
        pumped by another task in between must find it.
        """
        fut: asyncio.Future[LiveWorker] = asyncio.get_running_loop().create_future()
        now = self.clock()
        self._collector.tick(now)
        # A retry (the caller excludes the workers it tried) is no new demand; a request
        # refused is demand all the same, as the simulator counts it.
        retry = bool(exclude)
        if self.demand is not None and not retry:
            self.demand.arrived(request)
        if self.draining:
            exclude = {*exclude, *self.draining}
        try:
            routed = self.router.route(request, now, exclude)
        except NoHealthyWorker:
            raise WorkerDown("no healthy worker") from None
        except Refused as refused:  # admission control: no worker would serve it in time
            self.count_refusal(request, refused.reason)
            raise
        worker = self.workers[routed.decision.worker]
        worker.waiters[request.id] = fut
        if routed.predicted_ttft is not None:
            self._predicted_ttft[request.id] = routed.predicted_ttft
        bs = self.view.block_size
        if self.demand is not None and not retry:
            self.demand.routed(request, routed.hit_blocks * bs)
        self.metrics.prompt_tokens.labels(worker.label).inc(request.prompt_len)
        self.metrics.estimated_hit_tokens.labels(worker.label, IndexMode.APPROXIMATE).inc(
            routed.approximate_hit_blocks * bs
        )
        if self.precise:
            self.metrics.estimated_hit_tokens.labels(worker.label, IndexMode.PRECISE).inc(
                routed.hit_blocks * bs
            )
        self._send(worker, routed.released)
        return worker, routed.decision.reason, fut

    def release(
        self,
        worker: LiveWorker,
        request: Request,
        output_tokens: int,
        cached_tokens: int | None = None,
    ) -> None:
        """`request` is done at `worker` (answered or failed); start the next one there.
        `cached_tokens` is what the worker reported it reused, when it did (a decode
        worker's is the KV it was sent: not a prediction's to score)."""
        self._score_hits(worker, request, cached_tokens)
        level = self.router.indexes.level
        self._predicted_ttft.pop(request.id, None)
        self._send(worker, self.router.finish(request, self.clock(), cached_tokens))
        self._note_level(level)

    def prefilled(
        self,
        worker: LiveWorker,
        request: Request,
        cached_tokens: int | None = None,
        exclude: Iterable[WorkerId] = (),
    ) -> tuple[LiveWorker, asyncio.Future[LiveWorker]]:
        """A split request's prefill `worker` answered: that stage ends there (what its queue
        releases is woken) and the request is queued at a decode worker (not in `exclude`).
        Returns that worker and a future resolved when its queue releases the request, as
        `route` does. WorkerDown when no decode worker is healthy: the request has ended.
        `cached_tokens`: the prefix the prefill worker reported it reused."""
        fut: asyncio.Future[LiveWorker] = asyncio.get_running_loop().create_future()
        self._score_hits(worker, request, cached_tokens)
        level = self.router.indexes.level
        if self.draining:
            exclude = {*exclude, *self.draining}
        handoff = self.router.prefilled(request, self.clock(), cached_tokens, exclude)
        self._note_level(level)
        self._send(worker, handoff.released_prefill)
        if handoff.decode is None:
            self._predicted_ttft.pop(request.id, None)
            self.metrics.handoffs.labels(NO_DECODE).inc()
            raise WorkerDown("no decode worker is healthy")
        decode = self.workers[handoff.decode]
        decode.waiters[request.id] = fut
        self.metrics.handoffs.labels(decode.label).inc()
        self._send(decode, handoff.released)
        return decode, fut

    def _score_hits(self, worker: LiveWorker, request: Request, cached: int | None) -> None:
        """The hit the index predicted for `request` against the one `worker` reported."""
        if cached is not None:
            predicted = self.router.prediction(request)
            if predicted is not None:
                self.metrics.hit_tokens_predicted.labels(worker.label).inc(predicted)
                self.metrics.hit_tokens_actual.labels(worker.label).inc(cached)

    def _note_level(self, before: IndexLevel) -> None:
        if self.router.indexes.level != before:
            new = self.router.indexes.level
            log.warning("prefix-cache predictions drifted: routing by %s (was %s)", new, before)
            self.metrics.index_level.set(LEVEL_CODES[new])
            self.metrics.index_level_changes.labels(new).inc()

    def abandon(self, worker: LiveWorker, request: Request) -> None:
        """`request` was routed to `worker` and its caller gives up before it ran (timed out,
        or the worker went down): withdrawn uncharged, or, if it was just released, finished."""
        worker.waiters.pop(request.id, None)
        self._predicted_ttft.pop(request.id, None)
        if self.router.is_released(request):
            self._send(worker, self.router.finish(request, self.clock()))
        else:
            self.router.withdraw(request, self.clock())
        self._publish(worker)

    def time_out(self, worker: LiveWorker, request: Request) -> bool:
        """`request` has waited its class's queue limit at `worker`: refused (withdrawn,
        charged nothing, counted) if its queue still holds it. False: it was released
        meanwhile, and goes on."""
        if not self.router.time_out(request, self.clock()):
            return False
        worker.waiters.pop(request.id, None)
        self._predicted_ttft.pop(request.id, None)
        self.count_refusal(request, QUEUE_TIME)
        self._publish(worker)
        return True

    def count_refusal(self, request: Request, reason: str) -> None:
        """`request` was turned away for `reason` (router.classes: queue_time, unmeetable,
        rate_limit), in fairway_refusals_total by its class."""
        self.metrics.refusals.labels(self.class_label(request), reason).inc()

    def queue_limit(self, request: Request) -> float | None:
        """How long `request` may wait in a router queue (its class's, with admission on)."""
        return self.router.queue_limit(request)

    def predicted_ttft(self, request: Request) -> float | None:
        """The router's prediction of `request`'s time to first token, made when it was
        routed (None without bands), until the request ends."""
        return self._predicted_ttft.get(request.id)

    def traffic_class(self, request: Request) -> TrafficClass:
        return self.router.classes.of_request(request)

    def class_label(self, request: Request) -> str:
        """`request`'s class as a metric label: the configured classes' names are the
        operator's; a priority none names is "other", since a client may have chosen it."""
        return self._class_labels.get(request.priority, "other")

    def tokens(self, worker: LiveWorker, request: Request, n: int) -> None:
        self.router.tokens(request, n, self.clock())

    def first_token(self, worker: LiveWorker, request: Request) -> None:
        self.router.first_token(request, self.clock())

    # -------------------------------------------------------------- internals

    def _send(self, worker: LiveWorker, released: list[Request]) -> None:
        """Wake the callers of released requests; a caller that gave up frees its slot."""
        while released:
            more: list[Request] = []
            for request in released:
                fut = worker.waiters.pop(request.id, None)
                if fut is None or fut.done():
                    more += self.router.finish(request, self.clock())
                else:
                    fut.set_result(worker)
            released = more
        self._publish(worker)

    def report_gauges(self, worker: LiveWorker) -> None:
        """Hand the worker's gauges, as just scraped into `worker.reported`, to the router:
        once a scrape, not before every decision (a pass over the fleet per request)."""
        state = self.view.workers.get(worker.id)
        if state is None or not worker.reported:
            return
        self.router.report(
            worker.id,
            waiting=int(worker.reported.get("waiting", 0)),
            kv_used_blocks=int(worker.reported.get("kv_usage", 0.0) * state.kv_capacity_blocks),
        )

    def _publish(self, worker: LiveWorker) -> None:
        if worker.id not in self.workers:
            return
        self.metrics.queue_depth.labels(worker.label).set(len(worker.dispatch))
        self.metrics.in_flight.labels(worker.label).set(worker.dispatch.in_flight)
        self.metrics.index_blocks.labels(worker.label, IndexMode.APPROXIMATE).set(
            self.approx_index.num_blocks(worker.id)
        )
        if self.precise:
            self.metrics.index_blocks.labels(worker.label, IndexMode.PRECISE).set(
                self.view.index.num_blocks(worker.id)
            )
