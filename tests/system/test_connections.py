"""Connection hygiene against a real proxy (`fairway serve`, its own process) on 127.0.0.1, in
front of an emulated worker: slow request heads and bodies, the connection cap, heads over the
parser's limits, and the open-files limit (the proxy started under a small RLIMIT_NOFILE).

Every client here is bounded in count (at most HALF_SENT connections) and time, and talks only
to 127.0.0.1. Every refusal is checked from its bytes: an OpenAI-shaped error, then a close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from router.proxy.ports import free_ports
from router.runtime.processes import stop, wait_healthy
from tests.live_helpers import ROOT, tokenizer_dir
from workers.emulated.cli import emulated_command

HEADER_TIMEOUT = 1.0  # the capped proxy's (the default is 10 s)
BODY_TIMEOUT = 1.0
CAP = 20  # the capped proxy's limits.max_connections
NOFILE = 300  # the open-files limit of the proxies under test at the fd limit
HALF_SENT = 400  # connections that send half a head and wait: more than NOFILE
LOG_BOUND = 64 * 1024  # the most log a proxy may write while held at its fd limit


@dataclass
class Proxy:
    url: str
    log: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _limit_open_files(soft: int, hard: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return preexec


@contextlib.contextmanager
def fairway_serve(
    scratch: Path, worker: str, name: str, extra: str = "", nofile: tuple[int, int] | None = None
) -> Iterator[Proxy]:
    """`fairway serve` in front of `worker`, its log in scratch/name.log; stopped on exit."""
    port, admin = free_ports(2)
    config = scratch / f"{name}.yaml"
    config.write_text(
        f"model: {tokenizer_dir()}\npolicy: {{name: round_robin}}\nhealth_interval: 0.2\n"
        f"port: {port}\nadmin_port: {admin}\nworkers: {{urls: [{worker}]}}\n{extra}"
    )
    log = scratch / f"{name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(config)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
        preexec_fn=_limit_open_files(*nofile) if nofile else None,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=60)
        yield Proxy(url, log)
    finally:
        stop(proc, 10.0)


@pytest.fixture(scope="module")
def scratch():
    path = Path(tempfile.mkdtemp(prefix="fairway-connections-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def worker(scratch: Path):
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        emulated_command(port, tokenizer_dir(), speed=50),
        stdout=(scratch / "worker.log").open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=60)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def capped(scratch: Path, worker: str):
    extra = (
        f"timeouts: {{header: {HEADER_TIMEOUT}, body: {BODY_TIMEOUT}}}\n"
        f"limits: {{max_connections: {CAP}}}\n"
    )
    with fairway_serve(scratch, worker, "capped", extra) as proxy:
        yield proxy


# ----------------------------------------------------------------------------- helpers


@dataclass
class Answer:
    status: int
    headers: str
    body: bytes
    seconds: float  # from the first byte sent until the answer's first byte
    closed: bool  # the proxy closed the connection after answering

    def error(self) -> dict:
        """The OpenAI error in the answer, checked for its shape."""
        assert "application/json" in self.headers.lower(), self.headers
        error = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return error


def parse(raw: bytes, seconds: float | None, closed: bool) -> Answer:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1."), raw[:200]
    length = re.search(rb"(?i)content-length: (\d+)", head)
    if length:
        body = body[: int(length.group(1))]
    assert seconds is not None, "an answer came"
    return Answer(int(head.split()[1]), head.decode(errors="replace"), body, seconds, closed)


async def exchange(
    port: int, pieces: list[bytes], every: float = 0.0, wait: float = 10.0
) -> Answer:
    """Send `pieces` `every` s apart (all of them, or until the proxy answers), then read until
    the proxy closes (or resets: bytes sent after its close) or `wait` s pass."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start, first, raw = time.monotonic(), None, b""

    async def send() -> None:
        for i, piece in enumerate(pieces):
            if i and every:
                await asyncio.sleep(every)
            writer.write(piece)
            await writer.drain()

    sender = asyncio.create_task(send())
    closed = False
    try:
        async with asyncio.timeout(wait):
            while not _is_whole(raw) and (chunk := await reader.read(65536)):
                first = first or time.monotonic() - start
                raw += chunk
        async with asyncio.timeout(0.5):  # a close comes right after the answer, or not at all
            closed = not await reader.read(65536)
    except ConnectionError:
        closed = True
    except TimeoutError:
        pass
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sender
        writer.close()
    return parse(raw, first, closed)


