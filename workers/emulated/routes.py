"""The emulated server's endpoints besides generation, as vLLM answers them: /health,
/v1/models, /metrics, /reset_prefix_cache, the LoRA adapters' load and unload, /tokenize,
/detokenize and Anthropic's /v1/messages/count_tokens."""

from __future__ import annotations

from aiohttp import web

from router.proxy.apis import CHAT, COMPLETIONS, MESSAGES
from router.proxy.errors import ANTHROPIC, APIError, bad_request
from router.proxy.openai_request import parse_body
from router.proxy.prompts import PromptError
from workers.emulated.state import ADAPTERS, CATALOG, ENGINE, LIMITS, MODEL, MODEL_DIR


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def models(request: web.Request) -> web.Response:
    """vLLM's list: the base model, then each adapter in load order with the base as parent
    (max_model_len: the base's, an adapter's null)."""
    app = request.app
    base = app[MODEL]
    card = {"object": "model", "owned_by": "fairway-emulated"}
    max_model_len = app[LIMITS].max_model_len
    cards: list[dict[str, object]] = [
        {**card, "id": base, "root": app[MODEL_DIR], "parent": None, "max_model_len": max_model_len}
    ]
    cards += [
        {**card, "id": name, "root": path, "parent": base, "max_model_len": None}
        for name, (_, path) in app[ADAPTERS].loaded.items()
    ]
    return web.json_response({"object": "list", "data": cards})


async def load_lora_adapter(request: web.Request) -> web.Response:
    try:
        body = await parse_body(request)
        name, path = _string(body, "lora_name"), _string(body, "lora_path")
        request.app[ADAPTERS].load(name, path, body.get("load_inplace") is True)
    except APIError as e:
        return e.response()
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    try:
        name = _string(await parse_body(request), "lora_name")
        request.app[ADAPTERS].unload(name)
    except APIError as e:
        return e.response()
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def lora_off(request: web.Request) -> web.Response:
    """What vLLM answers on the LoRA routes it has not mounted (no runtime LoRA updating)."""
    return web.json_response({"detail": "Not Found"}, status=404)


def _string(body: dict, key: str) -> str:
    """A required string field, refused as vLLM's request validation (pydantic) refuses it."""
    value = body.get(key)
    if isinstance(value, str):
        return value
    kind, msg = (
        ("missing", "Field required")
        if value is None
        else ("string_type", "Input should be a valid string")
    )
    message = f"1 validation error:\n  {{'type': '{kind}', 'loc': 'body.{key}', 'msg': '{msg}'}}"
    raise APIError(400, message, "Bad Request", f"body.{key}")


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    assert engine.metrics is not None
    return web.Response(
        body=engine.metrics.page(engine.engine),
        headers={"Content-Type": "text/plain; version=0.0.4"},
    )


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """As vLLM's endpoint of that name: drop every cached block no request is using."""
    dropped = request.app[ENGINE].reset_prefix_cache()
    return web.json_response({"dropped_blocks": dropped})


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's count_tokens, as vLLM answers it: the prompt's tokens, the template's."""
    try:
        body = await parse_body(request)
        served = request.app[CATALOG].resolve(str(body.get("model")))
        ids = MESSAGES.prompts(served.encoder, body, served.max_model_len)[0]
    except PromptError as e:
        return bad_request(str(e), e.param).response(ANTHROPIC)
    except APIError as e:
        return e.response(ANTHROPIC)
    return web.json_response(
        {"input_tokens": len(ids), "context_management": {"original_input_tokens": len(ids)}}
    )


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a `prompt` (special tokens added) or chat `messages` (templated)."""
    try:
        body = await parse_body(request)
        served = request.app[CATALOG].resolve(str(body.get("model", request.app[MODEL])))
        api = CHAT if "messages" in body else COMPLETIONS
        ids = api.prompts(served.encoder, body, served.max_model_len)[0]
    except PromptError as e:
        return bad_request(str(e), e.param).response()
    except APIError as e:
        return e.response()
    return web.json_response(
        {
            "count": len(ids),
            "max_model_len": served.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    try:
        body = await parse_body(request)
        served = request.app[CATALOG].resolve(str(body.get("model", request.app[MODEL])))
        ids = served.encoder.check_ids(body.get("tokens") or [], served.max_model_len, "tokens")
    except PromptError as e:
        return bad_request(str(e), e.param).response()
    except APIError as e:
        return e.response()
    return web.json_response(
        {"prompt": served.encoder.tokenizer.decode(ids, skip_special_tokens=False)}
    )
