"""The emulated server's generation APIs: /v1/completions, /v1/chat/completions (and its batch
form), /v1/responses and /v1/messages, whole or streamed as vLLM streams them (the wording:
shapes.py). Tokens are vocabulary pieces drawn from a seed of the prompt, so that every server
answers a prompt alike (as greedy decoding would); how many come when is the engine's
(workers/emulated/engine.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

from aiohttp import web

from router.proxy.apis import API, CHAT, CHAT_BATCH, COMPLETIONS, MESSAGES, RESPONSES
from router.proxy.errors import APIError
from router.proxy.openai_request import build_request, parse_body
from workers.emulated.shapes import Counts, shape_for
from workers.emulated.split import prompt_key
from workers.emulated.state import (
    ADAPTERS,
    CATALOG,
    CONNECTOR,
    ENGINE,
    KV_EVENTS,
    LIMITS,
    PRIORITY_SCHEDULING,
    VOCAB,
)

INT64 = 1 << 63


def _priority(request: web.Request, body: dict) -> int:
    """A request's priority as vLLM 0.32 reads it: the X-Vllm-Priority header when it is an
    integer, else the body's `priority` (an integer in int64's range, default 0; else a 400)."""
    with contextlib.suppress(ValueError):
        if (header := request.headers.get("X-Vllm-Priority")) is not None:
            return int(header)
    value = body.get("priority", 0)
    if not isinstance(value, int) or isinstance(value, bool) or not -INT64 <= value < INT64:
        message = "priority: Input should be a valid integer within int64's range"
        raise APIError(400, message, "InvalidUserInput")
    return value


async def generate(request: web.Request, api: API) -> web.StreamResponse:
    app = request.app
    try:  # the proxy's own validation: one definition of a well-formed request
        body = await parse_body(request, max_bytes=64 * 1024 * 1024)  # vLLM sets no limit
        req = build_request(request, body, app[CATALOG], app[LIMITS], api)
        req.priority = _priority(request, body) if app[PRIORITY_SCHEDULING] else 0
    except APIError as e:
        return e.response(api.errors)

    if (publisher := app.get(KV_EVENTS)) is not None:
        publisher.identify(req.block_hashes, app[ADAPTERS].lora(req.adapter), req.cache_salt)
    engine, connector = app[ENGINE], app[CONNECTOR]
    connector.note(body)
    queue = engine.submit(req, connector.incoming(body, req, engine.cached_prefix(req)))
    # vLLM answers with the name asked for: an adapter's, for a request run under it
    choices = len(body["messages"]) if api is CHAT_BATCH else 1
    shape = shape_for(api.name, body, body["model"], int(time.time()), choices)
    vocab = app[VOCAB]
    rng = random.Random(prompt_key(body))

    def piece(n: int) -> str:
        return "".join(rng.choice(vocab) for _ in range(n))

    def counts(n_out: int) -> Counts:
        return Counts(req.prompt_len, n_out, engine.cached_tokens.pop(req.id, 0))

    if not body.get("stream"):
        n_out, pieces = 0, []
        try:
            while (n := await queue.get()) is not None:
                n_out += n
                pieces += (piece(1) for _ in range(n))  # the same draws as one piece of n
        except asyncio.CancelledError:  # the client hung up: vLLM cancels such a request too
            engine.abort(req)
            raise
        answer = shape.whole(pieces, counts(n_out))
        if (params := connector.answer_params(body, req, shape.id)) is not None:
            answer["kv_transfer_params"] = params
        connector.stored(body)
        return web.json_response(answer)

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    n_out, text = 0, []
    try:
        if preamble := shape.preamble():
            await response.write(preamble)
        while (n := await queue.get()) is not None:
            if n_out == 0 and (opening := shape.opening()):
                await response.write(opening)
            for _ in range(n):
                n_out += 1
                text.append(piece(1))
                await response.write(shape.token(text[-1], done=n_out == req.output_len))
        await response.write(shape.closing("".join(text), counts(n_out)))
        await response.write_eof()
    except ConnectionError:
        engine.abort(req)  # the client left, as vLLM aborts on disconnect
    except asyncio.CancelledError:  # the same, seen by a server that cancels its handlers
        engine.abort(req)
        raise
    finally:
        engine.cached_tokens.pop(req.id, None)
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, CHAT)


async def chat_completions_batch(request: web.Request) -> web.StreamResponse:
    return await generate(request, CHAT_BATCH)


async def responses(request: web.Request) -> web.StreamResponse:
    return await generate(request, RESPONSES)


async def messages(request: web.Request) -> web.StreamResponse:
    return await generate(request, MESSAGES)
