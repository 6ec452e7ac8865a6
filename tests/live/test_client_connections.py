"""The proxy's connections in this process (fast): the head deadline, the cap, the parser's
errors in the OpenAI shape, and the 503 at the end of the shutdown grace. The same against a
`fairway serve` process, the open-files limit too: tests/system/test_connections.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource

import aiohttp
import pytest

from router.proxy import connections, overload
from router.proxy.errors import APIError
from tests.live_helpers import emulated_workers, proxy, run

FAST = {"header_timeout": 0.5, "max_connections": 3}


async def talk(base: str, data: bytes, wait: float = 5.0) -> bytes:
    """Send `data`, and read until the proxy closes: what it answered."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    try:
        async with asyncio.timeout(wait):
            return await reader.read()
    finally:
        writer.close()


def error_of(raw: bytes, status: int) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split()[1] == str(status).encode(), raw[:300]
    assert b"application/json" in head.lower(), head
    return json.loads(body)["error"]


class TestConnections:
    def test_a_head_that_stops_halfway_gets_a_408_and_a_close(self) -> None:
        async def go() -> None:
            async with emulated_workers(1) as urls, proxy(urls, **FAST) as (base, _):
                raw = await talk(base, b"GET /health HTTP/1.1\r\nHost: x\r\n")
                assert error_of(raw, 408)["code"] == "header_timeout"

        run(go)

    def test_past_the_cap_a_503_and_a_close(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1) as urls,
                proxy(urls, **FAST) as (base, _),
                contextlib.AsyncExitStack() as held,
            ):
                for _ in range(FAST["max_connections"]):
                    session = await held.enter_async_context(aiohttp.ClientSession())
                    async with session.get(f"{base}/health") as r:  # kept alive after
                        assert r.status == 200
                raw = await talk(base, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert error_of(raw, 503)["code"] == "too_many_connections"

        run(go)

    @pytest.mark.parametrize(
        "raw, status",
        [
            (b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
            (b"HELLO\r\n\r\n", 400),
        ],
    )
    def test_the_parser_s_refusals_in_the_openai_shape(self, raw: bytes, status: int) -> None:
        async def go() -> None:
            async with emulated_workers(1) as urls, proxy(urls, **FAST) as (base, _):
                error_of(await talk(base, raw), status)

        run(go)


class TestShutdownGrace:
    def test_a_request_still_at_its_worker_when_the_grace_ends_gets_a_503(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=0.02) as urls,  # 1 token in about a second
                aiohttp.ClientSession() as session,
                contextlib.AsyncExitStack() as stack,
            ):
                base, _ = await stack.enter_async_context(proxy(urls, shutdown_grace=0.3))
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 50}
                ask = asyncio.create_task(session.post(f"{base}/v1/completions", json=body))
                await asyncio.sleep(0.3)
                await stack.aclose()
                async with await ask as r:
                    assert r.status == 503
                    assert (await r.json())["error"]["code"] == "shutting_down"

        run(go)


class TestCap:
    def test_unset_it_follows_the_open_files_limit(self, monkeypatch) -> None:
        for soft, cap in ((300, 118), (1024, 480), (1 << 20, connections.DEFAULT_MAX_CONNECTIONS)):
            monkeypatch.setattr(resource, "getrlimit", lambda _, s=soft: (s, s))
            assert connections.connection_cap(None) == cap
        assert connections.connection_cap(10) == 10

    def test_the_busy_answer_is_a_whole_http_answer(self) -> None:
        head, _, body = overload.BUSY.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert b"Connection: close" in head and b"Retry-After: 1" in head
        assert int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]) == len(body)
        assert json.loads(body) == overload.too_many_connections().body
        assert isinstance(overload.too_many_connections(), APIError)
