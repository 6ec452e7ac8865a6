"""Starting proxies and workers inside a test, on free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from openai import AsyncOpenAI

from router.proxy.app import RUNNER_OPTIONS, create_app
from router.proxy.connections import ProxySite
from router.proxy.driver import LiveCluster
from router.proxy.forward import SETTINGS
from router.proxy.ports import free_port, free_ports
from router.proxy.prompts import PromptEncoder
from router.proxy.service.config import ClusterConfig
from router.proxy.service.serve import build_cluster
from router.proxy.settings import ProxySettings
from router.runtime.processes import process, wait_healthy, wait_healthy_async
from traces.load import LoadResult
from workers.emulated.app import create_app as create_emulated_app
from workers.emulated.cli import emulated_command
from workers.launch import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "build" / "tiny-tokenizer"
BLOCK = 128


@contextlib.contextmanager
def fairway_serve(config: dict, scratch: Path, timeout: float = 300.0) -> Iterator[str]:
    """`fairway serve` in a process of its own on `config` (a cluster.yaml, written as JSON
    in `scratch`, its log beside it); yields the proxy's URL once it is healthy."""
    path = scratch / "cluster.yaml"
    path.write_text(json.dumps(config))
    argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(path)]
    with process(argv, None, scratch / "serve.log", {"PYTHONPATH": str(ROOT)}):
        url = f"http://127.0.0.1:{config['port']}"
        wait_healthy(url, timeout)
        yield url


def fairway_run(argv: list[str], timeout: float = 300.0) -> subprocess.CompletedProcess:
    """`fairway ARGV` in a process of its own, as a user runs it (a process joins one Ray
    cluster in its life, so a test that joins its own must not do so in pytest's)."""
    return python_run(["-m", "router.cli", *argv], timeout)


