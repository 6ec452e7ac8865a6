"""The live cluster: the same ClusterView and policy objects as the simulator, fed by real state.

    request ─▶ policy.route(view) ─▶ worker's dispatch queue (LocalPolicy order)
                                        │  at most `window` requests in flight per worker
                                        ▼
                                     forwarded ─▶ release() ─▶ next in queue

The router's own accounting (queued, in flight, tokens outstanding) is exact and immediate;
worker-reported gauges (`/metrics`) and KV events refine the view in the background. Nothing
here does HTTP: the proxy forwards, the monitor polls, this module only keeps state.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from router.cluster import ClusterView, CostEstimates, WorkerState
from router.dispatch import DispatchQueue
from router.metrics import RouterMetrics
from router.policy import GlobalPolicy, LocalPolicy
from router.prefix_index import PrefixIndex, WorkerId
from router.request import Request


class WorkerDown(Exception):
    """The worker a request was queued for went down before it was dispatched."""


@dataclass
class LiveWorker:
    id: WorkerId
    url: str
    dispatch: DispatchQueue
    kv_events: str | None = None  # ZMQ endpoint publishing vLLM KV events, if any
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    waiters: dict[int, asyncio.Future[LiveWorker]] = field(default_factory=dict)
    reported: dict[str, float] = field(default_factory=dict)  # last scraped vllm:* gauges

    @property
    def label(self) -> str:
        return str(self.id)


class LiveCluster:
    def __init__(
        self,
        policy: GlobalPolicy,
        local_factory: Callable[[], LocalPolicy],
        block_size: int,
        window: int = 8,
        cost: CostEstimates | None = None,
        metrics: RouterMetrics | None = None,
        kv_capacity_blocks: int = 1 << 20,
        precise: bool = False,
        fall: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fall = fall
        self.policy = policy
        self.local_factory = local_factory
        self.window = window
        self.clock = clock
        self.metrics = metrics or RouterMetrics()
        self.kv_capacity_blocks = kv_capacity_blocks
        self.precise = precise
        self.view = ClusterView(clock(), {}, PrefixIndex(), block_size, cost)
        # Precise mode keeps what workers report in its own index; the approximate one (updated
        # on routing) stays alongside so the metrics can compare the two.
        self.approx_index = self.view.index if not precise else PrefixIndex()
        self.workers: dict[WorkerId, LiveWorker] = {}
        self._ids = itertools.count()
        self._outstanding_tokens: dict[int, tuple[WorkerId, int]] = {}

    # ------------------------------------------------------------ membership

    def add_worker(self, url: str, kv_events: str | None = None) -> LiveWorker:
        wid = next(self._ids)
        dispatch = DispatchQueue(wid, self.local_factory(), self.window)
        worker = LiveWorker(wid, url.rstrip("/"), dispatch, kv_events)
        self.workers[wid] = worker
        self.view.workers[wid] = WorkerState(wid, kv_capacity_blocks=self.kv_capacity_blocks)
        self.metrics.healthy.labels(worker.label).set(1)
        self.metrics.retries.labels(worker.label)  # a zero series from the start, not on demand
        return worker

    def remove_worker(self, wid: WorkerId) -> None:
        self.mark_down(wid)
        del self.workers[wid]
        del self.view.workers[wid]

    def mark_down(self, wid: WorkerId) -> None:
        """Stop routing to `wid`, forget what it cached, and hand its queue back to callers."""
        state = self.view.workers[wid]
        if not state.healthy:
            return
        state.healthy = False
        self.view.index.remove_worker(wid)
        if self.approx_index is not self.view.index:
            self.approx_index.remove_worker(wid)
        worker = self.workers[wid]
        self.metrics.healthy.labels(worker.label).set(0)
        for fut in worker.waiters.values():
            if not fut.done():
                fut.set_exception(WorkerDown(f"worker {wid} went down"))
        worker.waiters.clear()
        worker.dispatch.drop_queued(self.local_factory())
        self._publish(worker)

    def mark_failure(self, worker: LiveWorker) -> None:
        """A request failed at `worker`: as a failed health check (`fall` in a row: down)."""
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        if worker.consecutive_failures >= self.fall:
            self.mark_down(worker.id)

    def mark_up(self, wid: WorkerId) -> None:
        state = self.view.workers[wid]
        if state.healthy:
            return
        state.healthy = True
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
        view = self._refresh()
        excluded = set(exclude)
        if excluded:
            view = ClusterView(
                view.now,
                {k: v for k, v in view.workers.items() if k not in excluded},
                view.index,
                view.block_size,
                view.cost,
            )
        if not any(w.healthy for w in view.workers.values()):
            raise WorkerDown("no healthy worker")
        decision = self.policy.route(request, view)
        worker = self.workers[decision.worker]
        hashes = request.block_hashes
        # What a worker holds is prefix-closed: the blocks not new to it are its expected hit.
        added = self.approx_index.insert(hashes, worker.id, view.now)
        expected = (len(hashes) - added) * view.block_size
        # Mirror the worker's cache size (scraped from vLLM, else the configured bound), so the
        # approximate index stays bounded however long the proxy runs.
        self.approx_index.evict(worker.id, self.view.workers[worker.id].kv_capacity_blocks)
        self.policy.on_dispatch(request, worker.id, view)
        self._outstanding_tokens[request.id] = (worker.id, request.prompt_len + request.output_len)
        self.view.workers[worker.id].tokens_in_flight += request.prompt_len + request.output_len
        self.metrics.prompt_tokens.labels(worker.label).inc(request.prompt_len)
        self.metrics.estimated_hit_tokens.labels(worker.label, "approximate").inc(expected)
        if self.precise:
            hit = self.view.index.touch(hashes, worker.id, view.now) * view.block_size
            self.metrics.estimated_hit_tokens.labels(worker.label, "precise").inc(hit)
        fut: asyncio.Future[LiveWorker] = asyncio.get_running_loop().create_future()
        worker.waiters[request.id] = fut
        worker.dispatch.push(request)
        self._pump(worker)
        return worker, decision.reason, fut

    def release(self, worker: LiveWorker, request: Request, output_tokens: int) -> None:
        """`request` is done at `worker` (answered or failed); start the next one there."""
        wid, tokens = self._outstanding_tokens.pop(request.id, (worker.id, 0))
        if wid in self.view.workers:
            self.view.workers[wid].tokens_in_flight -= tokens
        worker.dispatch.done(request)
        self.view.now = self.clock()
        self.policy.on_finish(request, worker.id, self.view)
        self._pump(worker)

    def abandon(self, worker: LiveWorker, request: Request) -> None:
        """`request` was routed to `worker` but never dispatched (timed out or went elsewhere)."""
        self._forget_queued(worker, request)
        wid, tokens = self._outstanding_tokens.pop(request.id, (worker.id, 0))
        if wid in self.view.workers:
            self.view.workers[wid].tokens_in_flight -= tokens
        self.policy.on_finish(request, worker.id, self.view)

    def tokens(self, worker: LiveWorker, request: Request, n: int) -> None:
        self.policy.on_token(request, worker.id, n, self.clock())
        worker.dispatch.on_token(request, n)

    def first_token(self, worker: LiveWorker, request: Request) -> None:
        self.policy.on_first_token(request, worker.id, self.clock())

    # -------------------------------------------------------------- internals

    def _pump(self, worker: LiveWorker) -> None:
        if worker.id not in self.workers or not self.view.workers[worker.id].healthy:
            return  # removed while requests were still in flight there, or down
        for request in worker.dispatch.release(self.view.index, self.view.block_size):
            fut = worker.waiters.pop(request.id, None)
            if fut is None or fut.done():
                worker.dispatch.done(request)  # its caller gave up; nothing to run
                continue
            fut.set_result(worker)
        self._publish(worker)

    def _forget_queued(self, worker: LiveWorker, request: Request) -> None:
        if worker.waiters.pop(request.id, None) is not None:
            worker.dispatch.withdraw(request)
        self._publish(worker)

    def _refresh(self) -> ClusterView:
        view = self.view
        view.now = self.clock()
        for worker in self.workers.values():
            state = view.workers[worker.id]
            state.num_waiting = len(worker.dispatch) + int(worker.reported.get("waiting", 0))
            state.num_running = worker.dispatch.in_flight
            state.kv_used_blocks = int(
                worker.reported.get("kv_usage", 0.0) * state.kv_capacity_blocks
            )
        return view

    def _publish(self, worker: LiveWorker) -> None:
        if worker.id not in self.workers:
            return
        self.metrics.queue_depth.labels(worker.label).set(len(worker.dispatch))
        self.metrics.in_flight.labels(worker.label).set(worker.dispatch.in_flight)
        self.metrics.index_blocks.labels(worker.label, "approximate").set(
            self.approx_index.num_blocks(worker.id)
        )
        if self.precise:
            self.metrics.index_blocks.labels(worker.label, "precise").set(
                self.view.index.num_blocks(worker.id)
            )
