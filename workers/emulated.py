"""An emulated vLLM server: the simulator's engine model run in wall-clock time behind vLLM's
HTTP API and /metrics names, for load tests and fast tests where no real vLLM fits.

    python -m workers.emulated --port 8100 --model-dir DIR [--preset llama-3-8b --gpu a100-80g]
        [--kv-events ipc:///tmp/kv-0 [--kv-events-drop 0.5] [--kv-events-drop-after 100]]

The SimPy environment is driven from the asyncio loop: a driver task sleeps until the next
simulated event is due in wall time (`speed` x faster if asked), then steps it; an arriving
request first advances the simulation to "now", so it joins the engine at its real arrival time.
Tokens are random vocabulary pieces; timing, batching, prefix caching and preemption follow the
engine model, one event per step (no fast-forward: each step's tokens stream as it ends).
With `--kv-events` it publishes vLLM's KV events over ZMQ, and can lose some or all of them on
purpose (what a router's precise index must survive).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import sys
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import msgpack
import simpy
import zmq
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from policies.fcfs import FCFS
from router.cost_model import roofline
from router.proxy.catalog import Catalog
from router.proxy.errors import APIError
from router.proxy.openai_request import build_request, parse_body
from router.proxy.prompts import PromptEncoder
from router.proxy.settings import ProxySettings
from router.request import BlockHash, Request
from simulator.engine import Engine, EngineConfig, Seq


class VLLMMetrics:
    """The vllm:* series a router reads, with vLLM's names and labels."""

    def __init__(self, model: str, block_size: int, num_blocks: int) -> None:
        r = self.registry = CollectorRegistry()
        labels = ["engine", "model_name"]
        self.labels = ("0", model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1")
        self.queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up")
        self.hits = counter("vllm:prefix_cache_hits", "Prompt tokens found cached")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions")
        self.success = counter("vllm:request_success", "Finished requests")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT", labels, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "E2E latency", labels, registry=r)
        info = Gauge(
            "vllm:cache_config_info", "Cache config", ["block_size", "num_gpu_blocks"], registry=r
        )
        info.labels(str(block_size), str(num_blocks)).set(1)


class KVEventPublisher:
    """The engine's cache as vLLM's KV events: a ZMQ PUB socket sending (topic, 8-byte big-endian
    sequence number, msgpack [ts, events, dp_rank]), with `BlockStored` when a prompt block is
    computed and `BlockRemoved` when it is evicted (router/kv_events.py reads them).

    As vLLM, it names blocks by a hash of its own, seeded afresh in every process (a restarted
    vLLM names the same tokens differently), and each stored block carries its tokens.
    It loses `drop_share` of its batches after the first `drop_after` (or from a `drop()` on),
    as a lossy link would: a lost batch still takes its sequence number, so a subscriber can
    see the gap.
    """

    MAX_PROMPT_BLOCKS = 1 << 14  # tokens remembered for blocks not stored yet

    def __init__(
        self, endpoint: str, block_size: int, drop_share: float = 0.0, drop_after: int = 0
    ) -> None:
        self.block_size = block_size
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._salt = random.getrandbits(64)
        self._tokens: OrderedDict[BlockHash, list[int]] = OrderedDict()
        self._seq = itertools.count()
        self._rng = random.Random()
        self.drop_share, self.drop_after = drop_share, drop_after
        self.sent = self.dropped = 0

    def drop(self, share: float = 1.0) -> None:
        """Lose `share` of the batches from now on (0 delivers them all again)."""
        self.drop_share = share

    def learn(self, hashes: list[BlockHash], token_ids: list[int]) -> None:
        """A prompt's block hashes and tokens, for the BlockStored events its blocks cause."""
        bs = self.block_size
        for i, h in enumerate(hashes):
            self._tokens[h] = token_ids[i * bs : (i + 1) * bs]
            self._tokens.move_to_end(h)
        while len(self._tokens) > self.MAX_PROMPT_BLOCKS:
            self._tokens.popitem(last=False)

    def close(self) -> None:
        self._pub.close()
        self._ctx.term()

    # KVEventSink
    def stored(self, parent: BlockHash | None, hashes: list[BlockHash]) -> None:
        tokens = [self._tokens.get(h) for h in hashes]
        if any(t is None for t in tokens):
            return  # never seen a prompt with it (cannot happen while learn() sees each one)
        self._send(
            {
                "type": "BlockStored",
                "block_hashes": [self._name(h) for h in hashes],
                "parent_block_hash": None if parent is None else self._name(parent),
                "token_ids": [t for block in tokens for t in block],  # type: ignore[union-attr]
                "block_size": self.block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        )

    def removed(self, hashes: list[BlockHash]) -> None:
        names = [self._name(h) for h in hashes]
        self._send({"type": "BlockRemoved", "block_hashes": names, "medium": "GPU"})

    def _name(self, h: BlockHash) -> int:
        return h ^ self._salt

    def _send(self, event: dict) -> None:
        seq = next(self._seq)
        if seq >= self.drop_after and self.drop_share and self._rng.random() < self.drop_share:
            self.dropped += 1
            return
        payload = msgpack.packb([time.time(), [event], 0])
        with contextlib.suppress(zmq.Again):  # PUB drops at its high-water mark, never blocks
            self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        self.sent += 1


class RecordingEncoder(PromptEncoder):
    """The emulated server's tokenizer, telling the KV-event publisher each prompt's tokens."""

    publisher: KVEventPublisher | None = None

    def block_hashes(self, ids: list[int], root: BlockHash | None = None) -> list[BlockHash]:
        hashes = super().block_hashes(ids, root)
        if self.publisher is not None:
            self.publisher.learn(hashes, ids)
        return hashes


class WallClockEngine:
    """One simulated engine whose simulated seconds track wall-clock seconds (x `speed`)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        preset: str,
        gpu: str,
        speed: float = 1.0,
        kv_events: KVEventPublisher | None = None,
    ):
        self.env = simpy.Environment()
        self.speed = speed
        cost = roofline(preset, gpu)
        self.engine = Engine(self.env, 0, cost, engine_config, FCFS(), self, kv_events)
        self.streams: dict[int, asyncio.Queue[int | None]] = {}
        self.cached_tokens: dict[int, int] = {}  # request id -> prefix hit, until answered
        self.metrics: VLLMMetrics | None = None
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()
        self.counts_tokens = True  # EngineListener: deliver per-step tokens

    def sim_now(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    def submit(self, req: Request) -> asyncio.Queue[int | None]:
        self._catch_up()
        req.arrival = self.env.now
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.streams[req.id] = queue
        self.engine.submit(req)
        self._wake.set()
        return queue

    def abort(self, req: Request) -> None:
        """The client left: stop spending the engine's time on it."""
        self.streams.pop(req.id, None)
        self._catch_up()
        self.engine.abort(req.id)
        self._wake.set()

    def _catch_up(self) -> None:
        now = self.sim_now()
        if now > self.env.now:
            self.env.run(until=now)

    async def run(self) -> None:
        while True:
            due = self.env.peek()
            if due == math.inf:
                await self._wake.wait()
                self._wake.clear()
                continue
            delay = (due - self.sim_now()) / self.speed
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                self._wake.clear()
                continue
            self.env.step()

    # EngineListener
    def on_first_token(self, seq: Seq, now: float) -> None:
        self.cached_tokens[seq.req.id] = seq.num_cached_tokens or 0
        if self.metrics:
            m, labels = self.metrics, self.metrics.labels
            m.queries.labels(*labels).inc(seq.req.prompt_len)
            m.hits.labels(*labels).inc(seq.num_cached_tokens or 0)
            m.prompt_tokens.labels(*labels).inc(seq.req.prompt_len)
            m.ttft.labels(*labels).observe((now - seq.req.arrival) / self.speed)

    def on_tokens(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
        for seq in seqs:
            if (queue := self.streams.get(seq.req.id)) is not None:
                queue.put_nowait(num_tokens)
        if self.metrics:
            self.metrics.generation_tokens.labels(*self.metrics.labels).inc(num_tokens * len(seqs))

    def on_finish(self, seq: Seq, now: float) -> None:
        if (queue := self.streams.pop(seq.req.id, None)) is not None:
            queue.put_nowait(None)
        if self.metrics and seq.num_output >= seq.req.output_len:  # not aborted
            m = self.metrics
            m.success.labels(*m.labels).inc()
            m.e2e.labels(*m.labels).observe((now - seq.req.arrival) / self.speed)
            m.preemptions.labels(*m.labels).inc(seq.num_preemptions)


ENGINE = web.AppKey("engine", WallClockEngine)
ENCODER = web.AppKey("encoder", PromptEncoder)
KV_EVENTS = web.AppKey("kv_events", KVEventPublisher)
MODEL = web.AppKey("model", str)
LIMITS = web.AppKey("limits", ProxySettings)
CATALOG = web.AppKey("catalog", Catalog)
VOCAB = web.AppKey("vocab", list)


async def generate(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    try:  # the proxy's own validation: one definition of a well-formed request
        body = await parse_body(request, max_bytes=64 * 1024 * 1024)  # vLLM sets no limit
        req = build_request(request, body, app[CATALOG], app[LIMITS], chat)
    except APIError as e:
        return e.response()

    engine = app[ENGINE]
    queue = engine.submit(req)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
    created, model, vocab = int(time.time()), app[MODEL], app[VOCAB]
    rng = random.Random(req.id)

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
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage(n_out),
            }
        )

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


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def models(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": request.app[MODEL],
                    "object": "model",
                    "owned_by": "fairway-emulated",
                    "max_model_len": request.app[LIMITS].max_model_len,  # as vLLM's card has it
                }
            ],
        }
    )


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    m = engine.metrics
    assert m is not None
    e = engine.engine
    m.running.labels(*m.labels).set(len(e.running))
    m.waiting.labels(*m.labels).set(len(e.waiting))
    m.kv_usage.labels(*m.labels).set(e.blocks.num_used / e.blocks.num_blocks)
    return web.Response(
        body=generate_latest(m.registry), headers={"Content-Type": "text/plain; version=0.0.4"}
    )


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
) -> web.Application:
    """`kv_events`: a ZMQ endpoint to publish KV events on (bound); `kv_events_drop`: the share
    of them to lose once `kv_events_drop_after` batches went out."""
    app = web.Application()
    encoder = RecordingEncoder(model_dir, block_size)
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_kv_blocks, fast_forward=False)
    app[ENCODER] = encoder
    app[MODEL] = model_name
    app[LIMITS] = ProxySettings(model_name=model_name, max_model_len=encoder.max_model_len)
    app[CATALOG] = Catalog.single(model_name, encoder, encoder.max_model_len)
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
        engine = WallClockEngine(config, preset, gpu, speed, publisher)
        engine.metrics = VLLMMetrics(model_name, block_size, engine.engine.blocks.num_blocks)
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
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """As vLLM's endpoint of that name: drop every cached block no request is using."""
    engine = request.app[ENGINE]
    engine._catch_up()
    return web.json_response({"dropped_blocks": engine.engine.blocks.reset_prefix_cache()})


