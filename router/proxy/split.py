"""Split prefill and decode at the proxy: the bodies each stage is sent, in vLLM's own
disaggregated protocol (its disaggregated-serving proxy example and KV connectors).

    client's body ─┬─▶ prefill worker: max_tokens 1 (max_completion_tokens 1 if given),
                   │     stream false, no stream_options, no min_tokens; and for a handshake
                   │     connector, kv_transfer_params asking for a remote decode
                   │   ◀── its answer: kv_transfer_params naming where the KV waits
                   └─▶ decode worker: the client's body as it came (its stream, its limits),
                         with those kv_transfer_params (handshake), or without (shared)

Two shapes of connector:

- `handshake` (vLLM's NixlConnector and its kind): the prefill server keeps the prompt's KV
  blocks and says where they are (engine, host, port, block ids); the decode server pulls
  them from there. Its answer's `kv_transfer_params` must reach the decode request.
- `shared` (vLLM's ExampleConnector, LMCache with a shared store): the prefill server stores
  the KV under the prompt in a place both reach; the decode server finds it by the prompt
  alone. No parameters are passed.

A client's own `kv_transfer_params` (or `ec_transfer_params`, the encoder cache's) never
reaches a worker: given to a decode server it names a host to pull KV from, so a client
could point a worker at any address. The proxy drops them silently, as it drops a client's
`priority` for a worker that does not schedule by it: a request that carries them is
otherwise valid, and vLLM's own clients never need to send them through a router.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import orjson

from router.proxy.sse import Usage, chat_usage

HANDSHAKE, SHARED = "handshake", "shared"
SHAPES = (HANDSHAKE, SHARED)
KV_TRANSFER = "kv_transfer_params"
# Parameters that steer a worker's transfers: only the proxy may set them.
PROXY_ONLY = (KV_TRANSFER, "ec_transfer_params")
# What vLLM's disaggregated proxy asks a prefill server for: keep the KV for a remote decode.
REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Dropped from a prefill request: it streams nothing and stops after one token (a minimum
# above one would be refused).
_NOT_FOR_PREFILL = ("stream", "stream_options", "min_tokens", "min_completion_tokens", *PROXY_ONLY)


def client_body(body: dict) -> dict:
    """`body` without the fields only the proxy may set (PROXY_ONLY)."""
    if KV_TRANSFER in body or "ec_transfer_params" in body:
        return {k: v for k, v in body.items() if k not in PROXY_ONLY}
    return body


def prefill_body(body: dict, shape: str, limit: str = "max_tokens") -> dict:
    """The prefill stage's body from the one the decode stage gets; `limit`: the API's output
    limit field (max_output_tokens for the Responses API)."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out[limit] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    if shape == HANDSHAKE:
        out[KV_TRANSFER] = dict(REMOTE_DECODE)
    return out


def decode_body(body: dict, params: dict | None) -> dict:
    """The decode stage's body: the client's, with the prefill's transfer parameters."""
    return body if params is None else {**body, KV_TRANSFER: params}


def prefill_answer(
    data: bytes, shape: str, usage_of: Callable[[object], Usage | None] = chat_usage
) -> tuple[dict | None, int | None]:
    """(kv_transfer_params for the decode request, cached prompt tokens the prefill server
    reported) from its answer, its usage read as its API words it (`usage_of`: apis.py). A
    handshake answer without parameters (a server started without its connector) gives None:
    the decode server then computes the prompt itself, slower but the same answer."""
    answer: dict = {}
    with contextlib.suppress(ValueError):
        parsed = orjson.loads(data)
        if isinstance(parsed, dict):
            answer = parsed
    usage = usage_of(answer)
    cached = None if usage is None else usage.cached_tokens
    if shape != HANDSHAKE:
        return None, cached
    params = answer.get(KV_TRANSFER)
    return (params if isinstance(params, dict) and params else None), cached
