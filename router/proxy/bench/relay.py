"""A reference row for `fairway bench-proxy`: aiohttp relaying streams and nothing else.

No prompt identity, routing policy, queue, accounting, metrics or error handling: each request
goes to the next worker in turn and its answer is copied back, on uvloop, as Fairway's proxy
does it (an aiohttp server and client). Measured beside the proxy, it splits the gap to
sglang-router into what aiohttp's HTTP handling costs and what Fairway's own work costs.

    python -m router.proxy.bench.relay PORT WORKER_URL...
"""

from __future__ import annotations

import asyncio
import itertools
import sys

import aiohttp
import uvloop
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


def create_app(workers: list[str]) -> web.Application:
    turn = itertools.cycle(workers)

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with request.app[SESSION].post(
            next(turn) + request.path, data=body, headers=headers
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status, headers={"Content-Type": upstream.content_type}
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "healthy"})

    async def session(app: web.Application):
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    app = web.Application()
    app.router.add_post("/v1/completions", relay)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(session)
    return app


def main() -> None:
    port, workers = int(sys.argv[1]), sys.argv[2:]
    uvloop.run(_serve(create_app(workers), port))


async def _serve(app: web.Application, port: int) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
