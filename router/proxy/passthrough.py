"""The vLLM endpoints that generate nothing the router schedules, relayed to one worker.

    endpoint                                       body        sent to
    /tokenize, /detokenize                         JSON        the least busy healthy worker
    /v1/messages/count_tokens (Anthropic)          JSON          of the group that serves the
    /v1/embeddings, /v2/embed, /pooling,           JSON          body's `model` (the only
      /classify, /score, /v1/score, /rerank,                     group, if the body names none)
      /v1/rerank, /v2/rerank, /generative_scoring
    /v1/audio/transcriptions, /translations        multipart   the same, `model` a form field

They pass the checks generation does before anything reaches a worker: the caller's API key
(401), the body's size and read deadline (413, 408), JSON syntax and nesting (400), the model
(404), the tenant's request rate (429). They are not routed by prefix, queued or charged as
generation: their cost is one forward pass, and a pooling model keeps no KV for a prefix to
hit. A worker that fails (refused, 5xx) is left for another, as generation does, up to
`max_retries`; its answer, success or the worker's own 4xx, goes back as it came.
"""

from __future__ import annotations

import asyncio
import logging
from email.parser import BytesParser
from email.policy import HTTP

import aiohttp
from aiohttp import web

from router.proxy import ratelimit
from router.proxy.catalog import Catalog, Served
from router.proxy.driver import LiveCluster, LiveWorker
from router.proxy.errors import APIError, bad_request, shape_for, unavailable
from router.proxy.forward import CATALOG, CLUSTER, HOP_BY_HOP, NOT_PASSED, SESSION, SETTINGS
from router.proxy.identity import authenticate, client_identity
from router.proxy.openai_request import INLINE_BYTES, parse_json, read_body
from router.proxy.settings import ProxySettings
from router.request import Request

log = logging.getLogger(__name__)

JSON_PATHS = (
    "/tokenize",
    "/detokenize",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/generative_scoring",
)
MULTIPART_PATHS = ("/v1/audio/transcriptions", "/v1/audio/translations")


def endpoint_label(path: str) -> str:
    """The `api` label of a passed-through request: its endpoint without the version prefix
    (`/v1/rerank` and `/rerank` are one endpoint), one of a fixed few since only these paths
    are routed here."""
    for prefix in ("/v1/", "/v2/", "/"):
        if path.startswith(prefix):
            return path[len(prefix) :].replace("/", "_")
    return path


MAX_FORM_FIELD = 256  # the `model` form field: a name, not a payload


async def relay(request: web.Request) -> web.StreamResponse:
    """One passed-through request: checked, then relayed to a worker of its model's group."""
    app = request.app
    s: ProxySettings = app[SETTINGS]
    cluster: LiveCluster = app[CLUSTER]
    shape = shape_for(request.path)
    try:
        tenant = authenticate(request, s)
        raw = await read_body(request, s.max_body_bytes, s.body_timeout)
        if request.path in MULTIPART_PATHS:
            body: dict = {"model": form_field(raw, request.headers.get("Content-Type", ""))}
        elif len(raw) <= INLINE_BYTES:
            body = parse_json(raw)
        else:
            body = await asyncio.get_running_loop().run_in_executor(None, parse_json, raw)
        served = served_model(app[CATALOG], body.get("model"))
        client, weight = client_identity(request, body, tenant, s)
        # The tenant's request rate, as generation checks it; no tokens are charged.
        await ratelimit.check(request, probe(client, weight))
        return await _forward(request, cluster, s, served, raw)
    except APIError as e:
        cluster.metrics.requests.labels(
            s.policy_name, "passthrough", "none", f"http_{e.status}", endpoint_label(request.path)
        ).inc()
        return e.response(shape)


def install(app: web.Application) -> None:
    for path in (*JSON_PATHS, *MULTIPART_PATHS):
        app.router.add_post(path, relay)


def form_field(raw: bytes, content_type: str, name: str = "model") -> str | None:
    """A multipart/form-data body's text field `name` (None: no such field)."""
    if not content_type.startswith("multipart/form-data"):
        raise bad_request("the body must be multipart/form-data", "file")
    head = f"Content-Type: {content_type}\r\n\r\n".encode()
    message = BytesParser(policy=HTTP).parsebytes(head + raw)
    if not message.is_multipart():
        raise bad_request("the multipart body has no parts", "file")
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == name:
            value = part.get_payload(decode=True) or b""
            if len(value) > MAX_FORM_FIELD:
                raise bad_request(f"'{name}' is longer than {MAX_FORM_FIELD} bytes", name)
            return value.decode("utf-8", errors="replace")
    return None