def command(
    port: int,
    model_dir: str | Path,
    model_name: str = "tiny",
    block_size: int = 128,
    preset: str = "llama-3-8b",
    gpu: str = "a100-80g",
    speed: float = 1.0,
) -> list[str]:
    """The argv that starts one emulated server (for the Ray pool and the benchmarks)."""
    return [sys.executable, "-m", "workers.emulated", "--port", str(port),
            "--model-dir", str(model_dir), "--served-model-name", model_name,
            "--block-size", str(block_size), "--preset", preset, "--gpu", gpu,
            "--speed", str(speed)]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="emulated vLLM server (Fairway's engine model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model-dir", required=True, help="folder with tokenizer.json")
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--gpu", default="a100-80g")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--kv-blocks", type=int)
    p.add_argument("--kv-events", help="ZMQ endpoint to publish vLLM KV events on")
    p.add_argument("--kv-events-drop", type=float, default=0.0, help="share of them to lose")
    p.add_argument("--kv-events-drop-after", type=int, default=0, help="batches sent first")
    args = p.parse_args(argv)
    app = create_app(
        args.model_dir,
        args.served_model_name,
        args.block_size,
        args.preset,
        args.gpu,
        args.speed,
        args.kv_blocks,
        args.kv_events,
        args.kv_events_drop,
        args.kv_events_drop_after,
    )
    # A client that hangs up cancels its handler, as in vLLM (which aborts the request then).
    web.run_app(
        app, host=args.host, port=args.port, print=None, access_log=None,
        handler_cancellation=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
