"""The OpenAI-compatible proxy's HTTP side: its handlers, and `create_app`, which installs them
with the middlewares and holds what they share (the app keys).

`generate` validates and tokenizes a completion request, then hands it to `Forward`
(forward.py) to route, queue, forward and account. The rest answer from the router itself:
/v1/models, /health, and on the admin listener only, /metrics and the admin API for adding and
removing workers.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
from aiohttp import web

from router.proxy import drain, passthrough, ratelimit, realtime, responses
from router.proxy.adapters import ADAPTERS, AdapterLoader
from router.proxy.apis import API, CHAT, CHAT_BATCH, COMPLETIONS, MESSAGES, RESPONSES
from router.proxy.capture import TraceCapture
from router.proxy.catalog import Catalog
from router.proxy.conversations import RESPONSES as RESPONSE_STORE
from router.proxy.conversations import MemoryResponses
from router.proxy.driver import LiveCluster, LiveWorker
from router.proxy.errors import APIError, bad_request, openai_errors
from router.proxy.exposure import public_scope
from router.proxy.forward import (
    CAPTURE,
    CATALOG,
    CLUSTER,
    RECORDER,
    SESSION,
    SETTINGS,
    STARTED,
    Forward,
    client_left,
)
from router.proxy.health import HEALTH_NOTES, health
from router.proxy.identity import check_admin, metric_labels
from router.proxy.membership import MEMBERSHIP, Membership, new_worker
from router.proxy.monitor import Monitor
from router.proxy.openai_request import (
    header_limits,
    parse_body,
    parser_limits,
    read_request,
)
from router.proxy.prompts import PromptEncoder
from router.proxy.settings import ProxySettings, Tenant
from router.records import RecordWriter

UPSTREAM_KEEPALIVE_S = 3.0  # idle upstream connections kept below the servers' limit (vLLM: 5 s)

# How the proxy's server must run: a client that hangs up cancels its handler, which closes the
# upstream request, and vLLM aborts a request whose connection closed (aiohttp's default since
# 3.9 lets the handler run on, and the worker generate on, for nobody).
RUNNER_OPTIONS: dict[str, object] = {"handler_cancellation": True}

# What only the handlers read from the app; what a request's trip reads: forward.py.
POOL = web.AppKey("pool", ThreadPoolExecutor)  # tokenizes large prompts off the event loop


async def generate(request: web.Request, api: API) -> web.StreamResponse:
    app = request.app
    settings: ProxySettings = app[SETTINGS]
    # A Responses turn's owner, and the response it continues if it names one.
    turn: dict[str, str | None] = {"owner": None, "previous": None}

    async def expand(body: dict, tenant: Tenant | None) -> dict:
        turn["owner"] = owner = responses.owner_of(request, tenant)
        if isinstance(previous := body.get("previous_response_id"), str):
            turn["previous"] = previous
        return await responses.expand(request, body, owner)

    try:
        body, req = await read_request(
            request, app[CATALOG], settings, api, app[POOL], expand if api is RESPONSES else None
        )
        await ratelimit.check(request, req)  # the tenant's budget: 429, or charged
    except APIError as e:  # rejected before routing: no worker was involved
        app[CLUSTER].metrics.requests.labels(
            settings.policy_name, "rejected", "none", f"http_{e.status}", api.name
        ).inc()
        return e.response(api.errors)
    forward = Forward(app, request, body, req, api)
    if api is not RESPONSES:
        return await _forwarded(forward)
    previous, owner = turn["previous"], turn["owner"]
    assert owner is not None, "a Responses body is always expanded (read_request)"
    forward.continues = previous
    rid = forward.upstream_body["request_id"] = responses.new_response_id()
    if body.get("background"):
        if body.get("store") is False or body.get("stream"):
            what = "'store' false" if body.get("store") is False else "'stream'"
            return bad_request(f"'background' cannot be used with {what}", "background").response()
        forward.upstream_body["background"] = False

        async def run() -> dict | None:
            await _forwarded(forward)
            return forward.answer

        try:
            return await responses.start_background(request, owner, rid, body, previous, run)
        except APIError as e:
            return e.response()
    response = await _forwarded(forward)
    responses.restore_previous(response, previous)
    await responses.remember(app, owner, body, forward.answer, previous)
    return response


async def _forwarded(forward: Forward) -> web.StreamResponse:
    """`forward` run to its end: the client's answer, whatever happened on the way."""
    request, settings, api = forward.http, forward.settings, forward.api
    try:
        async with request.app[drain.DRAIN].deadline():
            return await forward.run()
    except APIError as e:  # no worker could answer; counted where it happened
        return e.response(api.errors)
    except TimeoutError:  # the proxy is stopping and the grace is up (drain.py)
        if not forward.counted:
            forward.metrics.requests.labels(
                settings.policy_name, "none", "none", "cancelled", api.name
            ).inc()
        if forward.response is not None:  # a stream: it ended with an error event
            return forward.response
        return drain.stopping().response(api.errors)
    except asyncio.CancelledError:  # the client hung up (aiohttp cancels its handler), or shutdown
        if not forward.counted:
            status = "client_gone" if client_left(request) else "cancelled"
            forward.metrics.requests.labels(
                settings.policy_name, "none", "none", status, api.name
            ).inc()
        raise
    finally:  # however it ended, what it produced is charged to its tenant's budget
        ratelimit.charge_output(request, forward.output_tokens)


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, CHAT)