def python_run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """This Python on `args` in a process of its own, run from the repository; its output."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tokenizer_dir() -> Path:
    return ensure_tiny_model(TOKENIZER_DIR, weights=False)


class ProxyURL(str):
    """A proxy's public base URL; `.admin` is its admin listener's (/metrics, /admin/*).
    (A str subclass: yaml.safe_dump refuses it; pass str(url) to a config.)"""

    admin: str

    def __new__(cls, url: str, admin: str) -> ProxyURL:
        self = super().__new__(cls, url)
        self.admin = admin
        return self


@contextlib.asynccontextmanager
async def serving(
    app: web.Application, port: int = 0, admin_port: int | None = None
) -> AsyncIterator[str]:
    """`app` on 127.0.0.1:`port` (0: any free one), and on `admin_port` too if given."""
    runner = web.AppRunner(app, access_log=None, **RUNNER_OPTIONS)
    await runner.setup()
    site = _site(runner, port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if admin_port is not None:
        await _site(runner, admin_port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _site(runner: web.AppRunner, port: int) -> web.BaseSite:
    """A proxy's listener as `fairway serve` has it (connections.py); a worker's, aiohttp's."""
    settings = runner.app.get(SETTINGS)
    if settings is None:
        return web.TCPSite(runner, "127.0.0.1", port)
    return ProxySite(runner, settings, "127.0.0.1", port)


@contextlib.asynccontextmanager
async def emulated_workers(n: int, speed: float = 1.0, **kw) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(
            serving(create_emulated_app(tokenizer_dir(), "tiny", BLOCK, speed=speed, **kw)))
            for _ in range(n)]  # fmt: skip
        yield urls


@contextlib.asynccontextmanager
async def proxy(
    worker_urls: list[str],
    policy: str = "round_robin",
    window: int = 8,
    kv_events: list[str] | None = None,  # the workers' KV-event endpoints: a precise index
    config: dict | None = None,  # more cluster.yaml fields (classes, admission_control, ...)
    roles: list[str] | None = None,  # a split fleet's (router.traits.Role), one per url
    kv_shape: str = "handshake",  # its KV connectors' (router/proxy/split.py)
    **settings,
) -> AsyncIterator[tuple[ProxyURL, LiveCluster]]:
    """An in-process proxy in front of `worker_urls`: (its URL, whose `.admin` serves /metrics
    and /admin/*, and its cluster)."""
    mode = "precise" if kv_events else "approximate"
    config = ClusterConfig(
        policy={"name": policy},
        window=window,
        block_size=BLOCK,
        index_mode=mode,
        **(config or {}),
    )
    cluster = build_cluster(config)
    events_of = kv_events or [None] * len(worker_urls)
    roles = roles or ["mixed"] * len(worker_urls)
    for url, events, role in zip(worker_urls, events_of, roles, strict=True):
        cluster.add_worker(url, events, role=role, kv_shape=kv_shape)
    settings.setdefault("trust_client_headers", True)  # tests name clients as a gateway would
    settings.setdefault("health_interval", 0.2)
    settings.setdefault("admin_port", free_port())
    s = ProxySettings(model_name="tiny", policy_name=policy, **settings)
    app = create_app(cluster, PromptEncoder(tokenizer_dir(), BLOCK), s)
    async with serving(app, admin_port=s.admin_port) as url:
        yield ProxyURL(url, f"http://127.0.0.1:{s.admin_port}"), cluster


def client(base: str, **kw) -> AsyncOpenAI:
    """The OpenAI client as a user would point it at the proxy (no client-side retries)."""
    return AsyncOpenAI(base_url=f"{base}/v1", api_key="test-key-1234", max_retries=0, **kw)


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 120.0) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), timeout))


async def eventually(condition, tries: int = 250) -> bool:
    """Poll `condition` every 20 ms, at most `tries` times; its last value."""
    for _ in range(tries):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return condition()


# ------------------------------------------------------------ processes to hurt on purpose


@dataclass
class ServerProc:
    """An emulated vLLM server in a process of its own (so it can be killed or stopped)."""

    url: str
    proc: subprocess.Popen

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)


@contextlib.asynccontextmanager
async def emulated_processes(
    n: int, speed: float = 1.0, extra_args: list[list[str]] | None = None
) -> AsyncIterator[list[ServerProc]]:
    """`n` emulated servers, each in a session of its own (server i with `extra_args[i]` on
    its command line); all stopped (woken first, if stopped) and reaped on exit."""
    servers = []
    try:
        for i in range(n):
            port = free_port()
            argv = emulated_command(port, tokenizer_dir(), "tiny", BLOCK, speed=speed)
            argv += extra_args[i] if extra_args else []
            quiet = subprocess.DEVNULL
            proc = subprocess.Popen(
                argv, cwd=ROOT, start_new_session=True, stdout=quiet, stderr=quiet
            )
            servers.append(ServerProc(f"http://127.0.0.1:{port}", proc))
        await asyncio.gather(*(wait_healthy_async(s.url) for s in servers))
        yield servers
    finally:
        for s in servers:
            s.signal(signal.SIGCONT)
            s.signal(signal.SIGTERM)
        for s in servers:
            try:
                await asyncio.to_thread(s.proc.wait, 10)
            except subprocess.TimeoutExpired:
                s.signal(signal.SIGKILL)
                s.proc.wait()


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (/proc), zombies included."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[3]) == sid:
                pids.append(int(stat.parent.name))
    return pids


def process_args(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@dataclass
class RayHead:
    """A Ray head this test started, on free loopback ports, in a session of its own."""

    address: str
    proc: subprocess.Popen  # `ray start --head --block`: the parent of the head's processes
    temp_dir: Path

    def pids(self) -> list[int]:
        return [p for p in session_pids(self.proc.pid) if p != self.proc.pid]

    def gcs_pid(self) -> int:
        found = [p for p in self.pids() if "gcs_server" in process_args(p)]
        assert found, "the head has a GCS process"
        return found[0]


@contextlib.contextmanager
def ray_head(temp_dir: Path) -> Iterator[RayHead]:
    """Start a Ray head of the test's own and stop exactly it: its `ray start` process is
    told to stop, and anything left in its session is killed by pid. Never `ray stop`, which
    stops every Ray cluster on the host."""
    cli = str(Path(sys.executable).with_name("ray"))
    port, dashboard, agent, metrics = free_ports(4)
    argv = [
        cli, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp_dir}", "--num-cpus=2", "--include-dashboard=false",
        "--disable-usage-stats", f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}",
    ]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    temp_dir.mkdir(parents=True, exist_ok=True)
    log = open(temp_dir / "ray-start.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    head = RayHead(f"127.0.0.1:{port}", proc, temp_dir)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            assert proc.poll() is None, f"ray start exited: see {log.name}"
            assert time.monotonic() < deadline, "the Ray head did not come up in 60 s"
            time.sleep(0.1)
        yield head
    finally:
        proc.send_signal(signal.SIGTERM)  # ray start --block stops its processes on SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        for pid in session_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        log.close()


def assert_every_request_ended(result: LoadResult, sent: int | None = None) -> None:
    """Count in == count out, and none lost: each ended complete or with a clean error."""
    if sent is not None:
        assert len(result.outcomes) == sent, f"sent {sent}, {len(result.outcomes)} ended"
    lost = result.lost
    details = Counter(o.detail for o in lost).most_common(5)
    assert not lost, f"{result.summary()}; lost: {details}"


# ------------------------------------------------------------------ split prefill and decode


@contextlib.asynccontextmanager
async def emulated_split_workers(
    roles: list[str], speed: float = 1.0, **kw
) -> AsyncIterator[list[tuple[str, web.Application]]]:
    """Emulated servers of these roles in this process, server i on GPU i of one network (a
    `topology` in `kw`); yields each one's URL and app (its connector's `received`, under
    workers/emulated/state.py's CONNECTOR: what it was sent)."""
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for i, role in enumerate(roles):
            app = create_emulated_app(tokenizer_dir(), "tiny", BLOCK, speed=speed, role=role,
                                      topology_gpu=i, topology_gpus=len(roles), **kw)  # fmt: skip
            out.append((await stack.enter_async_context(serving(app)), app))
        yield out


@contextlib.asynccontextmanager
async def split_proxy(
    workers: list[tuple[str, str]], kv_shape: str = "handshake", **kw
) -> AsyncIterator[tuple[ProxyURL, LiveCluster]]:
    """`proxy` in front of (url, role) workers whose KV connectors have `kv_shape`."""
    urls, roles = [u for u, _ in workers], [r for _, r in workers]
    async with proxy(urls, roles=roles, kv_shape=kv_shape, **kw) as (url, cluster):
        yield url, cluster


@contextlib.asynccontextmanager
async def emulated_role_processes(
    roles: list[str], speed: float = 1.0, topology: str = "dgx-h100"
) -> AsyncIterator[list[ServerProc]]:
    """`emulated_processes` of these roles (handshake connectors), server i on GPU i of
    `topology`."""
    args = [["--role", role, "--topology", topology, "--topology-gpu", str(i),
             "--topology-gpus", str(len(roles))] for i, role in enumerate(roles)]  # fmt: skip
    async with emulated_processes(len(roles), speed, args) as servers:
        yield servers


def anthropic_prompt_tokens(usage) -> int:
    """The whole prompt of an Anthropic usage: input_tokens leaves out what was read from the
    cache and what was written to it."""
    return (
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )
