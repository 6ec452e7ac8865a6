"""One request's trip through the cluster (`Forward`): route, queue, send, relay, account.

Forwarding commits at the client's first byte: until then (a whole non-streamed answer, a
stream's first chunk), a failure (refused connection, 5xx, a stalled worker) sends the request
to another worker; after it, the bytes already sent cannot be taken back, so a broken stream
ends with a framed SSE error event and `data: [DONE]`.

On a split fleet a request routed to a prefill worker makes two trips (`_split`): the prefill
(max_tokens 1, never streamed: router/proxy/split.py), then the client's own request at the
decode worker the router hands it to, relayed as any other. Both stages fail as one worker
does: a failure before the client's first byte, at either, sends the whole request through
again (the prefill worker or decode worker that failed left out); after it, the stream ends
with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

import aiohttp
import orjson
from aiohttp import web

from router.classes import Refused
from router.proxy import admission, split
from router.proxy.adapters import ADAPTERS, AdapterLoadFailed
from router.proxy.apis import API
from router.proxy.capture import TraceCapture
from router.proxy.catalog import Catalog
from router.proxy.driver import LiveCluster, LiveWorker, WorkerDown
from router.proxy.errors import ANTHROPIC, APIError, unavailable
from router.proxy.settings import ProxySettings
from router.proxy.sse import ResponsesAccount
from router.records import RecordWriter, RequestRecord, weighted_tokens
from router.request import Request
from router.runtime.trouble import own_trouble
from router.traits import Role

log = logging.getLogger(__name__)

# Never passed on, either way: hop-by-hop headers, and those aiohttp sets anew for the next hop
# (host, length; a worker's body arrives decompressed, so its encoding no longer holds).
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
# Nor a client's X-Vllm-Priority: vLLM would take its band from it (admission.py).
NOT_PASSED = HOP_BY_HOP | {admission.VLLM_PRIORITY_HEADER}
# What a trip reads from the app; `create_app` (app.py) puts them there.
CLUSTER = web.AppKey("cluster", LiveCluster)
CATALOG = web.AppKey("catalog", Catalog)  # the models served, by the names clients use
SETTINGS = web.AppKey("settings", ProxySettings)
SESSION = web.AppKey("session", aiohttp.ClientSession)
RECORDER = web.AppKey("recorder", RecordWriter)  # requests.csv, when the proxy records
CAPTURE = web.AppKey("capture", TraceCapture)  # trace.jsonl, likewise
STARTED = web.AppKey("started", float)  # the recordings' time 0 (monotonic)


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

    def __init__(
        self, app: web.Application, http: web.Request, body: dict, req: Request, api: API
    ) -> None:
        self.cluster: LiveCluster = app[CLUSTER]
        self.settings: ProxySettings = app[SETTINGS]
        self.session = app[SESSION]
        self.adapters = app[ADAPTERS]
        self.http, self.body, self.req, self.api = http, body, req, api
        self.upstream_body = api.upstream(body)
        self.answer: dict | None = None  # a whole answer (or a stream's final response), parsed
        self.continues: str | None = None  # the stored response a Responses turn continues
        self.request_id = http.headers.get("X-Request-Id") or uuid.uuid4().hex
        self.metrics = self.cluster.metrics
        self.counted = False  # its outcome is in fairway_requests_total
        self.output_tokens = 0
        self.cached_tokens: int | None = None  # what the worker reported it reused, if it did
        # A split request's prefill worker (where routing placed it, and sought its reuse)
        # and the reuse it reported; the decode worker's cached tokens are the KV it was sent.
        self.prefill_worker: LiveWorker | None = None
        self.prefill_hit: int | None = None
        self.first_byte_at: float | None = None
        self.admitted_at: float | None = None
        self.response: web.StreamResponse | None = None  # a stream the client is reading
        self.recorder: RecordWriter | None = app.get(RECORDER)
        self.capture: TraceCapture | None = app.get(CAPTURE)
        self.t0 = app[STARTED]
        self._book_failed = False

    async def run(self) -> web.StreamResponse:
        path = self.api.path
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
        tried: set[int] = set()  # workers that failed it (mixed or prefill)
        decoders: set[int] = set()  # decode workers that failed it
        last_error: APIError = unavailable("no healthy worker")
        for _ in range(self.settings.max_retries + 1):
            try:
                worker, reason, admitted = self.cluster.route(self.req, exclude=tried)
            except WorkerDown:
                break
            except Refused as e:  # admission control: no worker would serve it in time
                self.counted = True
                self.metrics.requests.labels(
                    self.settings.policy_name, "refused", "none", e.reason, self.api.name
                ).inc()
                raise admission.refused(e) from None
            except Exception as e:
                log.exception("request %s: routing failed", self.request_id)
                raise _unavailable("the router could not place the request", "routing_error") from e
            if not await self._admitted(worker, reason, admitted):
                tried.add(worker.id)
                continue
            if worker.role is Role.PREFILL:
                answer = await self._split(worker, reason, path, tried, decoders)
                if isinstance(answer, APIError):
                    last_error = answer
                    continue
                return answer
            sent = await self._attempt(worker, reason, path, tried)
            if isinstance(sent, APIError):  # nothing reached the client yet: try elsewhere
                last_error = sent
                continue
            return await self._deliver(sent, worker, reason, scored=True)
        status = f"http_{last_error.status}"
        self.metrics.requests.labels(
            self.settings.policy_name, "exhausted", "none", status, self.api.name
        ).inc()
        raise last_error

    async def _split(
        self, prefill: LiveWorker, reason: str, path: str, tried: set[int], decoders: set[int]
    ) -> web.StreamResponse | APIError:
        """One attempt on a split fleet, from the prefill worker's release of the request to
        the decode worker's answer. An APIError returned, not raised, failed before the
        client's first byte: the caller sends the request through again, without the worker
        that failed (`tried` for prefill workers, `decoders` for decode ones). Each stage is
        given back once: the prefill's by `prefilled` (`release` if it failed), the decode's
        by `release` (`abandon` while it waits in the decode worker's queue)."""
        req = self.req
        body = split.prefill_body(self.upstream_body, prefill.kv_shape, self.api.limit)
        sent = await self._attempt(prefill, reason, path, tried, body)
        if isinstance(sent, APIError):
            return sent
        upstream, data, _ = sent
        upstream.release()  # its body is read whole
        if upstream.status >= 400:  # the server refused the request itself: the client's answer
            try:
                return self._answer(upstream, data, prefill, reason)
            finally:
                self._book(self.cluster.release, prefill, req, 0)
        params, self.prefill_hit = split.prefill_answer(data, prefill.kv_shape, self.api.usage)
        self.prefill_worker = prefill
        if params is None and prefill.kv_shape == split.HANDSHAKE and not prefill.kv_warned:
            prefill.kv_warned = True  # once: every prefill it answers will lack them
            log.warning(
                "worker %s answers prefills without kv_transfer_params (is it started with "
                "its KV connector?): decode workers compute those prompts again",
                prefill.id,
            )
        answered = time.monotonic()
        try:
            decode, admitted = self.cluster.prefilled(prefill, req, self.prefill_hit, decoders)
        except WorkerDown:  # it ended at its prefill; routed again, it goes to a mixed worker
            self._count(reason, prefill, "retried")
            return _unavailable("no decode worker is healthy", "no_decode_worker")
        except Exception as e:
            log.exception("request %s: the handoff to a decode worker failed", self.request_id)
            raise _unavailable("the router could not place the request", "routing_error") from e
        if not await self._admitted(decode, reason, admitted, started=True):
            self._count(reason, decode, "retried")
            decoders.add(decode.id)
            return _unavailable(f"decode worker {decode.id} went down", "worker_down")
        body = split.decode_body(self.upstream_body, params)
        sent = await self._attempt(decode, reason, path, decoders, body)
        if isinstance(sent, APIError):
            return sent
        if sent[2]:  # a plain answer's first byte is its whole: only a stream's says this
            self.metrics.handoff_seconds.observe(time.monotonic() - answered)
        # Its cached tokens are the KV it was sent: the prefill's hit was scored at the handoff.
        return await self._deliver(sent, decode, reason, scored=False)

    async def _deliver(
        self,
        sent: tuple[aiohttp.ClientResponse, bytes, bool],
        worker: LiveWorker,
        reason: str,
        scored: bool,
    ) -> web.StreamResponse:
        """The worker's answer to the client (a stream relayed, a plain answer whole), then
        its attempt given back, with the reuse it reported when that is the index's to score."""
        upstream, head, stream = sent
        try:
            if stream:
                return await self._relay(upstream, head, worker, reason)
            return self._answer(upstream, head, worker, reason)
        finally:
            upstream.release()
            cached = self.cached_tokens if scored else None
            self._book(self.cluster.release, worker, self.req, self.output_tokens, cached)

    async def _attempt(
        self, worker: LiveWorker, reason: str, path: str, tried: set[int], body: dict | None = None
    ) -> tuple[aiohttp.ClientResponse, bytes, bool] | APIError:
        """`_send` to `worker`, its adapter loaded there first. An APIError returned failed
        before the client's first byte: the attempt is given back and `worker` joins `tried`."""
        try:
            if self.req.adapter is not None:
                await self.adapters.ensure(self.session, worker, self.req.adapter)
            return await self._send(worker, path, body)
        except AdapterLoadFailed as e:  # the worker is fine; the adapter will not load there
            self._book(self.cluster.router.adapters.drop, worker.id, self.req.adapter)
            return self._retry(worker, reason, tried, e, failed=False)
        except APIError as e:
            # The proxy out of descriptors or memory never reached the worker: tried elsewhere,
            # but not counted against this worker's health (router/runtime/trouble.py).
            return self._retry(worker, reason, tried, e, failed=own_trouble(e) is None)
        except BaseException:
            self._book(self.cluster.release, worker, self.req, 0)
            raise

    def _retry(
        self,
        worker: LiveWorker,
        reason: str,
        tried: set[int],
        error: APIError,
        failed: bool = True,
    ) -> APIError:
        """`worker` could not answer before the client's first byte: give its attempt back,
        count it against the worker's health if it `failed` (rather than refusing what it
        cannot serve), and leave it out of the next attempt. Returns `error`, the answer if
        no other attempt does better."""
        self._book(self.cluster.release, worker, self.req, 0)
        if failed:
            self._book(self.cluster.mark_failure, worker)
            self.metrics.retries.labels(worker.label).inc()
        self._count(reason, worker, "retried")
        tried.add(worker.id)
        return error

    async def _admitted(
        self,
        worker: LiveWorker,
        reason: str,
        admitted: asyncio.Future[LiveWorker],
        started: bool = False,
    ) -> bool:
        """Wait until the worker's dispatch queue releases the request. False: the worker went
        down first (try another). Timing out in the queue is the client's answer (503): past
        its class's limit (admission control) a refusal, `queue_time`, unless it was released
        meanwhile; past `queue_timeout`, `queue_timeout`. A `started` request (a split one
        waiting for its decode worker) is never refused: only `queue_timeout` ends its wait."""
        limit = self.settings.queue_timeout
        class_limit = None if started else self.cluster.queue_limit(self.req)
        refuses = class_limit is not None and class_limit <= limit
        if refuses:
            limit = class_limit
        try:
            if not admitted.done():  # most are let through at once: no timer for those
                async with asyncio.timeout(limit):
                    # Shielded: a release racing the timer still reaches the future.
                    await asyncio.shield(admitted)
            admitted.result()
        except WorkerDown:
            self._book(self.cluster.abandon, worker, self.req)
            return False
        except TimeoutError:
            if refuses and self._timed_out(worker):
                self._count(reason, worker, "queue_time")
                traffic = self.cluster.traffic_class(self.req)
                raise admission.queue_time_refused(traffic, limit) from None
            if not refuses or not admitted.done():
                self._book(self.cluster.abandon, worker, self.req)
                self._count(reason, worker, "queue_timeout")
                raise _unavailable(
                    "timed out waiting in the router queue", "queue_timeout"
                ) from None
            # Released as its time ran out: a request the worker has is never refused.
            return await self._admitted(worker, reason, admitted, started)
        except BaseException:  # the client left (cancelled), or the cluster failed the wait
            self._book(self.cluster.abandon, worker, self.req)
            raise
        self.admitted_at = time.monotonic()
        return True

    def _timed_out(self, worker: LiveWorker) -> bool:
        """Withdrawn and counted as refused (True), or released already (False)."""
        try:
            return self.cluster.time_out(worker, self.req)
        except Exception:
            log.exception("request %s: time_out failed; abandoned", self.request_id)
            return False

    async def _send(
        self, worker: LiveWorker, path: str, body: dict | None = None
    ) -> tuple[aiohttp.ClientResponse, bytes, bool]:
        """Send `body` (default: the client's, as a worker gets it) and wait for what the
        client would see first: a non-streamed answer whole, or a stream's first chunk.
        Failing anywhere before that is an APIError (retryable). Returns the response, those
        bytes, and whether it is a stream."""
        s = self.settings
        if body is None:
            body = self.upstream_body
        headers = {k: v for k, v in self.http.headers.items() if k.lower() not in NOT_PASSED}
        headers["X-Request-Id"] = self.request_id
        headers["Content-Type"] = "application/json"
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(s.first_byte_timeout):
                resp = await self.session.post(
                    f"{worker.url}{path}",
                    data=orjson.dumps(
                        admission.upstream_body(body, self.req.priority, worker.priority_scheduling)
                    ),
                    headers=headers,
                    timeout=self.settings.upstream_timeout,
                )
                if resp.status >= 500:
                    # The worker's own text stays in the log: it can name hosts, paths, a trace.
                    text = await resp.text(errors="replace")
                    log.warning("worker %s answered %s: %s", worker.id, resp.status, text[:500])
                    raise _bad_gateway(f"worker {worker.id} answered {resp.status}")
                if resp.status >= 400 or "text/event-stream" not in resp.content_type:
                    return resp, await resp.read(), False
                head = await resp.content.readany()
                # Held until the first token: the Responses API's and Anthropic's streams open
                # with events sent before any is generated, and committing to them would take
                # a stalled worker's request past the point where another can be tried.
                while head and not self.api.begun(head):
                    more = await resp.content.readany()
                    if not more:
                        break
                    head += more
                if not head or not self.api.begun(head):
                    raise _bad_gateway(f"worker {worker.id} ended the stream before any token")
                return resp, head, True
        except (aiohttp.ClientError, TimeoutError) as e:
            if resp is not None:
                resp.close()
            cause = own_trouble(e)
            if cause is not None:  # it never reached the worker: the proxy's own exhaustion
                log.warning(
                    "request %s: no %s to reach worker %s", self.request_id, cause, worker.id
                )
                error = _unavailable(f"the router is out of {cause} for now", "router_overloaded")
                error.headers["Retry-After"] = "1"
                raise error from e
            what = (
                f"no answer within {s.first_byte_timeout:g} s"
                if isinstance(e, TimeoutError) and not isinstance(e, aiohttp.ClientError)
                else type(e).__name__  # not its text: that names the worker's address
            )
            log.warning(
                "request %s: worker %s failed before answering: %r", self.request_id, worker.id, e
            )
            raise _bad_gateway(f"worker {worker.id} failed: {what}") from e
        except BaseException:
            if resp is not None:
                resp.close()
            raise

    def _answer(
        self, upstream: aiohttp.ClientResponse, data: bytes, worker: LiveWorker, reason: str
    ) -> web.Response:
        self._mark_first_byte(worker)
        headers = self._headers(upstream, worker)
        if upstream.status < 400:
            with contextlib.suppress(ValueError):
                self.answer = orjson.loads(data)
            usage = self.api.usage(self.answer)
            if usage is not None:
                self.output_tokens, self.cached_tokens = (
                    usage.completion_tokens,
                    usage.cached_tokens,
                )
            self._book(self.cluster.tokens, worker, self.req, self.output_tokens)
        elif self.api.errors == ANTHROPIC:  # the worker's own error, in the shape the client parses
            data = anthropic_error(data, upstream.status)
            headers["Content-Type"] = "application/json"
        self._finish(reason, worker, "ok" if upstream.status < 400 else f"http_{upstream.status}")
        return web.Response(body=data, status=upstream.status, headers=headers)

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
        account = self.api.account(self.body)
        if isinstance(account, ResponsesAccount):
            account.continues = self.continues
        limit = self.settings.stream_timeout
        per_chunk = None if _arm_read_timeout(upstream, limit) else limit  # None: aiohttp's timer
        ended = False  # the worker's end of stream (`data: [DONE]`, a final event) has gone by
        tail = b""  # the end and what follows it: sent with the stream's end, in one write
        itl = metrics.itl.labels(req.client)
        chunk, last = head, time.monotonic()
        try:
            while chunk:
                events, n = account.feed(chunk)
                if n:
                    self.output_tokens += n
                    self._book(self.cluster.tokens, worker, req, n)
                if events and (ended or account.ends(events)):
                    ended = True
                    tail += events
                elif events:
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
                itl.observe(now - last)
                last = now
        except (aiohttp.ClientError, TimeoutError) as e:
            if not ended:
                self._book(self.cluster.mark_failure, worker)
                what = "stalled" if isinstance(e, TimeoutError) else type(e).__name__
                message = f"worker {worker.id} broke off the stream: {what}"
                return await self._broken(message, reason, worker)
        except asyncio.CancelledError:  # shutting down, or the client left
            if client_left(self.http):
                upstream.close()  # and the worker aborts it
                self._finish(reason, worker, "client_gone")
                raise
            if ended:  # all but the stream's end was relayed: finish it as it would have
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await response.write_eof(tail)
            else:
                await self._end_stream(_unavailable("the router stopped this stream", "cancelled"))
            raise
        if rest := account.flush():  # bytes after the last whole event
            if not account.ends(rest):
                return await self._broken(f"worker {worker.id} cut an event short", reason, worker)
            ended = True
            tail += rest
        if not ended:
            return await self._broken(
                f"worker {worker.id} ended the stream before its end event", reason, worker
            )
        if account.usage is not None:
            # The worker's own count replaces the running estimate (charged as a correction).
            exact = account.usage.completion_tokens
            if exact != self.output_tokens:
                self._book(self.cluster.tokens, worker, req, exact - self.output_tokens)
            self.output_tokens, self.cached_tokens = exact, account.usage.cached_tokens
        if isinstance(account, ResponsesAccount):
            self.answer = account.final
        self._finish(reason, worker, "ok")
        with contextlib.suppress(ConnectionError):
            await response.write_eof(tail)
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
                await self.response.write(error.sse(self.api.framing))
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
                what = getattr(fn, "__name__", fn)
                log.exception("request %s: %s failed; the request goes on", self.request_id, what)

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
            record = RequestRecord(
                id=req.id,
                client=req.client,
                session=None,
                worker=worker.id,
                arrival=req.arrival - t0,
                admitted=(self.admitted_at or req.arrival) - t0,
                first_token=self.first_byte_at - t0,
                finish=now - t0,
                prompt_tokens=req.prompt_len,
                cached_tokens=(self.cached_tokens if self.prefill_hit is None else self.prefill_hit)
                or 0,
                output_tokens=self.output_tokens,
                preemptions=0,
                weight=req.weight,
                priority=req.priority,
                predicted_ttft=self.cluster.predicted_ttft(req),
                prefill_worker=None if self.prefill_worker is None else self.prefill_worker.id,
                api=req.api,
            )
            self.recorder.write(record, flush=True)
        if self.capture is not None and status == "ok":
            split = self.prefill_worker is not None
            routed = self.prefill_worker if self.prefill_worker is not None else worker
            self.capture.write(
                req,
                req.arrival - self.t0,
                self.output_tokens,
                routed.id,
                req.session,
                decode_worker=worker.id if split else None,
            )
        service = weighted_tokens(req.prompt_len, self.output_tokens) / req.weight
        self.metrics.service.labels(req.client).inc(service)
        if status == "ok" and self.first_byte_at is not None:
            self._score(now)

    def _score(self, now: float) -> None:
        """The answer against its class's targets, and the TTFT predicted against the measured
        (for a stream: its first byte is its first token)."""
        req, first = self.req, self.first_byte_at
        assert first is not None, "scored only once the client has a byte"
        stream = self.response is not None
        n = self.output_tokens
        tpot = (now - first) / (n - 1) if stream and n > 1 else None
        predicted = self.cluster.predicted_ttft(req) if stream else None
        traffic, label = self.cluster.traffic_class(req), self.cluster.class_label(req)
        admission.score(self.metrics, label, traffic, first - req.arrival, tpot, predicted)

    def _count(self, reason: str, worker: LiveWorker, status: str) -> None:
        self.counted = True
        self.metrics.requests.labels(
            self.settings.policy_name, reason, worker.label, status, self.api.name
        ).inc()


def _bad_gateway(message: str, code: str = "worker_error") -> APIError:
    return APIError(502, message, "bad_gateway", code=code)


def _unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "service_unavailable", code=code)


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


def anthropic_error(data: bytes, status: int) -> bytes:
    """A worker's error answer in Anthropic's shape (vLLM answers some /v1/messages errors,
    its request validation's, in OpenAI's)."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        answer = orjson.loads(data)
        if answer.get("type") == "error":
            return data
        message = str(answer["error"]["message"])
        return orjson.dumps(APIError.of_status(status, message).anthropic_body)
    return orjson.dumps(APIError.of_status(status).anthropic_body)


def client_left(http: web.Request) -> bool:
    """Whether the client has hung up: its connection is gone or closing."""
    transport = http.transport
    return transport is None or transport.is_closing()
