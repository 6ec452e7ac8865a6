"""One emulated server's application: its tokenizer, engine settings, KV connector, adapters
and KV-event publisher built from its settings, and its routes mounted."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from aiohttp import web

from policies.fcfs import FCFS
from router.bands import Banded
from router.cost_model import MODELS
from router.proxy.catalog import Catalog
from router.proxy.errors import APIError
from router.proxy.settings import ProxySettings
from simulator.engine import EngineConfig
from simulator.topology import Topology
from workers.emulated import routes
from workers.emulated.adapters import ADAPTER_LOAD_TIME, Adapters
from workers.emulated.completions import (
    chat_completions,
    chat_completions_batch,
    completions,
    messages,
    responses,
)
from workers.emulated.engine import WallClockEngine
from workers.emulated.kv_events import KVEventPublisher, RecordingEncoder
from workers.emulated.metrics import VLLMMetrics
from workers.emulated.realtime import realtime
from workers.emulated.split import Connector
from workers.emulated.state import (
    ADAPTERS,
    CATALOG,
    CONNECTOR,
    ENCODER,
    ENGINE,
    KV_EVENTS,
    LIMITS,
    MODEL,
    MODEL_DIR,
    PRIORITY_SCHEDULING,
    VOCAB,
)


@web.middleware
async def fastapi_not_found(request: web.Request, handler) -> web.StreamResponse:
    """A path the server has no route for, answered as vLLM's server (FastAPI) answers it."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404, dumps=_compact)


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def create_app(
    model_dir: str | Path,
    model_name: str,
    block_size: int = 128,
    preset: str = "llama-3-8b",
    gpu: str = "a100-80g",
    speed: float = 1.0,
    num_kv_blocks: int | None = None,
    kv_events: str | None = None,
    kv_events_drop: float = 0.0,
    kv_events_drop_after: int = 0,
    enable_lora: bool = False,
    max_loras: int = 4,
    adapter_load_time: float = ADAPTER_LOAD_TIME,
    lora_modules: dict[str, str] | None = None,
    scheduling_policy: str = "fcfs",
    role: str = "mixed",
    kv_shape: str = "handshake",
    kv_shared_dir: str | Path | None = None,
    topology: str | None = None,
    topology_gpu: int = 0,
    topology_gpus: int = 1,
    port: int = 0,
) -> web.Application:
    """`kv_events`: a ZMQ endpoint to publish KV events on (bound); `kv_events_drop`: the share
    of them to lose once `kv_events_drop_after` batches went out. `enable_lora`: serve LoRA
    adapters, `max_loras` resident at once, each load adding `adapter_load_time` simulated
    seconds to its step; `lora_modules` (name -> folder) registered at start (a ValueError if
    one is not an adapter, as vLLM will not start then). `scheduling_policy`: "fcfs", or
    "priority" (vLLM's: the waiting queue by priority, the lowest-priority victim).
    `role` (mixed, prefill, decode) and `kv_shape` (handshake, shared; `kv_shared_dir` its
    folder): its KV connector on a split fleet; `topology` (a preset or a YAML file) of
    `topology_gpus` GPUs, this server on `topology_gpu`: the network its transfers are timed
    on (none: instant); `port`: the one it serves on, named in its handshakes."""
    if lora_modules and not enable_lora:
        raise ValueError("LoRA modules need LoRA enabled (--enable-lora)")
    if enable_lora and max_loras < 1:
        raise ValueError("max_loras must be at least 1")  # 0 would turn the engine's slots off
    if scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"scheduling policy {scheduling_policy!r}: fcfs or priority")
    by_priority = scheduling_policy == "priority"
    app = web.Application(middlewares=[fastapi_not_found])
    encoder = RecordingEncoder(model_dir, block_size)
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        fast_forward=False,
        adapter_slots=max_loras if enable_lora else 0,
        adapter_load_time=adapter_load_time,
        priority_preemption=by_priority,
    )
    app[ENCODER] = encoder
    app[PRIORITY_SCHEDULING] = by_priority
    app[CONNECTOR] = Connector(
        role,
        kv_shape,
        Topology.named(topology, topology_gpus) if topology else None,
        topology_gpu,
        kv_shared_dir,
        MODELS[preset].kv_bytes_per_token,
        block_size,
        port=port,
    )
    app[MODEL] = model_name
    app[MODEL_DIR] = str(model_dir)
    app[LIMITS] = ProxySettings(model_name=model_name, max_model_len=encoder.max_model_len)
    catalog = app[CATALOG] = Catalog.single(model_name, encoder, encoder.max_model_len)
    adapters = app[ADAPTERS] = Adapters(catalog, model_name)
    for name, path in (lora_modules or {}).items():
        try:
            adapters.load(name, path)
        except APIError as e:
            raise ValueError(e.message) from None
    size = min(2000, encoder.tokenizer.get_vocab_size())
    vocab = [encoder.tokenizer.decode([i]) for i in range(size)]
    app[VOCAB] = [v for v in vocab if v.strip()] or ["x"]

    async def engine_ctx(app: web.Application):
        publisher = None
        if kv_events:
            publisher = KVEventPublisher(
                kv_events, block_size, kv_events_drop, kv_events_drop_after
            )
            app[KV_EVENTS] = publisher
            encoder.publisher = publisher
        waiting = Banded(FCFS) if by_priority else FCFS()
        engine = WallClockEngine(config, preset, gpu, speed, publisher, waiting)
        num_blocks = engine.engine.blocks.num_blocks
        lora = max_loras if enable_lora else None
        engine.metrics = VLLMMetrics(model_name, block_size, num_blocks, lora)
        app[ENGINE] = engine
        task = asyncio.create_task(engine.run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if publisher is not None:
            encoder.publisher = None
            publisher.close()

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/chat/completions/batch", chat_completions_batch)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", routes.count_tokens)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_get("/v1/realtime", realtime)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_post("/reset_prefix_cache", routes.reset_prefix_cache)
    load, unload = (
        (routes.load_lora_adapter, routes.unload_lora_adapter)
        if enable_lora
        else (routes.lora_off, routes.lora_off)
    )
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
    return app