def _is_whole(raw: bytes) -> bool:
    head, sep, body = raw.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: (\d+)", head)
    return bool(sep and length and len(body) >= int(length.group(1)))


def get(path: str = "/health") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def completion_request(body: bytes = b"", length: int | None = None) -> bytes:
    length = len(body) if length is None else length
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {length}\r\n\r\n".encode()
        + body
    )


COMPLETION = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()


def ask(proxy: Proxy, request: bytes, timeout: float = 5.0) -> Answer:
    """One request on a fresh connection, as a health checker or a client would send it."""
    return asyncio.run(exchange(proxy.port, [request], wait=timeout))


def assert_busy(answer: Answer) -> None:
    assert answer.status == 503, (answer.status, answer.body[:200])
    assert answer.error()["code"] == "too_many_connections"
    assert answer.seconds < 2.0, f"answered after {answer.seconds:.2f} s"


# ----------------------------------------------------------------------------- request heads


class TestSlowHeads:
    def test_heads_sent_a_line_at_a_time_are_cut_off(self, capped: Proxy) -> None:
        """Connections (all but five of the cap) each send a header line every 0.25 s, forever:
        each gets a 408 and is closed once HEADER_TIMEOUT has passed; /health answers all the
        while."""

        async def go() -> tuple[list[Answer], list[Answer]]:
            head = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"]
            lines = head + [f"X-Slow-{i}: a\r\n".encode() for i in range(40)]
            slow = [exchange(capped.port, lines, every=0.25) for _ in range(CAP - 5)]

            async def health() -> list[Answer]:
                answers = []
                for _ in range(5):
                    await asyncio.sleep(0.3)
                    answers.append(await exchange(capped.port, [get()], wait=2))
                return answers

            *answers, checks = await asyncio.gather(*slow, health())
            return answers, checks

        answers, checks = asyncio.run(go())
        for a in answers:
            assert a.status == 408 and a.error()["code"] == "header_timeout", a
            assert a.closed, "closed after the 408"
            assert HEADER_TIMEOUT - 0.05 < a.seconds < HEADER_TIMEOUT + 1.5, a.seconds
        assert [c.status for c in checks] == [200] * 5, checks

    def test_the_deadline_runs_from_each_request_s_first_byte(self, capped: Proxy) -> None:
        """On a keep-alive connection, idle time between requests is not the head's: a request
        after 2.5 x HEADER_TIMEOUT idle is answered; a head then sent slowly is cut off
        HEADER_TIMEOUT after its own first byte."""

        async def go() -> tuple[int, int, float, bytes]:
            reader, writer = await asyncio.open_connection("127.0.0.1", capped.port)
            try:
                statuses = []
                for pause in (0.0, 2.5 * HEADER_TIMEOUT):
                    await asyncio.sleep(pause)
                    writer.write(get())
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
                    await reader.readexactly(length)
                    statuses.append(int(head.split()[1]))
                await asyncio.sleep(2 * HEADER_TIMEOUT)
                start = time.monotonic()
                writer.write(b"GET /health HTTP/1.1\r\n")
                rest = await asyncio.wait_for(reader.read(), 5)
                return statuses[0], statuses[1], time.monotonic() - start, rest
            finally:
                writer.close()

        first, second, seconds, rest = asyncio.run(go())
        assert (first, second) == (200, 200)
        assert rest.startswith(b"HTTP/1.1 408"), rest[:100]
        assert HEADER_TIMEOUT - 0.05 < seconds < HEADER_TIMEOUT + 1.0, seconds