async def chat_completions_batch(request: web.Request) -> web.StreamResponse:
    return await generate(request, CHAT_BATCH)


async def create_response(request: web.Request) -> web.StreamResponse:
    return await generate(request, RESPONSES)


async def create_message(request: web.Request) -> web.StreamResponse:
    return await generate(request, MESSAGES)


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": request.app[CATALOG].cards()})


async def metrics(request: web.Request) -> web.Response:
    # Rendered in a thread beside the event loop, not on it: the page grows with the fleet (ten
    # series a worker), and on the loop its rendering would be a pause every stream shares; in a
    # thread the loop waits only for its turns at the interpreter's lock. What each costs:
    # docs/benchmarks.md, "Rendering `/metrics`".
    render = request.app[CLUSTER].metrics.render
    body = await asyncio.get_running_loop().run_in_executor(None, render)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def _check_admin(request: web.Request) -> None:
    check_admin(request, request.app[SETTINGS].admin_token)


async def admin_workers(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    # Replicas change the pool through their store (every replica applies it); one proxy, its own.
    membership = request.app.get(MEMBERSHIP) or Membership(cluster)
    try:
        _check_admin(request)
        if request.method == "POST":
            s: ProxySettings = request.app[SETTINGS]
            body = await parse_body(request, s.max_body_bytes, s.body_timeout)
            worker = await membership.add(new_worker(body, request.app[CATALOG]))
            return web.json_response(_describe(cluster, worker), status=201)
        if request.method == "DELETE":
            wid = request.query.get("id")
            if wid is None or not wid.isdigit():
                raise APIError(404, f"no worker {wid}", "not_found_error", "id")
            await membership.remove(int(wid))
            return web.json_response({"removed": int(wid)})
        listing: dict[str, object] = {
            "workers": [_describe(cluster, w) for w in cluster.workers.values()]
        }
        if membership.version is not None:
            listing["version"] = membership.version
        return web.json_response(listing)
    except APIError as e:
        return e.response()


def _describe(cluster: LiveCluster, w: LiveWorker) -> dict[str, object]:
    state = cluster.view.workers[w.id]
    return {
        "id": w.id,
        "url": w.url,
        "model": w.model,
        "role": w.role.value,
        "healthy": state.healthy,
        "queued": len(w.dispatch),
        "in_flight": w.dispatch.in_flight,
        "window": w.dispatch.window,
        "kv_events": w.kv_events,
        "index_blocks": cluster.view.index.num_blocks(w.id),
        "reported": w.reported,
    }


def create_app(
    cluster: LiveCluster,
    served: Catalog | PromptEncoder,
    settings: ProxySettings,
    monitor: bool = True,
) -> web.Application:
    """The proxy's application. `served`: what it serves (a PromptEncoder: the one model
    `settings.model_name`)."""
    # Errors in the OpenAI shape, aiohttp's own too; header sizes checked below the parser's
    # limits, so that the answer to oversized headers has that shape as well; /metrics and
    # /admin/* only on the admin listener (exposure.py).
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[openai_errors, header_limits, public_scope(settings.admin_port)],
        handler_args=parser_limits(),
    )
    app[CLUSTER] = cluster
    cluster.metrics.label_clients(*metric_labels(settings))
    if isinstance(served, PromptEncoder):
        served = Catalog.single(settings.model_name, served, settings.max_model_len)
    app[CATALOG] = served
    app[ADAPTERS] = AdapterLoader(served.adapter_paths, cluster.metrics)
    app[SETTINGS] = settings
    # One router's conversation store; router replicas put their shared one in its place.
    app[RESPONSE_STORE] = MemoryResponses(
        settings.responses_retention, settings.responses_max_bytes
    )
    ratelimit.install(app, settings, cluster.metrics, cluster.count_refusal)
    app[STARTED] = time.monotonic()
    app[HEALTH_NOTES] = []
    drain.install(app, settings.shutdown_grace)
    if settings.record_dir:
        app[RECORDER] = RecordWriter(Path(settings.record_dir) / "requests.csv")
        app[CAPTURE] = TraceCapture(
            settings.record_dir,
            cluster.view.block_size,
            settings.policy_name,
            roles=cluster.roles(),
        )

    async def session_ctx(app: web.Application):
        # vLLM closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); aiohttp keeps
        # one for 15 s by default, so a request after a lull could go out on a connection the
        # server was closing: ServerDisconnected, a 502 where there is no other worker to try.
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S
        )
        async with aiohttp.ClientSession(connector=connector) as session:
            app[SESSION] = session
            app[POOL] = ThreadPoolExecutor(2, thread_name_prefix="fairway-tokenize")
            watcher = Monitor(
                cluster, session, interval=settings.health_interval, adapters=app[ADAPTERS]
            )
            if monitor:
                watcher.start()
            yield
            await watcher.stop()
            app[POOL].shutdown(wait=False, cancel_futures=True)
            if settings.record_dir:
                app[RECORDER].close()
                app[CAPTURE].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/chat/completions/batch", chat_completions_batch)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_post("/v1/messages", create_message)
    responses.install(app)
    passthrough.install(app)
    realtime.install(app)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    for method in ("GET", "POST", "DELETE"):
        app.router.add_route(method, "/admin/workers", admin_workers)
    return app