def served_model(catalog: Catalog, model: object) -> Served:
    if model is None:
        bases = catalog.base_models()
        if len(bases) == 1:
            return bases[0]
        raise bad_request("'model' is required: this router serves several models", "model")
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    return catalog.resolve(model)


def probe(client: str, weight: float) -> Request:
    """What the rate limit reads of a request: its tenant; no prompt tokens to charge."""
    return Request(id=-1, arrival=0.0, prompt_len=1, output_len=1, client=client, weight=weight)


def candidates(cluster: LiveCluster, served: Served) -> list[LiveWorker]:
    """The group's healthy workers, the least busy first."""
    workers = [w for w in cluster.healthy() if served.group is None or w.model == served.group]
    return sorted(workers, key=lambda w: (w.dispatch.in_flight + len(w.dispatch), w.id))


async def _forward(
    request: web.Request, cluster: LiveCluster, s: ProxySettings, served: Served, raw: bytes
) -> web.StreamResponse:
    session: aiohttp.ClientSession = request.app[SESSION]
    headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_PASSED}
    if request.path in JSON_PATHS:  # parsed as JSON, so sent as JSON (vLLM insists on the type)
        headers["Content-Type"] = "application/json"
    last: APIError = unavailable("no healthy worker serves this model")
    for worker in candidates(cluster, served)[: s.max_retries + 1]:
        try:
            async with asyncio.timeout(s.first_byte_timeout):
                upstream = await session.post(
                    f"{worker.url}{request.rel_url}",
                    data=raw,
                    headers=headers,
                    timeout=s.upstream_timeout,
                )
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("worker %s failed a passed-through %s: %r", worker.id, request.path, e)
            cluster.mark_failure(worker)
            last = APIError(502, f"worker {worker.id} failed", "bad_gateway", code="worker_error")
            continue
        if upstream.status >= 500:
            text = await upstream.text(errors="replace")
            upstream.release()
            log.warning("worker %s answered %s: %s", worker.id, upstream.status, text[:500])
            last = APIError(
                502,
                f"worker {worker.id} answered {upstream.status}",
                "bad_gateway",
                code="worker_error",
            )
            continue
        if upstream.status == 404:
            data = await upstream.read()
            upstream.release()
            if data.startswith(b'{"detail":"Not Found"}'):  # FastAPI's: no such route there
                # A generating model asked for embeddings, say: said in the API's shape, not
                # as the server's bare 404.
                raise APIError(
                    404,
                    f"the workers serving `{served.base}` do not serve {request.path} (pooling "
                    "endpoints need a model group started with a pooling runner)",
                    "not_found_error",
                    "model",
                    "endpoint_not_served",
                )
            headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            return web.Response(body=data, status=404, headers=headers)
        return await _relay_answer(request, cluster, s, worker, upstream)
    cluster.metrics.requests.labels(
        s.policy_name, "passthrough", "none", f"http_{last.status}", endpoint_label(request.path)
    ).inc()
    raise last


async def _relay_answer(
    request: web.Request,
    cluster: LiveCluster,
    s: ProxySettings,
    worker: LiveWorker,
    upstream: aiohttp.ClientResponse,
) -> web.StreamResponse:
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
    headers["X-Fairway-Worker"] = worker.label
    response = web.StreamResponse(status=upstream.status, headers=headers)
    status = "ok" if upstream.status < 400 else f"http_{upstream.status}"
    try:
        await response.prepare(request)
        async with asyncio.timeout(s.request_timeout):
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        await response.write_eof()
    except (aiohttp.ClientError, TimeoutError):  # the worker broke off: the client sees a cut
        status = "stream_broken"
    except ConnectionError:
        status = "client_gone"
    finally:
        upstream.release()
        cluster.metrics.requests.labels(
            s.policy_name, "passthrough", worker.label, status, endpoint_label(request.path)
        ).inc()
    return response