class TestOversizedHeads:
    @pytest.mark.parametrize(
        "name, pieces",
        [
            ("header_70kb", [b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"]),
            ("url_70kb", [b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"]),
            ("headers_130", [b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 130 + b"\r\n"]),
            # 6 KB lines, each under the 8 KB limit, 150 KB in all: sent in pieces of five, so
            # the head is still arriving when it passes 128 KiB (and well within the header
            # timeout on a loaded machine: 26 pieces of one line took over 1 s there).
            (
                "head_150kb",
                [b"GET /health HTTP/1.1\r\n"] + [(b"X-L: " + b"a" * 6000 + b"\r\n") * 5] * 5,
            ),
        ],
    )
    def test_431_in_the_openai_shape(self, capped: Proxy, name: str, pieces: list[bytes]) -> None:
        answer = asyncio.run(exchange(capped.port, pieces, every=0.01))
        assert answer.status == 431, (answer.status, answer.body[:200])
        assert answer.error()["code"] == "header_too_large"
        assert answer.closed

    @pytest.mark.parametrize(
        "raw", [b"HELLO WORLD\r\n\r\n", b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n"]
    )
    def test_garbage_gets_a_400_in_the_openai_shape(self, capped: Proxy, raw: bytes) -> None:
        answer = asyncio.run(exchange(capped.port, [raw]))
        assert answer.status == 400 and answer.closed, answer
        answer.error()

    def test_none_of_it_logs_a_traceback(self, capped: Proxy) -> None:
        assert "Traceback" not in capped.log_text()


# ----------------------------------------------------------------------------- request bodies


class TestSlowBodies:
    def test_a_body_trickled_in_is_cut_off_at_the_body_deadline(self, capped: Proxy) -> None:
        """A byte every 0.2 s keeps the body arriving but never done: 408 at BODY_TIMEOUT,
        however recently the last byte came. (aiohttp then reads what else comes for up to
        10 s before it closes, so the client can read the answer.)"""
        pieces = [completion_request(length=len(COMPLETION))] + [bytes([b]) for b in COMPLETION]
        answer = asyncio.run(exchange(capped.port, pieces, every=0.2))
        assert answer.status == 408 and answer.error()["code"] == "body_timeout", answer
        assert BODY_TIMEOUT - 0.05 < answer.seconds < BODY_TIMEOUT + 1.5, answer.seconds


# ----------------------------------------------------------------------------- the cap


class TestConnectionCap:
    def test_past_the_cap_a_503_then_close_and_back_once_connections_go(
        self, capped: Proxy
    ) -> None:
        held: list[socket.socket] = []
        try:
            for _ in range(CAP):  # keep-alive connections, idle after one answered request
                s = socket.create_connection(("127.0.0.1", capped.port), timeout=5)
                s.sendall(get())
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
                held.append(s)
            for path in ("/health", "/v1/models"):
                assert_busy(ask(capped, get(path)))
            busy = ask(capped, completion_request(COMPLETION))
            assert_busy(busy)
            assert "retry-after: 1" in busy.headers.lower() and busy.closed
            for s in held[: CAP // 2]:
                s.close()
            del held[: CAP // 2]
            deadline = time.monotonic() + 5
            while (answer := ask(capped, get())).status != 200:
                assert time.monotonic() < deadline, answer
                time.sleep(0.05)
            assert ask(capped, completion_request(COMPLETION)).status == 200
        finally:
            for s in held:
                s.close()
        time.sleep(1.2)  # the refusals' count is logged once a second
        assert re.search(r"refused \d+ connections in the last second", capped.log_text())


# ----------------------------------------------------------------------------- the fd limit


def hold_half_sent(port: int, n: int) -> list[socket.socket]:
    """`n` connections that each send half a request head, then nothing (fewer if connecting
    fails three times running: the listen queue full)."""
    held: list[socket.socket] = []
    failures = 0
    while len(held) < n and failures < 3:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
            failures = 0
        except OSError:
            failures += 1
    return held


def log_since(proxy: Proxy, offset: int) -> str:
    return proxy.log.read_bytes()[offset:].decode(errors="replace")


def check_at_the_fd_limit(proxy: Proxy, counted: str) -> None:
    """With HALF_SENT half-sent connections held: /health answers (503, at once), the log
    stays small with a counted line and no traceback; then, the connections gone, /health is
    healthy again and a completion is answered."""
    before = proxy.log.stat().st_size
    held = hold_half_sent(proxy.port, HALF_SENT)
    try:
        assert len(held) > NOFILE, f"only {len(held)} connections held"
        for _ in range(3):
            answer = ask(proxy, get(), timeout=3)
            assert answer.status in (200, 503), answer
            assert answer.seconds < 2.0, f"/health took {answer.seconds:.2f} s"
            body = json.loads(answer.body)  # the proxy's refusal, or /health's own answer
            assert "healthy_workers" in body or answer.error()["code"] == "too_many_connections"
            time.sleep(1)
        text = log_since(proxy, before)
        assert "Traceback" not in text, text[:2000]
        assert proxy.log.stat().st_size - before < LOG_BOUND
        assert re.search(counted, text), text[-2000:]
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while (answer := ask(proxy, get())).status != 200:
        assert time.monotonic() < deadline, answer
        time.sleep(0.2)
    assert ask(proxy, completion_request(COMPLETION)).status == 200
    assert "Traceback" not in log_since(proxy, before)


class TestAtTheOpenFilesLimit:
    def test_the_default_cap_stays_inside_the_limit(self, scratch: Path, worker: str) -> None:
        """Unset, the cap is what RLIMIT_NOFILE leaves room for: (300 - 64) // 2."""
        with fairway_serve(scratch, worker, "fd-default", nofile=(NOFILE, NOFILE)) as proxy:
            text = proxy.log_text()
            assert f"soft limit {NOFILE} (was {NOFILE}), hard limit {NOFILE}" in text
            assert "at most 118 connections" in text
            check_at_the_fd_limit(proxy, r"refused \d+ connections in the last second")

    def test_a_cap_above_the_limit_meets_it_and_survives(self, scratch: Path, worker: str) -> None:
        """max_connections over what the limit allows, on asyncio's own loop: accept() itself
        fails (EMFILE) and is answered on a spare descriptor. Also: `fairway serve` raises its
        soft limit (200) to the hard one (300)."""
        extra = "limits: {max_connections: 1000}\nevent_loop: asyncio\n"
        with fairway_serve(scratch, worker, "fd-over", extra, nofile=(200, NOFILE)) as proxy:
            text = proxy.log_text()
            assert f"soft limit {NOFILE} (was 200), hard limit {NOFILE}" in text
            assert "more than the open-files limit leaves room for" in text
            check_at_the_fd_limit(proxy, r"accept failed \d+ times in the last second")

    def test_on_uvloop_a_cap_above_the_limit_comes_down_to_it(
        self, scratch: Path, worker: str
    ) -> None:
        """uvloop (the default) drops a connection whose accept() fails unanswered, so the cap
        comes down to what the limit leaves room for, and past it is a 503 as usual."""
        extra = "limits: {max_connections: 1000}\n"
        with fairway_serve(scratch, worker, "fd-over-uv", extra, nofile=(NOFILE, NOFILE)) as proxy:
            text = proxy.log_text()
            assert "more than the open-files limit leaves room for (118): capped at 118" in text
            assert "at most 118 connections" in text
            check_at_the_fd_limit(proxy, r"refused \d+ connections in the last second")
