"""Own trouble is not a dependency's death (router/runtime/trouble.py): the classifier on the
kernel's own errors and on what libraries wrap them in, the once-per-interval log, the loop's
stalls; and the watchers that use it: Ray's GCS watch (workers/pool.py), the grace a lost GCS
gets (router/proxy/service/serve.py), the workers' health checks (router/proxy/monitor.py),
the store's sync (shared_state.py); and the descriptor budget behind the connection cap."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import queue
import resource
import socket
import threading
import time

import aiohttp
import pytest
import redis

import policies
from router.cli import build_parser
from router.cli.serve import serve_config
from router.config import RouterConfig
from router.proxy import overload
from router.proxy.driver import LiveCluster
from router.proxy.metrics import RouterMetrics
from router.proxy.monitor import Monitor
from router.proxy.service.config import validate_config
from router.proxy.service.gcs_grace import GcsGrace
from router.proxy.service.shared_state import failure_kind
from router.runtime.trouble import (
    DESCRIPTORS,
    EXECUTOR,
    LOOP_STALL,
    MEMORY,
    StallClock,
    TroubleLog,
    own_errno,
    own_trouble,
)
from workers import pool as pool_module
from workers.pool import WorkerPool

EMFILE = OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def wrapped(outer: BaseException, inner: BaseException) -> BaseException:
    """`outer` as a library raises it: `raise outer from inner`."""
    try:
        try:
            raise inner
        except BaseException as e:
            raise outer from e
    except BaseException as e:
        return e


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------------------- the classifier


class TestOwnTrouble:
    @pytest.mark.parametrize(
        "exc, cause",
        [
            (EMFILE, DESCRIPTORS),
            (OSError(errno.ENFILE, "Too many open files in system"), DESCRIPTORS),
            (OSError(errno.ENOMEM, "Cannot allocate memory"), MEMORY),
            (OSError(errno.ENOBUFS, "No buffer space available"), MEMORY),
            (MemoryError(), MEMORY),
            (asyncio.QueueFull(), EXECUTOR),
            (queue.Full(), EXECUTOR),
            (RuntimeError("can't start new thread"), EXECUTOR),
        ],
    )
    def test_what_this_process_could_not_even_try(self, exc: BaseException, cause: str) -> None:
        assert own_trouble(exc) == cause

    @pytest.mark.parametrize(
        "exc",
        [
            ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
            ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
            OSError(errno.EHOSTUNREACH, "No route to host"),
            TimeoutError("timed out"),
            asyncio.TimeoutError(),
            aiohttp.ServerDisconnectedError(),
            redis.ConnectionError("Connection closed by server."),
            RuntimeError("a bug"),
            None,
        ],
    )
    def test_what_the_dependency_did(self, exc: BaseException | None) -> None:
        assert own_trouble(exc) is None

    def test_found_through_what_libraries_wrap_it_in(self) -> None:
        store = wrapped(redis.ConnectionError("Error 24 connecting to 127.0.0.1:6379."), EMFILE)
        assert own_trouble(store) == DESCRIPTORS
        client = aiohttp.ClientOSError(errno.EMFILE, "Too many open files")
        assert own_trouble(client) == DESCRIPTORS  # aiohttp's connector errors are OSErrors
        timeout = wrapped(asyncio.TimeoutError(), client)
        assert own_trouble(timeout) == DESCRIPTORS
        assert own_errno(errno.EMFILE) == DESCRIPTORS and own_errno(errno.ECONNREFUSED) is None
        assert own_errno(None) is None

    def test_a_circle_of_causes_ends(self) -> None:
        a, b = RuntimeError("a"), RuntimeError("b")
        a.__context__, b.__context__ = b, a
        assert own_trouble(a) is None

    def test_the_kernel_s_own_emfile_through_a_socket_and_aiohttp(self) -> None:
        """The open-files limit lowered to what is open now: a socket, and an aiohttp request
        to a listener that is up, both fail as this process's own trouble."""
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        loop = asyncio.new_event_loop()
        session = loop.run_until_complete(_session())
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        held: list[socket.socket] = []
        errors: list[BaseException] = []
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
            for _ in range(64):  # bounded: the limit is reached within a few
                try:
                    held.append(socket.socket())
                except OSError as e:
                    errors.append(e)
                    break
            with contextlib.suppress(aiohttp.ClientError):
                loop.run_until_complete(_get(session, f"http://127.0.0.1:{port}/health", errors))
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            for s in held:
                s.close()
            loop.run_until_complete(session.close())
            loop.close()
            listener.close()
        assert len(errors) == 2, errors
        assert [own_trouble(e) for e in errors] == [DESCRIPTORS, DESCRIPTORS], errors


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()


