"""The OpenAI-compatible proxy: validate, tokenize, route, queue, forward, account.

Forwarding commits at the client's first byte: until then (a whole non-streamed answer, a
stream's first chunk), a failure (refused connection, 5xx, a stalled worker) sends the request
to another worker; after it, the bytes already sent cannot be taken back, so a broken stream
ends with a framed SSE error event and `data: [DONE]` (see `Forward`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
from aiohttp import web

from router.proxy.capture import TraceCapture
from router.proxy.errors import APIError, bad_request, openai_errors, unavailable
from router.proxy.live import LiveCluster, LiveWorker, WorkerDown
from router.proxy.monitor import Monitor
from router.proxy.openai_request import (
    header_limits,
    parse_body,
    parser_limits,
    read_request,
)
from router.proxy.prompts import PromptEncoder
from router.proxy.settings import ProxySettings
from router.proxy.sse import StreamAccount, client_wants_usage, with_usage_requested
from router.records import RecordWriter, RequestRecord, weighted_tokens
from router.request import Request

log = logging.getLogger(__name__)

UPSTREAM_KEEPALIVE_S = 3.0  # idle upstream connections kept below the servers' limit (vLLM: 5 s)

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
SETTINGS = web.AppKey("settings", ProxySettings)
SESSION = web.AppKey("session", aiohttp.ClientSession)
RECORDER = web.AppKey("recorder", RecordWriter)
CAPTURE = web.AppKey("capture", TraceCapture)
# How the proxy's server must run: a client that hangs up cancels its handler, which closes the
# upstream request, and vLLM aborts a request whose connection closed (aiohttp's default since
# 3.9 lets the handler run on, and the worker generate on, for nobody).
RUNNER_OPTIONS: dict[str, object] = {"handler_cancellation": True}
STARTED = web.AppKey("started", float)
ENCODER = web.AppKey("encoder", PromptEncoder)
POOL = web.AppKey("pool", ThreadPoolExecutor)  # tokenizes large prompts off the event loop


class Forward:
    """One request's trip through the cluster: route, wait in the worker's queue, send, relay.

    The promise: every request ends complete, or with an error in the OpenAI shape; once a
    stream has begun, that is an SSE error event and then `data: [DONE]`.

        route ─▶ queue ─▶ send ─▶ first byte ─┬─▶ answer (whole JSON)
          ▲        │        │     (commit)    └─▶ relay events ─▶ [DONE]
          └────────┴────────┘                          └─ broken, stalled, truncated:
          worker down, refused, 5xx, stalled:              error event + [DONE]
          another worker (max_retries)

    - Until the client has seen a byte (a non-streamed answer whole, a stream's first chunk),
      a failure is retried on another worker: refused, 5xx, or nothing within
      `first_byte_timeout` (a stalled worker). Then the proxy commits.
    - A committed stream that breaks, stalls past `stream_timeout` between chunks, or ends
      without `[DONE]` gets an error event and `[DONE]`.
    - Cluster bookkeeping (policy hooks run inside it) goes through `_book`: what it raises is
      logged and the request goes on. Accounting may suffer from a hook's bug; the answer not.
    - Each routed attempt is given back exactly once: `abandon` while queued (timed out,
      worker down, client gone), `release` once sent.
    """

    def __init__(self, app: web.Application, http: web.Request, body: dict, req: Request) -> None:
        self.cluster: LiveCluster = app[CLUSTER]
        self.settings: ProxySettings = app[SETTINGS]
        self.session = app[SESSION]
        self.http, self.body, self.req = http, body, req
        self.upstream_body = with_usage_requested(body)
        self.request_id = http.headers.get("X-Request-Id") or uuid.uuid4().hex
        self.metrics = self.cluster.metrics
        self.counted = False  # its outcome is in fairway_requests_total
        self.output_tokens = 0
        self.cached_tokens: int | None = None  # what the worker reported it reused, if it did
        self.first_byte_at: float | None = None
        self.admitted_at: float | None = None
        self.response: web.StreamResponse | None = None  # a stream the client is reading
        self.recorder: RecordWriter | None = app.get(RECORDER)
        self.capture: TraceCapture | None = app.get(CAPTURE)
        self.t0 = app[STARTED]
        self._book_failed = False

    async def run(self, path: str) -> web.StreamResponse:
        try:
            return await self._attempts(path)
        except APIError as e:
            if self.response is None:
                raise
            await self._end_stream(e)
            return self.response
        except Exception as e:  # a bug here must still leave the client a clear ending
            log.exception("request %s: failed inside the router", self.request_id)
            error = APIError(500, "internal error in the router", "server_error", code="internal")
            if self.response is None:
                raise error from e
            await self._end_stream(error)
            return self.response

    async def _attempts(self, path: str) -> web.StreamResponse:
        tried: set[int] = set()
        last_error: APIError = unavailable("no healthy worker")
        for _ in range(self.settings.max_retries + 1):
            try:
                worker, reason, admitted = self.cluster.route(self.req, exclude=tried)
            except WorkerDown:
                break
            except Exception as e:
                log.exception("request %s: routing failed", self.request_id)
                raise APIError(
                    503, "the router could not place the request", "service_unavailable",
                    code="routing_error",
                ) from e  # fmt: skip
            if not await self._admitted(worker, reason, admitted):
                tried.add(worker.id)
                continue
            try:
                upstream, head, stream = await self._send(worker, path)
            except APIError as e:  # nothing reached the client yet: try elsewhere
                self._book(self.cluster.release, worker, self.req, 0)
                self._book(self.cluster.mark_failure, worker)
                self._count(reason, worker, "retried")
                self.metrics.retries.labels(worker.label).inc()
                tried.add(worker.id)
                last_error = e
                continue
            except BaseException:
                self._book(self.cluster.release, worker, self.req, 0)
                raise
            try:
                if stream:
                    return await self._relay(upstream, head, worker, reason)
                return self._answer(upstream, head, worker, reason)
            finally:
                upstream.release()
                self._book(
                    self.cluster.release, worker, self.req, self.output_tokens, self.cached_tokens
                )
        self.metrics.requests.labels(
            self.settings.policy_name, "exhausted", "none", f"http_{last_error.status}"
        ).inc()
        raise last_error

    async def _admitted(
        self, worker: LiveWorker, reason: str, admitted: asyncio.Future[LiveWorker]
    ) -> bool:
        """Wait until the worker's dispatch queue releases the request. False: the worker went
        down first (try another). Timing out in the queue is the client's answer (503)."""
        try:
            async with asyncio.timeout(self.settings.queue_timeout):
                await admitted
        except WorkerDown:
            self._book(self.cluster.abandon, worker, self.req)
            return False
        except TimeoutError:
            self._book(self.cluster.abandon, worker, self.req)
            self._count(reason, worker, "queue_timeout")
            raise APIError(
                503, "timed out waiting in the router queue", "service_unavailable",
                code="queue_timeout",
            ) from None  # fmt: skip
        except BaseException:  # the client left (cancelled), or the cluster failed the wait
            self._book(self.cluster.abandon, worker, self.req)
            raise
        self.admitted_at = time.monotonic()
        return True

    async def _send(
        self, worker: LiveWorker, path: str
    ) -> tuple[aiohttp.ClientResponse, bytes, bool]:
        """Send, and wait for what the client would see first: a non-streamed answer whole, or
        a stream's first chunk. Failing anywhere before that is an APIError (retryable).
        Returns the response, those bytes, and whether it is a stream."""
        s = self.settings
        headers = {k: v for k, v in self.http.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["X-Request-Id"] = self.request_id
        # No sock_read: the first byte has its own deadline below, a stream's chunks theirs.
        timeout = aiohttp.ClientTimeout(total=s.request_timeout, sock_connect=s.connect_timeout)
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(s.first_byte_timeout):
                resp = await self.session.post(
                    f"{worker.url}{path}", json=self.upstream_body, headers=headers, timeout=timeout
                )
                if resp.status >= 500:
                    # The worker's own text stays in the log: it can name hosts, paths, a trace.
                    text = await resp.text(errors="replace")
                    log.warning("worker %s answered %s: %s", worker.id, resp.status, text[:500])
                    raise _bad_gateway(f"worker {worker.id} answered {resp.status}")
                if resp.status >= 400 or "text/event-stream" not in resp.content_type:
                    return resp, await resp.read(), False
                head = await resp.content.readany()
                if not head:
                    raise _bad_gateway(f"worker {worker.id} ended the stream before any event")
                return resp, head, True
        except (aiohttp.ClientError, TimeoutError) as e:
            if resp is not None:
                resp.close()
            what = (
                f"no answer within {s.first_byte_timeout:g} s"
                if isinstance(e, TimeoutError) and not isinstance(e, aiohttp.ClientError)
                else type(e).__name__  # not its text: that names the worker's address
            )
            log.warning("request %s: worker %s failed before answering: %r",
                        self.request_id, worker.id, e)  # fmt: skip
            raise _bad_gateway(f"worker {worker.id} failed: {what}") from e
        except BaseException:
            if resp is not None:
                resp.close()
            raise

    def _answer(
        self, upstream: aiohttp.ClientResponse, data: bytes, worker: LiveWorker, reason: str
    ) -> web.Response:
        self._mark_first_byte(worker)
        if upstream.status < 400:
            self.output_tokens, self.cached_tokens = _usage(data)
            self._book(self.cluster.tokens, worker, self.req, self.output_tokens)
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
        self, upstream: aiohttp.ClientResponse, head: bytes, worker: LiveWorker, reason: str
    ) -> web.StreamResponse:
        req, metrics = self.req, self.metrics
        self._mark_first_byte(worker)
        response = web.StreamResponse(
            status=upstream.status, headers=self._headers(upstream, worker)
        )
        try:
            await response.prepare(self.http)
        except ConnectionError:
            upstream.close()
            self._finish(reason, worker, "client_gone")
            return response
        self.response = response
        account = StreamAccount(forward_usage=client_wants_usage(self.body))
        per_chunk = None if _arm_read_timeout(upstream, self.settings.stream_timeout) else (
            self.settings.stream_timeout)  # fmt: skip
        ended = False  # the worker's `data: [DONE]` has gone by
        chunk, last = head, time.monotonic()
        try:
            while chunk:
                events, n = account.feed(chunk)
                if n:
                    self.output_tokens += n
                    self._book(self.cluster.tokens, worker, req, n)
                if events:
                    ended = ended or b"data: [DONE]" in events
                    try:
                        await response.write(events)
                    except ConnectionError:
                        # The client went away. aiohttp's reset error is a ClientError too, so
                        # it is told apart from the worker's errors here; closing upstream
                        # aborts the worker's request as well.
                        upstream.close()
                        self._finish(reason, worker, "client_gone")
                        return response
                if per_chunk is None:
                    chunk = await upstream.content.readany()
                else:
                    async with asyncio.timeout(per_chunk):
                        chunk = await upstream.content.readany()
                now = time.monotonic()
                metrics.itl.labels(req.client).observe(now - last)
                last = now
        except (aiohttp.ClientError, TimeoutError) as e:
            if not ended:
                self._book(self.cluster.mark_failure, worker)
                what = "stalled" if isinstance(e, TimeoutError) else type(e).__name__
                return await self._broken(f"worker {worker.id} broke off the stream: {what}",
                                          reason, worker)  # fmt: skip
        except asyncio.CancelledError:  # shutting down, or the client left
            if client_left(self.http):
                upstream.close()  # and the worker aborts it
                self._finish(reason, worker, "client_gone")
                raise
            await self._end_stream(
                APIError(
                    503, "the router stopped this stream", "service_unavailable", code="cancelled"
                )
            )
            raise
        if rest := account.flush():  # bytes after the last whole event
            if b"[DONE]" not in rest:
                return await self._broken(f"worker {worker.id} cut an event short", reason, worker)
            ended = True
            with contextlib.suppress(ConnectionError):
                await response.write(rest)
        if not ended:
            return await self._broken(
                f"worker {worker.id} ended the stream without [DONE]", reason, worker
            )
        if account.usage is not None:
            # The worker's own count replaces the running estimate (charged as a correction).
            exact = account.usage.completion_tokens
            if exact != self.output_tokens:
                self._book(self.cluster.tokens, worker, req, exact - self.output_tokens)
            self.output_tokens, self.cached_tokens = exact, account.usage.cached_tokens
        self._finish(reason, worker, "ok")
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response

    async def _broken(self, message: str, reason: str, worker: LiveWorker) -> web.StreamResponse:
        assert self.response is not None, "only a stream the client reads can break"
        await self._end_stream(_bad_gateway(message, code="stream_broken"))
        self._finish(reason, worker, "stream_broken")
        return self.response

    async def _end_stream(self, error: APIError) -> None:
        """End a stream the client has begun reading: an error event, then `[DONE]`."""
        assert self.response is not None, "no stream to end"
        with contextlib.suppress(ConnectionError, RuntimeError, TimeoutError):
            async with asyncio.timeout(5.0):  # a client that stopped reading cannot hold us
                await self.response.write(error.sse())
                await self.response.write_eof()

    def _mark_first_byte(self, worker: LiveWorker) -> None:
        self.first_byte_at = time.monotonic()
        self.metrics.ttft.labels(self.req.client).observe(self.first_byte_at - self.req.arrival)
        self._book(self.cluster.first_token, worker, self.req)

    def _book(self, fn: Callable[..., object], *args: object) -> None:
        """Cluster bookkeeping: what it raises is logged (once a request), never passed on."""
        try:
            fn(*args)
        except Exception:
            if not self._book_failed:
                self._book_failed = True
                log.exception("request %s: %s failed; the request goes on", self.request_id,
                              getattr(fn, "__name__", fn))  # fmt: skip

    def _finish(self, reason: str, worker: LiveWorker, status: str) -> None:
        try:
            self._record(worker, status)
        except Exception:  # a full disk or a metrics bug costs the record, not the answer
            log.exception("request %s: recording its end failed", self.request_id)
        self._count(reason, worker, status)

    def _record(self, worker: LiveWorker, status: str) -> None:
        req = self.req
        now = time.monotonic()
        self.metrics.e2e.labels(req.client).observe(now - req.arrival)
        if self.recorder is not None and status == "ok" and self.first_byte_at is not None:
            t0 = self.t0
            self.recorder.write(RequestRecord(
                id=req.id, client=req.client, session=None, worker=worker.id,
                arrival=req.arrival - t0, admitted=(self.admitted_at or req.arrival) - t0,
                first_token=self.first_byte_at - t0, finish=now - t0,
                prompt_tokens=req.prompt_len, cached_tokens=self.cached_tokens or 0,
                output_tokens=self.output_tokens, preemptions=0, weight=req.weight,
            ), flush=True)  # fmt: skip
        if self.capture is not None and status == "ok":
            self.capture.write(
                req, req.arrival - self.t0, self.output_tokens, worker.id, req.session
            )
        service = weighted_tokens(req.prompt_len, self.output_tokens) / req.weight
        self.metrics.service.labels(req.client).inc(service)

    def _count(self, reason: str, worker: LiveWorker, status: str) -> None:
        self.counted = True
        self.metrics.requests.labels(self.settings.policy_name, reason, worker.label, status).inc()


def _bad_gateway(message: str, code: str = "worker_error") -> APIError:
    return APIError(502, message, "bad_gateway", code=code)


def _arm_read_timeout(upstream: aiohttp.ClientResponse, seconds: float) -> bool:
    """Set a stream's limit between two chunks on aiohttp's own socket read timer, which it
    re-arms on every chunk anyway (a timer of our own per chunk would double that cost).
    False if this aiohttp has no such timer to set: the caller then times each read."""
    protocol = getattr(upstream.connection, "protocol", None)
    if protocol is None or not hasattr(protocol, "start_timeout"):
        return False
    protocol.read_timeout = seconds
    protocol.start_timeout()
    return True


def _usage(data: bytes) -> tuple[int, int | None]:
    """(completion tokens, cached prompt tokens) from a non-streamed answer's usage; cached is
    None when the worker does not report it (vLLM without --enable-prompt-tokens-details)."""
    with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
        usage = json.loads(data)["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return int(usage["completion_tokens"]), None if cached is None else int(cached)
    return 0, None


# ------------------------------------------------------------------------- handlers


async def generate(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    settings: ProxySettings = app[SETTINGS]
    try:
        body, req = await read_request(request, app[ENCODER], settings, chat, app[POOL])
    except APIError as e:  # rejected before routing: no worker was involved
        app[CLUSTER].metrics.requests.labels(
            settings.policy_name, "rejected", "none", f"http_{e.status}"
        ).inc()
        return e.response()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    forward = Forward(app, request, body, req)
    try:
        return await forward.run(path)
    except APIError as e:  # no worker could answer; counted where it happened
        return e.response()
    except asyncio.CancelledError:  # the client hung up (aiohttp cancels its handler), or shutdown
        if not forward.counted:
            status = "client_gone" if client_left(request) else "cancelled"
            forward.metrics.requests.labels(settings.policy_name, "none", "none", status).inc()
        raise


def client_left(http: web.Request) -> bool:
    transport = http.transport
    return transport is None or transport.is_closing()


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    s: ProxySettings = request.app[SETTINGS]
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
    # Rendered beside the event loop, not on it: ten series a worker made it 66 ms at 1,024
    # workers, a pause every stream shared; in a thread the loop waits 10 ms at most (GIL
    # turns: `fairway bench-proxy`).
    render = request.app[CLUSTER].metrics.render
    body = await asyncio.get_running_loop().run_in_executor(None, render)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def _check_admin(request: web.Request) -> None:
    token = request.app[SETTINGS].admin_token
    if not token:
        raise APIError(403, "admin API disabled: no admin token configured", "permission_error")
    if request.headers.get("Authorization") != f"Bearer {token}":
        raise APIError(401, "admin token required", "authentication_error")


async def admin_workers(request: web.Request) -> web.Response:
    cluster = request.app[CLUSTER]
    try:
        _check_admin(request)
        if request.method == "POST":
            s: ProxySettings = request.app[SETTINGS]
            body = await parse_body(request, s.max_body_bytes, s.body_timeout)
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
    # Errors in the OpenAI shape, aiohttp's own too; header sizes checked below the parser's
    # limits, so that the answer to oversized headers has that shape as well.
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[openai_errors, header_limits],
        handler_args=parser_limits(),
    )
    app[CLUSTER] = cluster
    cluster.metrics.label_clients((t.client for t in settings.tenants.values()),
                                  settings.client_labels)  # fmt: skip
    app[ENCODER] = encoder
    app[SETTINGS] = settings
    app[STARTED] = time.monotonic()
    if settings.record_dir:
        app[RECORDER] = RecordWriter(Path(settings.record_dir) / "requests.csv")
        app[CAPTURE] = TraceCapture(
            settings.record_dir, cluster.view.block_size, settings.policy_name
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
            watcher = Monitor(cluster, session, interval=settings.health_interval)
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
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    for method in ("GET", "POST", "DELETE"):
        app.router.add_route(method, "/admin/workers", admin_workers)
    return app
