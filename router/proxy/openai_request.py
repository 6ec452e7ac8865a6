"""An OpenAI request, checked and turned into the router's Request.

One definition of a well-formed request, shared by the proxy and the emulated worker. In order,
each step bounded so that no input costs the proxy more than its limits allow:

    headers   sizes (431/414), the API key (401) ........ before the body is read
    body      size (413), a read deadline (408) ......... slow or huge senders cut off
    JSON      brackets, syntax, nesting depth (400) ..... parsed once, off the loop if large
    fields    model (404), n, best_of, stream, max_tokens, the client's identity, weight and
              priority (router/proxy/identity.py)
    prompt    characters bounded before tokenizing, token ids in the vocabulary (400)

Every rejection is an APIError in the OpenAI shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from router.proxy.apis import API
from router.proxy.catalog import Catalog
from router.proxy.errors import APIError, bad_request
from router.proxy.identity import authenticate, client_identity, client_priority
from router.proxy.prompts import PromptError
from router.proxy.settings import BODY_TIMEOUT, MAX_BODY_BYTES, ProxySettings, Tenant
from router.request import Request, cache_root

MAX_HEADER_BYTES = 8190  # one header line (aiohttp's own default), answered in the OpenAI shape
PARSER_LIMIT = 64 * 1024  # aiohttp's parser refuses (text/plain) only beyond this
MAX_DEPTH = 64  # JSON nesting: tool schemas nest, prompts do not; far below the recursion limit
MAX_CONTAINERS = 100_000  # '[' and '{' in a body, strings too (1024 prompts in a batch: 1025)
INLINE_BYTES = 16 * 1024  # larger bodies are parsed and tokenized on the worker threads
MAX_N = 128  # choices per request (vLLM's default max_num_seqs on CPU)

_request_ids = itertools.count()


# ----------------------------------------------------------------------------- HTTP layer


@web.middleware
async def header_limits(request: web.Request, handler) -> web.StreamResponse:
    """Oversized headers in the OpenAI shape. aiohttp's parser, which answers before any
    middleware in text/plain, is given PARSER_LIMIT (see `parser_limits`); this answers below it."""
    if len(request.raw_path) > MAX_HEADER_BYTES:
        raise APIError.of_status(414, f"the URL is longer than {MAX_HEADER_BYTES} bytes")
    for name, value in request.raw_headers:
        if len(name) + len(value) > MAX_HEADER_BYTES:
            raise APIError.of_status(
                431,
                f"header {name[:64].decode(errors='replace')} is longer than "
                f"{MAX_HEADER_BYTES} bytes",
                code="header_too_large",
            )
    return await handler(request)


def parser_limits() -> dict[str, int]:
    """aiohttp handler_args: the parser's own limits, above the ones `header_limits` enforces."""
    return {"max_line_size": PARSER_LIMIT, "max_field_size": PARSER_LIMIT}


async def read_body(
    request: web.Request, max_bytes: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT
) -> bytes:
    """The whole body, refused past `max_bytes` (413) or when it takes over `timeout` s (408),
    without holding more than `max_bytes` of it."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        error = APIError(
            408,
            f"the request body did not arrive within {timeout:g} s",
            "timeout_error",
            code="body_timeout",
        )
        error.close = True
        raise error from None
    except (ConnectionError, aiohttp.ClientError, HttpProcessingError):
        raise APIError(400, "the request body was cut short", code="body_incomplete") from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(
        413, f"the request body is larger than {max_bytes} bytes", code="request_too_large"
    )


def parse_json(raw: bytes) -> dict:
    # Counted before parsing, so a body of a million empty lists costs nothing to refuse. It
    # counts brackets inside strings as well: a legitimate body has far fewer.
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets > MAX_CONTAINERS:
        raise bad_request(f"request body has over {MAX_CONTAINERS} '[' and '{{' characters")
    try:
        with _collector_paused():  # a body of many small lists would set it off again and again
            body = _loads(raw)
    except RecursionError:
        raise bad_request(f"request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    # Fewer brackets than the limit cannot nest deeper: most bodies stop at the count.
    if brackets > MAX_DEPTH and not _depth_within(body, MAX_DEPTH):
        raise bad_request(f"request body nests deeper than {MAX_DEPTH} levels")
    return body


def _loads(raw: bytes) -> object:
    """orjson, about 3x the standard module on request bodies; what it refuses (a lone
    surrogate, an integer past 64 bits, NaN, nesting past 1024) goes to the standard module,
    so a body is accepted or refused, and with which message, exactly as before."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