async def _get(session: aiohttp.ClientSession, url: str, errors: list[BaseException]) -> None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            await r.read()
    except aiohttp.ClientError as e:
        errors.append(e)
        raise


# ----------------------------------------------------------------------------- said once


class TestTroubleLog:
    def test_said_at_once_then_once_an_interval_with_a_count(self, caplog) -> None:
        clock, counted = Clock(), []
        trouble = TroubleLog("watch", logging.getLogger("t"), 10.0, counted.append, clock)
        with caplog.at_level(logging.WARNING, "t"):
            trouble.add(DESCRIPTORS, "EMFILE")
            assert trouble.in_trouble and len(caplog.records) == 1
            assert "could not even try (descriptors: EMFILE)" in caplog.records[0].message
            for _ in range(50):
                clock.now += 0.1
                trouble.add(DESCRIPTORS, "EMFILE")
            assert len(caplog.records) == 1, "nothing more within the interval"
            clock.now += 5.1
            trouble.add(DESCRIPTORS, "EMFILE")
            assert len(caplog.records) == 2
            assert "51 more checks not made (descriptors: EMFILE), 52 in all" in (
                caplog.records[1].message
            )
            trouble.add(MEMORY, "ENOMEM")
            trouble.clear()
            assert [r.message for r in caplog.records[2:]] == [
                "watch: 1 more checks not made (memory: ENOMEM), 53 in all; none counted "
                "against what it watches",
                "watch: checking again",
            ]
            trouble.clear()  # not in trouble: says nothing
            assert len(caplog.records) == 4 and not trouble.in_trouble
        assert counted == [DESCRIPTORS] * 52 + [MEMORY]

    def test_safe_from_threads(self) -> None:
        trouble = TroubleLog("watch", logging.getLogger("t"), 3600.0)
        threads = [
            threading.Thread(target=lambda: [trouble.add(DESCRIPTORS, "x") for _ in range(500)])
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert trouble.total == 2000 and trouble.pending == 1999


class TestStallClock:
    def test_a_timeout_the_loop_s_lateness_explains(self) -> None:
        clock = Clock()
        stalls = StallClock(horizon=30.0, clock=clock)
        start = clock.now
        for _ in range(20):
            clock.now += 0.05
            stalls.observe(0.001)  # noise, not kept
        assert stalls.late_since(start) == 0.0 and not stalls.explains(start, 2.0)
        clock.now += 1.5
        stalls.observe(1.5)
        assert stalls.late_since(start) == 1.5 and stalls.explains(start, 2.0)
        assert not stalls.explains(clock.now, 2.0), "only wake-ups after the check began"
        clock.now += 31
        stalls.observe(0.0)
        assert stalls.late_since(0.0) == 0.0, "older than the horizon: dropped"


# ----------------------------------------------------------------------------- Ray's GCS


@contextlib.contextmanager
def watched_pool(port: int, **watch):
    """A WorkerPool watching a "GCS" on 127.0.0.1:port (no Ray): the calls it makes."""
    pool = WorkerPool([])
    pool._gcs = ("127.0.0.1", port)
    calls: list[str | None] = []
    pool.watch(calls.append, **watch)
    try:
        yield calls
    finally:
        pool._unwatch.set()


def wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class TestGcsWatch:
    def test_a_gcs_that_refuses_is_lost_and_found_again(self) -> None:
        gcs = socket.create_server(("127.0.0.1", 0))
        port = gcs.getsockname()[1]
        with watched_pool(port, interval=0.02, misses=3) as calls:
            time.sleep(0.1)
            assert calls == [], "it answers"
            gcs.close()
            assert wait_for(lambda: len(calls) == 1), calls
            gone = f"Ray's GCS at 127.0.0.1:{port} is gone (Connection refused, 3 tries)"
            assert calls[0] == gone
            gcs = socket.create_server(("127.0.0.1", port))  # SO_REUSEADDR: the same port
            assert wait_for(lambda: len(calls) == 2), calls
            assert calls[1] is None, "it answers again"
        gcs.close()

    def test_its_own_emfile_is_no_miss(self, monkeypatch, caplog) -> None:
        """The flood that once stopped the proxy: every try fails for want of a descriptor."""
        tries: list[float] = []

        def knock(host: str, port: int, timeout: float) -> OSError:
            tries.append(time.monotonic())
            return EMFILE

        monkeypatch.setattr(pool_module, "_knock", knock)
        with caplog.at_level(logging.WARNING, "workers.pool"):
            with watched_pool(9, interval=0.01, misses=3) as calls:
                assert wait_for(lambda: len(tries) >= 30)
            assert calls == [], "never lost"
        said = [r.message for r in caplog.records]
        assert len(said) == 1, said  # at once, then once per 10 s
        assert said[0].startswith("Ray's GCS watch (127.0.0.1:9): could not even try")

    def test_outlast_gcs_gives_ray_s_driver_the_grace(self, monkeypatch) -> None:
        monkeypatch.delenv(pool_module.GCS_RECONNECT_ENV, raising=False)
        pool_module.outlast_gcs(110.2)
        assert os.environ[pool_module.GCS_RECONNECT_ENV] == "111"
        pool_module.outlast_gcs(5)
        assert os.environ[pool_module.GCS_RECONNECT_ENV] == "60", "never shorter than Ray's own"


class TestGcsGrace:
    def test_serves_degraded_through_the_grace_then_stops(self) -> None:
        stopped: list[str] = []
        grace = GcsGrace(0.2, stopped.append)
        metrics = RouterMetrics()
        metrics.watch_degraded("ray_gcs", grace.is_degraded)
        assert grace.health_note() is None and _degraded(metrics) == 0.0
        grace("Ray's GCS at h:1 is gone (Connection refused, 3 tries)")
        note = grace.health_note()
        assert note is not None and note.startswith("Ray's GCS at h:1 is gone")
        assert "shutting down in" in note and _degraded(metrics) == 1.0
        grace("again")  # told twice: one grace
        assert wait_for(lambda: stopped, 5.0)
        time.sleep(0.3)
        assert stopped == [
            "Ray's GCS at h:1 is gone (Connection refused, 3 tries) for 0.2 s (ray_gcs_grace)"
        ]

    def test_a_gcs_that_answers_again_calls_the_stop_off(self) -> None:
        stopped: list[str] = []
        grace = GcsGrace(0.2, stopped.append)
        grace("gone")
        grace(None)
        assert not grace.is_degraded() and grace.health_note() is None
        time.sleep(0.4)
        assert stopped == []
        grace("gone again")  # a new grace, whole
        assert grace.is_degraded()
        assert wait_for(lambda: stopped, 5.0)
        assert stopped == ["gone again for 0.2 s (ray_gcs_grace)"]

    def test_with_no_worker_left_healthy_there_is_nothing_to_serve_it_through(self) -> None:
        stopped: list[str] = []
        grace = GcsGrace(60.0, stopped.append)
        grace.num_healthy = 2
        grace("gone")
        time.sleep(0.6)
        assert stopped == [], "two workers still answer: the grace runs"
        grace.num_healthy = 0  # Ray took its actors, and their servers, with the GCS
        assert wait_for(lambda: stopped, 5.0)
        assert stopped == ["gone, and no worker is left healthy to serve through the grace"]

    def test_no_grace_stops_at_once(self) -> None:
        stopped: list[str] = []
        GcsGrace(0.0, stopped.append)("gone")
        assert stopped == ["gone"]


def _degraded(metrics: RouterMetrics) -> float:
    return metrics.registry.get_sample_value("fairway_degraded", {"cause": "ray_gcs"})


class TestGraceConfig:
    def test_default_a_minute(self) -> None:
        assert validate_config({}).ray_gcs_grace == 60.0
        assert validate_config({"ray_gcs_grace": 0}).ray_gcs_grace == 0.0

    @pytest.mark.parametrize("value", [-1, -0.5, 3601])
    def test_out_of_range_is_an_error_naming_the_field(self, value: float) -> None:
        with pytest.raises(ValueError, match="ray_gcs_grace"):
            validate_config({"ray_gcs_grace": value})

    def test_the_flag(self) -> None:
        args = build_parser().parse_args(["serve", "--ray-gcs-grace", "5"])
        assert serve_config(args).ray_gcs_grace == 5.0
        args = build_parser().parse_args(["serve", "--ray-gcs-grace", "-1"])
        with pytest.raises(ValueError, match="command line: ray_gcs_grace"):
            serve_config(args)


# ----------------------------------------------------------------------------- other watchers


class RaisingSession:
    """Stands in for the monitor's aiohttp session: every request raises `error`."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def get(self, url: str, **kw):
        raise self.error


def cluster_of(n: int) -> LiveCluster:
    cluster = LiveCluster(
        policies.global_policies.create("round_robin"),
        lambda: policies.local_policies.create("fcfs"),
        RouterConfig(block_size=16),
    )
    for i in range(n):
        cluster.add_worker(f"http://127.0.0.1:9/w{i}")
    return cluster


class TestHealthChecks:
    def test_checks_it_could_not_make_never_mark_a_worker_down(self) -> None:
        async def go() -> None:
            cluster = cluster_of(2)
            monitor = Monitor(cluster, RaisingSession(aiohttp.ClientOSError(*EMFILE.args)))  # type: ignore[arg-type]
            for _ in range(5):
                await monitor.check_all()
            assert [cluster.view.workers[w].healthy for w in (0, 1)] == [True, True]
            counted = cluster.metrics.registry.get_sample_value(
                "fairway_own_trouble_total", {"watcher": "health", "cause": DESCRIPTORS}
            )
            assert counted == 10
            monitor.session = RaisingSession(aiohttp.ClientConnectionError("refused"))  # type: ignore[assignment]
            for _ in range(2):
                await monitor.check_all()
            assert [cluster.view.workers[w].healthy for w in (0, 1)] == [False, False]
            await monitor.stop()

        asyncio.run(go())

    def test_a_timeout_the_loop_stalled_through_is_not_the_worker_s(self) -> None:
        async def go() -> None:
            cluster = cluster_of(1)
            monitor = Monitor(cluster, RaisingSession(asyncio.TimeoutError()), timeout=2.0)  # type: ignore[arg-type]
            monitor.stalls.observe(1.5)  # the loop ran 1.5 s late during the check
            monitor.stalls.clock = lambda: 0.0  # ... which began before that wake-up
            for _ in range(3):
                await monitor.check_all()
            assert cluster.view.workers[0].healthy
            counted = cluster.metrics.registry.get_sample_value(
                "fairway_own_trouble_total", {"watcher": "health", "cause": LOOP_STALL}
            )
            assert counted == 3
            monitor.stalls = StallClock()  # a loop on time: the silence was the worker's
            for _ in range(2):
                await monitor.check_all()
            assert not cluster.view.workers[0].healthy
            await monitor.stop()

        asyncio.run(go())


def test_the_store_s_sync_failures_tell_own_trouble_apart() -> None:
    assert failure_kind(wrapped(redis.ConnectionError("Error 24 connecting"), EMFILE)) == "own"
    assert failure_kind(redis.ConnectionError("refused")) == "connection"
    assert failure_kind(TimeoutError()) == "timeout"


# ----------------------------------------------------------------------------- the budget


class TestDescriptorBudget:
    @pytest.mark.parametrize(
        "soft, workers, admin, public",
        [
            (300, 0, 118, 102),  # (300 - 64) // 2; the public listener 16 short of it
            (300, 2, 118, 102),
            (300, 10, 106, 90),  # reserve 48 + 4 x 10 = 88
            (20_000, 2, 9968, 9952),
            (70, 0, 3, 1),  # no room to keep: the public listener still gets one
        ],
    )
    def test_from_the_limit_as_it_is_now(
        self, monkeypatch, soft: int, workers: int, admin: int, public: int
    ) -> None:
        monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, soft))
        budget = overload.DescriptorBudget(lambda: workers)
        assert (budget.room(admin=True), budget.room(admin=False)) == (admin, public)

    def test_the_admin_listener_keeps_its_reserve(self, monkeypatch) -> None:
        limit = [300]
        monkeypatch.setattr(resource, "getrlimit", lambda _: (limit[0], limit[0]))
        budget = overload.DescriptorBudget()
        budget.num_open = 102
        assert not budget.has_room(admin=False) and budget.has_room(admin=True)
        budget.num_open = 118
        assert not budget.has_room(admin=True)
        limit[0] = 1024  # raised at run time: room again, from the next accept
        assert budget.has_room(admin=False)
