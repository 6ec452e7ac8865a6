"""An OpenAI request body, checked and turned into the router's Request.

One definition of a well-formed request, shared by the proxy and the emulated worker: the body
is parsed, the model and lengths checked, the prompt tokenized and hashed, the client named.
Every rejection is an APIError in the OpenAI shape.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import TYPE_CHECKING

from aiohttp import web

from router.errors import APIError, bad_request
from router.prompts import PromptEncoder, PromptError
from router.request import Request

if TYPE_CHECKING:
    from router.proxy import ProxySettings

_request_ids = itertools.count()


def client_identity(request: web.Request, body: dict) -> str:
    """Who to be fair to: X-Client-Id, else the OpenAI `user` field, else the API key."""
    if cid := request.headers.get("X-Client-Id"):
        return cid
    if isinstance(body.get("user"), str) and body["user"]:
        return body["user"]
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer ") and len(auth) > 7:
        return "key:" + auth[7:][-8:]  # the key's tail: tells tenants apart, not a secret
    return "anonymous"


async def parse_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad_request("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def build_request(
    http: web.Request, body: dict, encoder: PromptEncoder, s: ProxySettings, chat: bool
) -> Request:
    model = body.get("model")
    if not isinstance(model, str):
        raise bad_request("'model' is required", "model")
    if model != s.model_name:
        raise APIError(
            404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found"
        )
    try:
        if chat:
            ids = encoder.chat_ids(body.get("messages"))
        else:
            if "prompt" not in body:
                raise bad_request("'prompt' is required", "prompt")
            ids = encoder.completion_ids(body["prompt"])
    except PromptError as e:
        raise bad_request(str(e), e.param) from None
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = s.max_model_len - len(ids) if chat else s.default_max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise bad_request(f"'{key}' must be a positive integer", key)
    if len(ids) + max_tokens > s.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {s.max_model_len} tokens. However, you "
            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length.",
            key,
        )
    if max_tokens <= 0 or len(ids) == 0:
        raise bad_request("the prompt is empty", "prompt")
    weight = http.headers.get("X-Client-Weight")
    try:
        w = float(weight) if weight else 1.0
    except ValueError:
        raise bad_request("X-Client-Weight must be a number") from None
    if w <= 0:
        raise bad_request("X-Client-Weight must be positive")
    return Request(
        id=next(_request_ids),
        arrival=time.monotonic(),
        prompt_len=len(ids),
        output_len=max_tokens,
        block_hashes=encoder.block_hashes(ids),
        client=client_identity(http, body),
        weight=w,
    )
