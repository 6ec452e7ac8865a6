"""Local processes (router.runtime.processes): waiting for a server to answer /health, with or
without an event loop around the wait, and stopping processes."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from router.runtime.processes import stop_all, wait_healthy, wait_healthy_async


@contextlib.contextmanager
def server_healthy_after(num_refusals: int) -> Iterator[str]:
    """A loopback server whose /health answers 503 `num_refusals` times, then 200."""
    asked = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200 if len(asked) > num_refusals else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert set(asked) <= {"/health"}, asked


def test_returns_once_healthy() -> None:
    with server_healthy_after(2) as url:
        wait_healthy(url, timeout=10)


def test_a_silent_server_times_out() -> None:
    with server_healthy_after(10**6) as url:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="not healthy after 0.5 s"):
            wait_healthy(url, timeout=0.5)
        assert time.monotonic() - started < 5


def test_the_async_wait_leaves_the_loop_running() -> None:
    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            for _ in range(1000):  # bounded; cancelled once the wait is over
                ticks += 1
                await asyncio.sleep(0.01)

        with server_healthy_after(3) as url:
            ticker = asyncio.create_task(tick())
            await wait_healthy_async(url, timeout=10)
            ticker.cancel()
        return ticks

    assert asyncio.run(main()) > 5, "the loop ran while the wait polled"


@pytest.mark.slow  # starts processes
def test_stopping_several_takes_one_grace_and_reaps_them() -> None:
    """Two processes that ignore SIGTERM: both killed after one grace, not one each."""
    deaf = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('deaf', flush=True); time.sleep(30)"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        assert [p.stdout.readline() for p in procs if p.stdout] == ["deaf\n"] * 2, "ready"
        started = time.monotonic()
        stop_all(procs, grace=1.0)
        assert time.monotonic() - started < 1.9, "one grace for both"
        assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2, "killed and reaped"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
