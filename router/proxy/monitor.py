"""Background watchers: the workers' health, their /metrics and KV events, and the proxy's own
event loop (how late it runs what is due: every stalled callback delays every stream).

A check the proxy could not even make (out of descriptors or memory, its loop stalled past the
check's time: router/runtime/trouble.py) says nothing about the worker: it is neither a
failure nor a success, and is logged at most once per interval with a count
(fairway_own_trouble_total), so a flood of clients cannot get the workers marked down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from router.kv_events import KVEventIndexer
from router.proxy.adapters import AdapterLoader
from router.proxy.driver import LiveCluster, LiveWorker
from router.runtime.trouble import LOOP_STALL, StallClock, TroubleLog, own_errno, own_trouble

log = logging.getLogger(__name__)

CHECKS_AT_ONCE = 8  # a round's checks start in groups this large (Monitor.check_all)

# vLLM gauge -> our key in LiveWorker.reported
REPORTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:prefix_cache_queries": "prefix_queries",
}


def _heads(names: tuple[str, ...]) -> tuple[str, ...]:
    """Where the lines of these families begin (a counter's samples as `name_total`)."""
    return tuple(
        head
        for name in names
        for family in (name, name + "_total")
        for head in (f"{family}{{", f"{family} ", f"# HELP {family} ", f"# TYPE {family} ")
    )


_GAUGE_HEADS = _heads(tuple(REPORTED))
_ALL_HEADS = _heads((*REPORTED, "vllm:cache_config_info"))


def wanted_families(text: str, with_config: bool = True) -> str:
    """The lines of a /metrics page that belong to the families the router reads (the cache
    config too, unless `with_config` is False). A vLLM page has ~90 families in ~600 lines:
    parsing it whole took 7.5 to 10 ms per worker and scrape, on the event loop that relays
    every stream; these lines parse in 0.6 ms, 0.35 ms without the config's 40 labels."""
    heads = _ALL_HEADS if with_config else _GAUGE_HEADS
    return "\n".join(line for line in text.splitlines() if line.startswith(heads))


class Monitor:
    """Health: `fall` failed checks in a row mark a worker down (its index entries dropped),
    `rise` good ones bring it back. Scrapes keep worker-reported gauges fresh."""

    def __init__(
        self,
        cluster: LiveCluster,
        session: aiohttp.ClientSession,
        interval: float = 1.0,
        timeout: float = 2.0,
        fall: int = 2,
        rise: int = 2,
        adapters: AdapterLoader | None = None,
    ) -> None:
        self.cluster, self.session = cluster, session
        self.adapters = adapters  # learns what each worker has registered (its /v1/models)
        self.interval, self.timeout, self.fall, self.rise = interval, timeout, fall, rise
        self._tasks: list[asyncio.Task] = []
        self._subscribed: dict[int, asyncio.Task] = {}
        self._warned_block_size: set[int] = set()
        self._capacity_known: set[int] = set()  # read once a server: it changes on restart
        self._zmq = zmq.asyncio.Context()
        self.stalls = StallClock()
        metrics = cluster.metrics
        self.trouble = {
            watcher: TroubleLog(what, log, counted=metrics.count_own_trouble(watcher))
            for watcher, what in (
                ("health", "workers' health checks"),
                ("metrics", "workers' /metrics scrapes"),
                ("kv_events", "workers' KV-event subscriptions"),
            )
        }

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._loop(), name="fairway-monitor"))
        lag = self.cluster.metrics.loop_lag

        def observe(lateness: float) -> None:
            lag.observe(lateness)
            self.stalls.observe(lateness)

        self._tasks.append(asyncio.create_task(sample_loop_lag(observe), name="fairway-lag"))

    async def stop(self) -> None:
        for task in [*self._tasks, *self._subscribed.values()]:
            task.cancel()
        for task in [*self._tasks, *self._subscribed.values()]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._zmq.term()

    async def _loop(self) -> None:
        # Nothing a worker answers (or a bug in handling it) may end this loop: without it a
        # worker marked down would never come back.
        while True:
            try:
                await self.check_all(spread=self.interval)
            except Exception:
                log.exception("health round failed; next one in %.1f s", self.interval)
                await asyncio.sleep(self.interval)

    async def check_all(self, spread: float = 0.0) -> None:
        """One round: KV-event subscriptions, then every worker's health and gauges. With
        `spread`, the checks start `CHECKS_AT_ONCE` at a time, evenly over that many seconds,
        and the round lasts as long. Checks started together answer together: handling 256
        answers held the event loop (every stream waiting) for about 100 ms in one piece
        (`fairway bench-proxy`); started one by one, each check cost twice the CPU."""
        workers = list(self.cluster.workers.values())
        for wid in [wid for wid in self._subscribed if wid not in self.cluster.workers]:
            self._subscribed.pop(wid).cancel()  # removed: stop listening for its events
        for w in workers:
            if self.cluster.precise and w.kv_events and w.id not in self._subscribed:
                self._subscribed[w.id] = asyncio.create_task(self._subscribe(w))
        groups = [workers[i : i + CHECKS_AT_ONCE] for i in range(0, len(workers), CHECKS_AT_ONCE)]
        checks = []
        for group in groups or [[]]:  # no worker yet: the round still lasts `spread`
            checks += [asyncio.create_task(self.check(w)) for w in group]
            if spread:
                await self._pause(spread / max(len(groups), 1))
        await asyncio.gather(*checks)

    async def _pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def check(self, worker: LiveWorker) -> None:
        ok = await self._healthy(worker)
        if ok:
            try:
                await self._scrape(worker)
                if self.adapters is not None and self.adapters.paths:
                    await self._registered(worker, self.adapters)
            except Exception as e:  # gauges only: a bad scrape is not a failed health check
                if (cause := own_trouble(e)) is not None:
                    self.trouble["metrics"].add(cause, f"worker {worker.id}: {e!r}")
                else:
                    log.debug("worker %s: /metrics scrape failed: %r", worker.id, e)
        if ok is None or worker.id not in self.cluster.workers:
            return  # not checked: the worker stays as it was
        try:
            if ok:
                worker.consecutive_failures = 0
                worker.consecutive_successes += 1
                if worker.consecutive_successes >= self.rise:
                    self.cluster.mark_up(worker.id)
            else:
                self._capacity_known.discard(worker.id)  # it may come back restarted
                if self.adapters is not None:
                    self.adapters.forget(worker.id)  # restarted, it has registered none
                worker.consecutive_successes = 0
                worker.consecutive_failures += 1
                if worker.consecutive_failures >= self.fall:
                    self.cluster.mark_down(worker.id)
        except Exception:
            log.exception("worker %s: marking it %s failed", worker.id, "up" if ok else "down")

    async def _healthy(self, worker: LiveWorker) -> bool | None:
        """GET /health answered 200 within `timeout` (a stopped worker does not answer); None
        when this process could not even ask, or its loop stalled for most of the wait."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        begun = self.stalls.clock()
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout)
            async with self.session.get(f"{worker.url}/health", timeout=timeout) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            cause = own_trouble(e)
            if cause is None and isinstance(e, asyncio.TimeoutError):
                overshoot = max(0.0, loop.time() - start - self.timeout)  # the timeout came late
                stalled = self.stalls.late_since(begun) + overshoot >= self.timeout / 2
                cause = LOOP_STALL if stalled else None
            if cause is None:
                return False
            self.trouble["health"].add(cause, f"worker {worker.id}: {e!r}")
            return None
        self.trouble["health"].clear()
        return ok

    async def _registered(self, worker: LiveWorker, adapters: AdapterLoader) -> None:
        """The adapters the worker lists: entries of /v1/models with a parent."""
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with self.session.get(f"{worker.url}/v1/models", timeout=timeout) as resp:
            if resp.status != 200:
                return
            cards = (await resp.json()).get("data") or []
        names = {c["id"] for c in cards if isinstance(c, dict) and c.get("parent") is not None}
        adapters.learn(worker.id, names)

    async def _scrape(self, worker: LiveWorker) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with self.session.get(f"{worker.url}/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                return
            text = await resp.text()
        values: dict[str, float] = {}
        with_config = worker.id not in self._capacity_known
        for family in text_string_to_metric_families(wanted_families(text, with_config)):
            if family.name == "vllm:cache_config_info":
                self._capacity(worker, family.samples)
                continue
            key = REPORTED.get(family.name)
            if key is None:
                continue
            for sample in family.samples:
                if sample.name in (family.name, family.name + "_total"):
                    values[key] = values.get(key, 0.0) + sample.value
        worker.reported.update(values)
        self.cluster.report_gauges(worker)
        queries = values.get("prefix_queries")
        if queries:
            rate = values.get("prefix_hits", 0.0) / queries
            self.cluster.metrics.reported_hit_rate.labels(worker.label).set(rate)

    def _capacity(self, worker: LiveWorker, samples: list) -> None:
        found = kv_cache_blocks(samples)
        state = self.cluster.view.workers.get(worker.id)
        if found is None or state is None:
            return
        blocks, size = found
        self._capacity_known.add(worker.id)
        ours = self.cluster.view.block_size
        if size != ours and worker.id not in self._warned_block_size:
            self._warned_block_size.add(worker.id)
            log.warning(
                "worker %s caches %d-token blocks, the router hashes %d-token ones: "
                "predictions of its prefix hits are off (set block_size to %d)",
                worker.id,
                size,
                ours,
                size,
            )
        # The index counts blocks of the router's size; the worker's are another size.
        self.cluster.router.report(worker.id, kv_capacity_blocks=blocks * size // ours)

    async def _subscribe(self, worker: LiveWorker) -> None:
        # The KV-event index, not `view.index`: that is whatever routing uses now, and after a
        # fallback (router.drift) a worker added or resubscribed would feed the approximate
        # or the load-only index, and the precise one, scored for recovery, never hear it.
        router = self.cluster.router
        view = self.cluster.view
        indexer = KVEventIndexer(
            router.indexes.held,
            worker.id,
            view.block_size,
            changed=view.changed,
            model=worker.model,
        )
        trouble = self.trouble["kv_events"]
        socket = None
        try:
            socket = self._zmq.socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(worker.kv_events)  # type: ignore[arg-type]
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            trouble.clear()
            while True:
                parts = await socket.recv_multipart()
                state = self.cluster.view.workers.get(worker.id)
                if state is None:
                    return
                if state.healthy:
                    try:
                        indexer.feed(parts, self.cluster.clock())
                    except Exception:  # one bad message costs its blocks, not the subscription
                        log.exception("worker %s: a KV event batch failed", worker.id)
        except zmq.ZMQError as e:
            if (cause := own_errno(e.errno)) is not None:
                trouble.add(cause, f"worker {worker.id}: {e}")
            else:
                log.warning("worker %s: KV events at %s: %s", worker.id, worker.kv_events, e)
        finally:
            if socket is not None:
                socket.close()
            if self._subscribed.get(worker.id) is asyncio.current_task():
                del self._subscribed[worker.id]  # the next round subscribes again


def kv_cache_blocks(samples: list) -> tuple[int, int] | None:
    """(blocks, tokens per block) of a vLLM worker's KV cache, from the labels of its
    `vllm:cache_config_info` samples; None when they do not say."""
    for sample in samples:
        blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
        if blocks and blocks.isdigit() and size and size.isdigit():
            return int(blocks), int(size)
    return None


async def sample_loop_lag(observe: Callable[[float], None], period: float = 0.05) -> None:
    """Sleep `period` again and again and observe how much later than asked each wake-up came:
    the time anything ready to run (a stream's next chunk) waited behind other work."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(period)
        observe(max(0.0, loop.time() - start - period))
