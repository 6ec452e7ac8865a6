"""`fairway serve --routers N`: N proxy processes on one port, kept by the parent that started them.

    fairway serve (parent) ─ workers, once (Ray) ─ redis-server (unless redis_url)
      ├─ replica 0 ─ LiveCluster (the whole policy) ─ proxy on :port (SO_REUSEPORT) + own port
      ├─ replica 1 ─ ...                                the kernel spreads new connections
      └─ ...          each syncs its Ledgers, routing decisions and pool through Redis

Each replica is a whole router: its own index, counters, load accounting and dispatch queues,
as the simulator's replicas (`simulate --routers N --router-sync S`). It adds the parent's
worker URLs in the parent's order, so worker ids (and so ledger keys) agree across replicas;
an add or a remove through the admin API of any replica goes through the store, as an event
in a log that every replica applies in the same order, ids included (SharedMembership).
Besides the shared port each replica listens on one of its own (`replica_ports`), its admin
listener (loopback by default): /metrics and the admin API answer there only, which through
the shared port would reach any one replica.

The parent restarts a replica that dies (its connections are lost with it; the others' are
not), and on SIGTERM or SIGINT stops them all (SIGTERM, the proxy's grace, then SIGKILL).
Replicas and Redis die with the parent (PR_SET_PDEATHSIG: a replica asks for it itself,
Redis through router/runtime/guard.py).

Across machines the same split would run each replica as a Ray actor behind a load balancer,
with the store reachable by all; not built: one host's SO_REUSEPORT needs no balancer.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from router.proxy.service.config import FleetWorker

if TYPE_CHECKING:
    from router.proxy.service.config import ClusterConfig

log = logging.getLogger("fairway.replicas")
REPLICA_HEADER = "X-Fairway-Replica"  # <index>-<pid> of the replica that answered


@dataclass(frozen=True)
class ReplicaSpec:
    """What one replica process is told (as JSON on its stdin: the config may hold keys)."""

    index: int
    config: dict
    model_dirs: dict[str, str]  # each model group's folder (its tokenizer)
    workers: list[FleetWorker]  # in the parent's order
    redis_url: str
    prefix: str  # this run's Redis keys
    own_port: int
    supervisor: int = 0  # the parent's pid: a replica dies with it


def replica_ports(config: ClusterConfig) -> list[int]:
    return config.admin_ports  # each replica's admin listener


def run_replicas(
    config: ClusterConfig, model_dirs: dict[str, Path], workers: list[FleetWorker], scratch: Path
) -> int:
    """Start Redis and keep it (unless the user's is configured: then check it answers), then
    keep `config.routers` replicas until stopped."""
    from router.proxy.service.store import OwnRedis, Store, forget, memory_bound

    with contextlib.ExitStack() as stack:
        own: OwnRedis | None = None
        if config.redis_url:
            store = Store.of_config(config.with_secrets(), config.redis_url)
            store.check()  # unreachable: an error naming the URL, before any replica starts
        else:
            own = OwnRedis(scratch / "redis", max_bytes=memory_bound(config.responses.max_bytes))
            store = Store(own.start())
            stack.callback(own.stop)
        prefix = f"fairway:{uuid.uuid4().hex[:12]}"
        if config.redis_url:  # a store that outlives us: leave it as we found it
            stack.callback(_forget_quietly, forget, store, prefix)
        specs = [
            ReplicaSpec(
                i,
                _config_of(config, i),
                {name: str(folder) for name, folder in model_dirs.items()},
                workers,
                store.url,
                prefix,
                port,
                os.getpid(),
            )
            for i, port in enumerate(replica_ports(config))
        ]
        return Supervisor(specs, watch=[own.poll] if own else []).run()


def _config_of(config: ClusterConfig, index: int) -> dict:
    """Replica `index`'s config: the same, but requests.csv in a folder of its own. Its
    secrets in clear (keys, the admin token, the parent's client salt): it goes on stdin."""
    raw = config.with_secrets()
    if config.record_dir:
        raw["record_dir"] = str(Path(config.record_dir) / f"replica-{index}")
    return raw


def _forget_quietly(forget, store, prefix: str) -> None:
    try:
        forget(store, prefix)
    except Exception as e:  # the store may be gone already; nothing of ours is left to keep
        log.warning("could not delete %s:* from %s: %r", prefix, store.url, e)


class Supervisor:
    """Start the replicas, restart one that dies (backing off; giving up, and stopping all, if
    it dies soon after starting more than `max_quick_deaths` times in a row), stop all on
    SIGTERM / SIGINT. Synchronous: it only waits and signals. `watch`: what else it keeps
    alive, called every `poll` seconds (the Redis it started)."""

    def __init__(
        self,
        specs: list[ReplicaSpec],
        poll: float = 0.2,
        argv: list[str] | None = None,
        watch: list[Callable[[], None]] | None = None,
    ) -> None:
        self.specs, self.poll, self.watch = specs, poll, watch or []
        self.argv = argv or [sys.executable, "-m", "router.proxy.service.replicas"]
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: dict[int, float] = {}
        self.failures: dict[int, int] = {}  # deaths in a row, each within 10 s of its start
        self.due: dict[int, float] = {}  # replica -> when to start it again
        self.restarts = 0
        self.max_quick_deaths = 5
        self.exit_code = 0
        self._stopping = False

    def run(self) -> int:
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for spec in self.specs:
                self._start(spec)
            while not self._stopping:
                time.sleep(self.poll)
                for check in self.watch:
                    check()
                for spec in self.specs:
                    self._check(spec)
        finally:
            self._stop_all()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self.exit_code

    def _stop(self, signum: int, frame: object) -> None:
        self._stopping = True

    def _start(self, spec: ReplicaSpec) -> None:
        argv = self.argv  # no guard process: a replica asks for its death signal itself
        root = str(Path(__file__).resolve().parents[3])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, start_new_session=True)
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died at once: _check sees to it
            proc.stdin.write(json.dumps(asdict(spec)).encode())
            proc.stdin.close()
        self.procs[spec.index] = proc
        self.started[spec.index] = time.monotonic()
        log.info("replica %d: pid %d, own port %d", spec.index, proc.pid, spec.own_port)

    def _check(self, spec: ReplicaSpec) -> None:
        i = spec.index
        if i in self.due:
            if time.monotonic() >= self.due[i]:
                del self.due[i]
                self.restarts += 1
                self._start(spec)
            return
        proc = self.procs[i]
        code = proc.poll()
        if code is None:
            return
        lived = time.monotonic() - self.started[i]
        self.failures[i] = self.failures.get(i, 0) + 1 if lived < 10 else 1
        if self.failures[i] > self.max_quick_deaths:  # it cannot start (a port taken, a bug)
            log.error(
                "replica %d died %d times within 10 s of starting; stopping", i, self.failures[i]
            )
            self._stopping, self.exit_code = True, 1
            return
        delay = min(30.0, 0.5 * 2 ** (self.failures[i] - 1))
        self.due[i] = time.monotonic() + delay
        log.error(
            "replica %d (pid %d) exited with %s after %.1f s; restarting in %.1f s",
            i,
            proc.pid,
            code,
            lived,
            delay,
        )

    def _stop_all(self) -> None:
        from router.proxy.service.serve import SHUTDOWN_GRACE

        for proc in self.procs.values():
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + SHUTDOWN_GRACE + 5
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


# ----------------------------------------------------------------------------- a replica


def build_replica_app(spec: ReplicaSpec) -> web.Application:
    """The proxy of one replica: the whole policy, the parent's workers in its order, and the
    task that shares counters and routing decisions through Redis."""
    from router.proxy.app import CLUSTER, create_app
    from router.proxy.conversations import responses_ctx
    from router.proxy.errors import APIError
    from router.proxy.identity import check_admin
    from router.proxy.service.budget_store import shared_budgets_ctx
    from router.proxy.service.config import validate_config
    from router.proxy.service.serve import add_workers, build_cluster, catalog_of, settings_of
    from router.proxy.service.shared_state import SHARED, shared_state_ctx
    from router.proxy.service.store import Store

    config = validate_config(spec.config, source=f"replica {spec.index}")
    cluster = build_cluster(config)
    add_workers(cluster, spec.workers)
    catalog = catalog_of(config, {name: Path(d) for name, d in spec.model_dirs.items()})
    # Its own port is its admin listener (exposure.py): /metrics and /admin/* answer there only.
    app = create_app(cluster, catalog, replace(settings_of(config), admin_port=spec.own_port))
    token = f"{spec.index}-{os.getpid()}"  # a restarted replica reads its predecessor's log

    async def tag(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[REPLICA_HEADER] = token

    async def describe(request: web.Request) -> web.Response:
        token = config.admin_token.get_secret_value() if config.admin_token else None
        try:
            check_admin(request, token)  # constant time
        except APIError as e:
            return e.response()
        return web.json_response({"index": spec.index, **app[SHARED].describe()})

    app.on_response_prepare.append(tag)
    app.router.add_get("/admin/replica", describe)
    store = Store.of_config(spec.config, spec.redis_url)
    app.cleanup_ctx.append(
        shared_state_ctx(app[CLUSTER], store, spec.prefix, token, config.router_sync)
    )
    app.cleanup_ctx.append(shared_budgets_ctx(store, spec.prefix))  # one budget per tenant
    # Responses in the store: a turn continues at any replica, on any worker.
    app.cleanup_ctx.append(responses_ctx(store, spec.prefix, config.responses.retention))
    return app


async def serve_replica(spec: ReplicaSpec) -> None:
    """Serve the replica on the shared port (SO_REUSEPORT) and on its own port until SIGTERM /
    SIGINT, then stop as `fairway serve` does (in-flight requests get the grace)."""
    from router.proxy.app import RUNNER_OPTIONS
    from router.proxy.connections import serving
    from router.proxy.forward import SETTINGS
    from router.proxy.service.serve import SHUTDOWN_GRACE

    app = build_replica_app(spec)
    host, port, own_port = spec.config["host"], spec.config["port"], spec.own_port
    listeners = [
        {"host": host, "port": port, "reuse_port": True},
        {"host": spec.config["admin_host"], "port": own_port},
    ]
    # app[SETTINGS]: the connection cap and header timeout (connections.py)
    async with serving(
        app, app[SETTINGS], listeners, shutdown_timeout=SHUTDOWN_GRACE, **RUNNER_OPTIONS
    ) as stop:
        log.info("replica %d on http://%s:%d (own port %d)", spec.index, host, port, own_port)
        await stop.wait()
        # The supervisor SIGKILLs a replica whose stop outlasts the grace; an orphan has no one
        # to, so it bounds its own stop: past the grace, every thread's stack goes to the log
        # (where it hung) and the process exits.
        faulthandler.dump_traceback_later(SHUTDOWN_GRACE + 5, exit=True)
        log.info("replica %d stopping", spec.index)


def _die_with(parent: int) -> None:
    """SIGTERM (a graceful stop) when the supervisor dies, and none of this if it is gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if parent and os.getppid() != parent:
        sys.exit("fairway replica: the supervisor is gone")


def main() -> None:
    raw = json.loads(sys.stdin.read())
    spec = ReplicaSpec(**{**raw, "workers": [FleetWorker(**w) for w in raw["workers"]]})
    _die_with(spec.supervisor)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s replica {spec.index} %(name)s %(message)s"
    )
    from router.proxy.connections import run_on_loop

    run_on_loop(serve_replica(spec), spec.config["event_loop"])  # the parent's, validated


if __name__ == "__main__":
    main()
