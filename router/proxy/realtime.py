"""`/v1/realtime`: vLLM's realtime transcription websocket, passed through to one worker.

    client ══ws══ proxy ══ws══ worker (the least busy healthy one of the model's group)

The caller is checked before the upgrade as any request is: its API key (401), its tenant's
request rate (429), the model (`?model=`, OpenAI's realtime convention; the only group when
none is named: 404 if unknown). Then frames go both ways unchanged, each at most
`max_body_bytes` (a larger one closes the socket with 1009, message too big), for at most
`request_timeout` seconds in all; either side closing closes the other. A socket is charged
to no fairness policy: it holds a worker's audio stream, not a queue position.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web

from router.proxy import ratelimit
from router.proxy.errors import APIError
from router.proxy.forward import CATALOG, CLUSTER, NOT_PASSED, SESSION, SETTINGS
from router.proxy.identity import authenticate, client_identity
from router.proxy.passthrough import candidates, probe, served_model

log = logging.getLogger(__name__)

PATH = "/v1/realtime"
# What the upgrade itself carries and aiohttp sets anew for the worker's socket.
_HANDSHAKE = {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions"}


async def realtime(request: web.Request) -> web.StreamResponse:
    app = request.app
    s = app[SETTINGS]
    cluster = app[CLUSTER]
    try:
        tenant = authenticate(request, s)
        served = served_model(app[CATALOG], request.query.get("model"))
        client, weight = client_identity(request, {}, tenant, s)
        await ratelimit.check(request, probe(client, weight))
        workers = candidates(cluster, served)
        if not workers:
            raise APIError(503, "no healthy worker serves this model", "service_unavailable")
    except APIError as e:
        return e.response()
    worker = workers[0]
    headers = {
        k: v
        for k, v in request.headers.items()
        if k.lower() not in NOT_PASSED and k.lower() not in _HANDSHAKE
    }
    session: aiohttp.ClientSession = app[SESSION]
    try:
        upstream = await session.ws_connect(
            f"{worker.url}{request.rel_url}",
            headers=headers,
            max_msg_size=s.max_body_bytes,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
        )
    except (aiohttp.ClientError, TimeoutError) as e:
        log.warning("worker %s refused a realtime socket: %r", worker.id, e)
        return APIError(502, f"worker {worker.id} failed", "bad_gateway").response()
    client_ws = web.WebSocketResponse(max_msg_size=s.max_body_bytes)
    await client_ws.prepare(request)
    status = "ok"
    try:
        async with asyncio.timeout(s.request_timeout):
            await _pump_both(client_ws, upstream)
    except TimeoutError:
        status = "timeout"
    finally:
        await upstream.close()
        await client_ws.close()
        cluster.metrics.requests.labels(
            s.policy_name, "passthrough", worker.label, status, "realtime"
        ).inc()
    return client_ws


async def _pump_both(a: web.WebSocketResponse, b: aiohttp.ClientWebSocketResponse) -> None:
    """Relay frames both ways until either side closes (or fails)."""
    tasks = [asyncio.create_task(_pump(a, b)), asyncio.create_task(_pump(b, a))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _pump(source, sink) -> None:
    async for message in source:
        if message.type == WSMsgType.TEXT:
            await sink.send_str(message.data)
        elif message.type == WSMsgType.BINARY:
            await sink.send_bytes(message.data)
        elif message.type == WSMsgType.ERROR:  # a frame over the limit, or a broken socket
            error = source.exception()
            code = getattr(error, "code", WSCloseCode.INTERNAL_ERROR)
            await sink.close(code=code, message=b"closed by the router")
            return
        else:
            return


def install(app: web.Application) -> None:
    app.router.add_get(PATH, realtime)
