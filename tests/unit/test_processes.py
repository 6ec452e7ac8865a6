"""Waiting for a local server to answer /health (router.runtime.processes), with or without an
event loop around the wait."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from router.runtime.processes import wait_healthy, wait_healthy_async


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