@contextlib.contextmanager
def _collector_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _depth_within(obj: object, limit: int) -> bool:
    """Level by level: the cost is the number of values, at most MAX_CONTAINERS containers."""
    level = [obj]
    for _ in range(limit):
        below: list = []
        for o in level:
            values = o.values() if type(o) is dict else o
            below += [v for v in values if type(v) is list or type(v) is dict]
        if not below:
            return True
        level = below
    return False


async def parse_body(
    request: web.Request, max_bytes: int = MAX_BODY_BYTES, timeout: float = BODY_TIMEOUT
) -> dict:
    return parse_json(await read_body(request, max_bytes, timeout))


async def read_request(
    http: web.Request,
    catalog: Catalog,
    s: ProxySettings,
    api: API,
    pool: Executor,
    expand: Callable[[dict, Tenant | None], Awaitable[dict]] | None = None,
) -> tuple[dict, Request]:
    """Authenticate, read, parse and tokenize one generation request. A large body is parsed
    and tokenized on `pool` (the tokenizer releases the GIL), so the event loop stays free.
    `expand`: what the body stands for, when it continues a stored conversation (the whole
    conversation, which is what is tokenized and sent)."""
    tenant = authenticate(http, s)  # before reading a body an unknown caller sent
    raw = await read_body(http, s.max_body_bytes, s.body_timeout)
    loop = asyncio.get_running_loop()
    large = len(raw) > INLINE_BYTES
    body = await loop.run_in_executor(pool, parse_json, raw) if large else parse_json(raw)
    if expand is not None:
        expanded = await expand(body, tenant)
        large = large or expanded is not body
        body = expanded
    if large:
        req = await loop.run_in_executor(pool, build_request, http, body, catalog, s, api, tenant)
    else:
        req = build_request(http, body, catalog, s, api, tenant)
    return body, req


# ----------------------------------------------------------------------------- fields


def _optional(body: dict, key: str, check: Callable[[object], bool], what: str) -> None:
    value = body.get(key)
    if value is not None and not check(value):
        raise bad_request(f"'{key}' must be {what}", key)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def session_of(http: web.Request) -> str | None:
    """A caller-named conversation (X-Session-Id), kept in the recorded trace: a replay can
    send its turns one after another (closed loop). At most 128 characters."""
    session = http.headers.get("X-Session-Id")
    return session[:128] if session else None


def build_request(
    http: web.Request,
    body: dict,
    catalog: Catalog,
    s: ProxySettings,
    api: API,
    tenant: Tenant | None = None,
) -> Request:
    """The router's Request for a parsed body of `api` (apis.py). A batch of prompts
    (/v1/completions with a list of strings or token-id lists) is routed as one request, as the
    worker runs it: prompt_len is the whole batch's, the prefix hashed is the longest prompt's,
    and the output is max_tokens for each prompt and each of the `n` choices. The model named (a
    base model or an adapter) and `cache_salt` make the prompt's cache identity
    (router.request.cache_root)."""
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("'model' is required", "model")
    served = catalog.resolve(model)
    encoder, max_model_len = served.encoder, served.max_model_len
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("'cache_salt' must be a non-empty string if provided", "cache_salt")
    client, weight = client_identity(http, body, tenant, s)
    priority = client_priority(http, body, tenant, s)
    _optional(body, "stream", lambda v: isinstance(v, bool), "true or false")
    _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    n = 1
    if api.batches:
        _optional(body, "n", lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an integer 1 to {MAX_N}")
        n = body.get("n") or 1
        best_of = body.get("best_of")
        if best_of is not None and best_of not in (1, n):  # vLLM's server ignores it: say so
            raise bad_request("'best_of' is not supported (the vLLM workers ignore it)", "best_of")
    try:
        prompts = api.prompts(encoder, body, max_model_len)
    except PromptError as e:
        raise bad_request(str(e), e.param) from None
    ids = max(prompts, key=len)  # the first longest
    key = api.max_tokens_key(body)
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = api.default_max_tokens(len(ids), max_model_len, s.default_max_tokens)
        if max_tokens is None:
            raise bad_request(f"'{key}' is required", key)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad_request(f"'{key}' must be a positive integer", key)
    if len(ids) + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length.",
            key,
        )
    return Request(
        id=next(_request_ids),
        arrival=time.monotonic(),
        prompt_len=sum(len(p) for p in prompts),
        output_len=max_tokens * n * len(prompts),
        block_hashes=encoder.block_hashes(ids, cache_root(served.group, served.adapter, salt)),
        client=client,
        session=session_of(http),
        priority=priority,
        weight=weight,
        model=served.group,
        adapter=served.adapter,
        cache_salt=salt,
        api=api.name,
    )
