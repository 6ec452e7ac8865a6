"""The OpenAI-compatible proxy: validate, tokenize, route, queue, forward, account.

Forwarding commits at the first byte: until the worker has answered with a status line, a
failure (refused connection, 5xx, timeout) sends the request to another worker; after it, the
bytes already sent cannot be taken back, so a broken stream ends with a framed SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from router.errors import APIError, bad_request, unavailable
from router.live import LiveCluster, LiveWorker, WorkerDown
from router.monitor import Monitor
from router.openai_request import build_request, parse_body
from router.prompts import PromptEncoder
from router.records import RecordWriter, RequestRecord, weighted_tokens
from router.request import Request
from router.sse import StreamAccount, client_wants_usage, with_usage_requested

log = logging.getLogger(__name__)

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
    "content-encoding",
}
CLUSTER = web.AppKey("cluster", LiveCluster)
SETTINGS = web.AppKey("settings", object)
SESSION = web.AppKey("session", aiohttp.ClientSession)
RECORDER = web.AppKey("recorder", object)
STARTED = web.AppKey("started", float)
ENCODER = web.AppKey("encoder", PromptEncoder)


@dataclass(frozen=True)
class ProxySettings:
    model_name: str
    max_model_len: int = 4096
    default_max_tokens: int = 16
    max_retries: int = 2
    queue_timeout: float = 60.0  # waiting in the router's dispatch queue
    connect_timeout: float = 5.0
    first_byte_timeout: float = 60.0
    request_timeout: float = 600.0
    admin_token: str | None = None
    policy_name: str = "?"
    health_interval: float = 1.0
    record_dir: str | None = None  # write requests.csv there, for `fairway report`


class Forward:
    """One request's trip through the cluster, retried before the first byte."""

    def __init__(self, app: web.Application, http: web.Request, body: dict, req: Request) -> None:
        self.cluster: LiveCluster = app[CLUSTER]
        self.settings: ProxySettings = app[SETTINGS]  # type: ignore[assignment]
        self.session = app[SESSION]
        self.http, self.body, self.req = http, body, req
        self.upstream_body = with_usage_requested(body)
        self.request_id = http.headers.get("X-Request-Id") or uuid.uuid4().hex
        self.metrics = self.cluster.metrics
        self.output_tokens = 0
        self.cached_tokens = 0
        self.first_byte_at: float | None = None
        self.admitted_at: float | None = None
        self.recorder: RecordWriter | None = app.get(RECORDER)  # type: ignore[assignment]
        self.t0 = app[STARTED]

    async def run(self, path: str) -> web.StreamResponse:
        tried: set[int] = set()
        last_error: APIError = unavailable("no healthy worker")
        for _ in range(self.settings.max_retries + 1):
            try:
                worker, reason, admitted = self.cluster.route(self.req, exclude=tried)
            except WorkerDown:
                break
            try:
                await asyncio.wait_for(admitted, self.settings.queue_timeout)
                self.admitted_at = time.monotonic()
            except WorkerDown:
                tried.add(worker.id)
                self.cluster.abandon(worker, self.req)
                continue
            except asyncio.TimeoutError:
                self.cluster.abandon(worker, self.req)
                self._count(reason, worker, "queue_timeout")
                raise APIError(
                    503,
                    "timed out waiting in the router queue",
                    "service_unavailable",
                    code="queue_timeout",
                ) from None
            try:
                upstream, data = await self._send(worker, path)
            except APIError as e:  # nothing reached the client yet: try elsewhere
                self.cluster.release(worker, self.req, 0)
                self.cluster.mark_failure(worker)
                self._count(reason, worker, "retried")
                self.metrics.retries.labels(worker.label).inc()
                tried.add(worker.id)
                last_error = e
                continue
            try:
                if data is not None:
                    return self._answer(upstream, data, worker, reason)
                return await self._relay(upstream, worker, reason)
            finally:
                upstream.release()
                self.cluster.release(worker, self.req, self.output_tokens)
        self.metrics.requests.labels(
            self.settings.policy_name, "exhausted", "none", f"http_{last_error.status}"
        ).inc()
        raise last_error

    async def _send(
        self, worker: LiveWorker, path: str
    ) -> tuple[aiohttp.ClientResponse, bytes | None]:
        """Send, and read a whole (non-streamed) answer too: failing anywhere before the client
        has seen a byte is retryable. Returns the response and its body if it was read."""
        s = self.settings
        headers = {k: v for k, v in self.http.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["X-Request-Id"] = self.request_id
        timeout = aiohttp.ClientTimeout(
            total=s.request_timeout, sock_connect=s.connect_timeout, sock_read=s.first_byte_timeout
        )
        try:
            resp = await self.session.post(
                f"{worker.url}{path}", json=self.upstream_body, headers=headers, timeout=timeout
            )
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise APIError(
                502,
                f"worker {worker.id} failed: {type(e).__name__}: {e}",
                "bad_gateway",
                code="worker_error",
            ) from e
        try:
            if resp.status >= 500:
                text = await resp.text()
                raise APIError(
                    502,
                    f"worker {worker.id} answered {resp.status}: {text[:200]}",
                    "bad_gateway",
                    code="worker_error",
                )
            if resp.status >= 400 or "text/event-stream" not in resp.content_type:
                return resp, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            resp.release()
            raise APIError(
                502,
                f"worker {worker.id} failed mid-answer: {type(e).__name__}",
                "bad_gateway",
                code="worker_error",
            ) from e
        except APIError:
            resp.release()
            raise
        return resp, None

    def _answer(
        self, upstream: aiohttp.ClientResponse, data: bytes, worker: LiveWorker, reason: str
    ) -> web.Response:
        self._mark_first_byte(worker)
        if upstream.status < 400:
            self.output_tokens, self.cached_tokens = _usage(data)
            self.cluster.tokens(worker, self.req, self.output_tokens)
        self._finish(reason, worker, "ok" if upstream.status < 400 else f"http_{upstream.status}")
        return web.Response(
            body=data, status=upstream.status, headers=self._headers(upstream, worker)
        )

    def _headers(self, upstream: aiohttp.ClientResponse, worker: LiveWorker) -> dict[str, str]:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["X-Request-Id"] = self.request_id
        headers["X-Fairway-Worker"] = worker.label
        return headers

    async def _relay(
        self, upstream: aiohttp.ClientResponse, worker: LiveWorker, reason: str
    ) -> web.StreamResponse:
        req, metrics = self.req, self.metrics
        response = web.StreamResponse(
            status=upstream.status, headers=self._headers(upstream, worker)
        )
        await response.prepare(self.http)
        account = StreamAccount(forward_usage=client_wants_usage(self.body))
        last = time.monotonic()
        try:
            async for chunk in upstream.content.iter_any():
                now = time.monotonic()
                if self.first_byte_at is None:
                    self._mark_first_byte(worker)
                else:
                    metrics.itl.labels(req.client).observe(now - last)
                last = now
                events, n = account.feed(chunk)
                if n:
                    self.output_tokens += n
                    self.cluster.tokens(worker, req, n)
                try:
                    if events:
                        await response.write(events)
                except ConnectionError:
                    # The client went away. aiohttp's reset error is a ClientError too, so it is
                    # told apart from the worker's errors here; closing upstream aborts the
                    # worker's request as well.
                    upstream.close()
                    self._finish(reason, worker, "client_gone")
                    return response
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.cluster.mark_failure(worker)
            error = APIError(
                502,
                f"worker {worker.id} broke off the stream: {type(e).__name__}",
                "bad_gateway",
                code="stream_broken",
            )
            with contextlib.suppress(ConnectionError):
                await response.write(error.sse())
            self._finish(reason, worker, "stream_broken")
            return response
        if account.usage is not None:
            # The worker's own count replaces the running estimate (charged as a correction).
            exact = account.usage.completion_tokens
            if exact != self.output_tokens:
                self.cluster.tokens(worker, req, exact - self.output_tokens)
            self.output_tokens, self.cached_tokens = exact, account.usage.cached_tokens
        self._finish(reason, worker, "ok")
        with contextlib.suppress(ConnectionError):
            if rest := account.flush():
                await response.write(rest)
            await response.write_eof()
        return response

    def _mark_first_byte(self, worker: LiveWorker) -> None:
        self.first_byte_at = time.monotonic()
        self.metrics.ttft.labels(self.req.client).observe(self.first_byte_at - self.req.arrival)
        self.cluster.first_token(worker, self.req)

    def _finish(self, reason: str, worker: LiveWorker, status: str) -> None:
        req = self.req
        now = time.monotonic()
        self.metrics.e2e.labels(req.client).observe(now - req.arrival)
        if self.recorder is not None and status == "ok" and self.first_byte_at is not None:
            t0 = self.t0
            self.recorder.write(RequestRecord(
                id=req.id, client=req.client, session=None, worker=worker.id,
                arrival=req.arrival - t0, admitted=(self.admitted_at or req.arrival) - t0,
                first_token=self.first_byte_at - t0, finish=now - t0,
                prompt_tokens=req.prompt_len, cached_tokens=self.cached_tokens,
                output_tokens=self.output_tokens, preemptions=0, weight=req.weight,
            ), flush=True)  # fmt: skip
        service = weighted_tokens(req.prompt_len, self.output_tokens) / req.weight
        self.metrics.service.labels(req.client).inc(service)
        self._count(reason, worker, status)

    def _count(self, reason: str, worker: LiveWorker, status: str) -> None:
        self.metrics.requests.labels(self.settings.policy_name, reason, worker.label, status).inc()


def _usage(data: bytes) -> tuple[int, int]:
    """(completion tokens, cached prompt tokens) from a non-streamed answer's usage."""
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        usage = json.loads(data)["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return int(usage["completion_tokens"]), int(details.get("cached_tokens") or 0)
    return 0, 0


# ------------------------------------------------------------------------- handlers


async def generate(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    settings: ProxySettings = app[SETTINGS]  # type: ignore[assignment]
    try:
        body = await parse_body(request)
        req = build_request(request, body, app[ENCODER], settings, chat)
    except APIError as e:  # rejected before routing: no worker was involved
        app[CLUSTER].metrics.requests.labels(
            settings.policy_name, "rejected", "none", f"http_{e.status}"
        ).inc()
        return e.response()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        return await Forward(app, request, body, req).run(path)
    except APIError as e:  # no worker could answer; counted where it happened
        return e.response()


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    s: ProxySettings = request.app[SETTINGS]  # type: ignore[assignment]
    card = {
        "id": s.model_name,
        "object": "model",
        "owned_by": "fairway",
        "max_model_len": s.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    healthy = len(cluster.healthy())
    status = 200 if healthy else 503
    return web.json_response(
        {"healthy_workers": healthy, "workers": len(cluster.workers)}, status=status
    )


async def metrics(request: web.Request) -> web.Response:
    body = request.app[CLUSTER].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def _check_admin(request: web.Request) -> None:
    token = request.app[SETTINGS].admin_token  # type: ignore[attr-defined]
    if not token:
        raise APIError(403, "admin API disabled: no admin token configured", "permission_error")
    if request.headers.get("Authorization") != f"Bearer {token}":
        raise APIError(401, "admin token required", "authentication_error")


async def admin_workers(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    try:
        _check_admin(request)
        if request.method == "POST":
            body = await parse_body(request)
            url = body.get("url")
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise bad_request("'url' must be an http(s) URL", "url")
            kv = body.get("kv_events")
            worker = cluster.add_worker(url, kv if isinstance(kv, str) else None)
            return web.json_response(_describe(cluster, worker), status=201)
        if request.method == "DELETE":
            wid = request.query.get("id")
            if wid is None or not wid.isdigit() or int(wid) not in cluster.workers:
                raise APIError(404, f"no worker {wid}", "not_found_error", "id")
            cluster.remove_worker(int(wid))
            return web.json_response({"removed": int(wid)})
        return web.json_response(
            {"workers": [_describe(cluster, w) for w in cluster.workers.values()]}
        )
    except APIError as e:
        return e.response()


def _describe(cluster: LiveCluster, w: LiveWorker) -> dict[str, object]:
    state = cluster.view.workers[w.id]
    return {
        "id": w.id,
        "url": w.url,
        "healthy": state.healthy,
        "queued": len(w.dispatch),
        "in_flight": w.dispatch.in_flight,
        "window": w.dispatch.window,
        "kv_events": w.kv_events,
        "index_blocks": cluster.view.index.num_blocks(w.id),
        "reported": w.reported,
    }


def create_app(
    cluster: LiveCluster, encoder: PromptEncoder, settings: ProxySettings, monitor: bool = True
) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[CLUSTER] = cluster
    app[ENCODER] = encoder
    app[SETTINGS] = settings
    app[STARTED] = time.monotonic()
    if settings.record_dir:
        app[RECORDER] = RecordWriter(Path(settings.record_dir) / "requests.csv")

    async def session_ctx(app: web.Application):
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            app[SESSION] = session
            watcher = Monitor(cluster, session, interval=settings.health_interval)
            if monitor:
                watcher.start()
            yield
            await watcher.stop()
            if settings.record_dir:
                app[RECORDER].close()  # type: ignore[attr-defined]

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    for method in ("GET", "POST", "DELETE"):
        app.router.add_route(method, "/admin/workers", admin_workers)
    return app
