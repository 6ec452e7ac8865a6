"""The emulated server's OpenAI API: /v1/completions and /v1/chat/completions, whole or
streamed as vLLM streams them. Tokens are vocabulary pieces drawn from a seed of the prompt, so
that every server answers a prompt alike (as greedy decoding would); how many come when is the
engine's (workers/emulated/engine.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid

from aiohttp import web

from router.proxy.errors import APIError
from router.proxy.openai_request import build_request, parse_body
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


async def generate(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    try:  # the proxy's own validation: one definition of a well-formed request
        body = await parse_body(request, max_bytes=64 * 1024 * 1024)  # vLLM sets no limit
        req = build_request(request, body, app[CATALOG], app[LIMITS], chat)
        req.priority = _priority(request, body) if app[PRIORITY_SCHEDULING] else 0
    except APIError as e:
        return e.response()

    if (publisher := app.get(KV_EVENTS)) is not None:
        publisher.identify(req.block_hashes, app[ADAPTERS].lora(req.adapter), req.cache_salt)
    engine, connector = app[ENGINE], app[CONNECTOR]
    connector.note(body)
    queue = engine.submit(req, connector.incoming(body, req, engine.cached_prefix(req)))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
    # vLLM answers with the name asked for: an adapter's, for a request run under it
    created, model, vocab = int(time.time()), body["model"], app[VOCAB]
    rng = random.Random(prompt_key(body))

    def piece(n: int) -> str:
        return "".join(rng.choice(vocab) for _ in range(n))

    def usage(n_out: int) -> dict:
        cached = engine.cached_tokens.pop(req.id, 0)
        return {
            "prompt_tokens": req.prompt_len,
            "completion_tokens": n_out,
            "total_tokens": req.prompt_len + n_out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    if not body.get("stream"):
        n_out, text = 0, []
        try:
            while (n := await queue.get()) is not None:
                n_out += n
                text.append(piece(n))
        except asyncio.CancelledError:  # the client hung up: vLLM cancels such a request too
            engine.abort(req)
            raise
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(text)},
                "finish_reason": "length",
            }
            if chat
            else {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": "length"}
        )
        answer = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage(n_out),
        }
        if (params := connector.answer_params(body, req, rid)) is not None:
            answer["kv_transfer_params"] = params
        connector.stored(body)
        return web.json_response(answer)

    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list, **extra: object) -> bytes:
        payload = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(payload)}\n\n".encode()

    n_out = 0
    try:
        while (n := await queue.get()) is not None:
            if chat and n_out == 0:  # vLLM opens a chat stream with a role-only delta
                opening = {"role": "assistant", "content": ""}
                await response.write(event([{"index": 0, "delta": opening, "finish_reason": None}]))
            for _ in range(n):
                n_out += 1
                done = "length" if n_out == req.output_len else None
                delta = (
                    {"index": 0, "delta": {"content": piece(1)}, "finish_reason": done}
                    if chat
                    else {"index": 0, "text": piece(1), "logprobs": None, "finish_reason": done}
                )
                await response.write(event([delta]))
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            await response.write(event([], usage=usage(n_out)))
        await response.write(b"data: [DONE]\n\n")
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
    return await generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, chat=True)
