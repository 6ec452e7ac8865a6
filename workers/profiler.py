"""`fairway profile`: time a running OpenAI-compatible server (vLLM, or the emulated one) and fit
the simulator's step-cost model to it (`simulator.cost_model.FittedCost`).

Prompts are random token ids, so nothing hits the prefix cache, and `ignore_eos` makes every
answer as long as asked. Two kinds of measurement:
- prefill: one request at a time, a prompt of L tokens answered with one token. Its wall time
  is one prefill step plus what the request costs around it (HTTP, tokenizing, scheduling).
- decode: B streams started together, each a prompt of P tokens and N answer tokens. Once every
  prefill is done, the gap between a stream's consecutive events is one decode step of B
  sequences; a stream's mean gap over its middle half is taken (robust to events read
  together), the median over the streams. Short and long P tell
  the cost of reading the KV cache apart from the per-step cost (prefills alone cannot: their
  tokens and KV reads grow together).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.monitor import kv_cache_blocks
from simulator.cost_model import FittedCost, Measurement, StepShape

PREFILL_LENGTHS = (16, 64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_PROMPTS = (32, 1024)
DECODE_TOKENS = 48


class Profiler:
    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url.rstrip("/")
        self.session = session
        # Seeded by the OS, not a fixed seed: a second profile of the same server must not find
        # the first one's prompts in its prefix cache.
        self.rng = random.Random()
        self.model = ""
        self.max_model_len = 2048

    async def describe(self) -> None:
        async with self.session.get(f"{self.url}/v1/models") as r:
            r.raise_for_status()
            card = (await r.json())["data"][0]
        self.model = card["id"]
        self.max_model_len = int(card.get("max_model_len") or self.max_model_len)

    async def kv_capacity_tokens(self) -> int:
        async with self.session.get(f"{self.url}/metrics") as r:
            r.raise_for_status()
            text = await r.text()
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:cache_config_info":
                blocks = kv_cache_blocks(family.samples)
                if blocks is not None:
                    return blocks[0] * blocks[1]
        raise ValueError(f"{self.url}/metrics has no vllm:cache_config_info with the KV size")

    def _body(self, prompt_len: int, max_tokens: int, stream: bool) -> dict:
        prompt = [self.rng.randrange(10, 1000) for _ in range(prompt_len)]
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": True, "stream": stream, "temperature": 0}  # fmt: skip

    async def prefill(self, prompt_len: int) -> Measurement:
        started = time.perf_counter()
        async with self.session.post(
            f"{self.url}/v1/completions", json=self._body(prompt_len, 1, stream=False)
        ) as r:
            r.raise_for_status()
            await r.read()
        return Measurement(StepShape.prefill(prompt_len, 0), time.perf_counter() - started, True)

    async def _stream_stamps(self, body: dict) -> list[float]:
        stamps = []
        async with self.session.post(f"{self.url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.content:
                if line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                    stamps.append(time.perf_counter())  # a token (not the usage event)
        return stamps

    async def decode(self, batch: int, prompt_len: int) -> Measurement:
        bodies = [self._body(prompt_len, DECODE_TOKENS, stream=True) for _ in range(batch)]
        streams = await asyncio.gather(*(self._stream_stamps(b) for b in bodies))
        # Over the middle half of each stream (all B surely decoding), the mean step: events
        # read together (a busy client) bend single gaps, not the span of many.
        start, stop = DECODE_TOKENS // 4, 3 * DECODE_TOKENS // 4
        if any(len(s) <= stop for s in streams):
            lengths = sorted({len(s) for s in streams})
            raise ValueError(
                f"{self.url}: streams of {DECODE_TOKENS} tokens ended after {lengths} events; "
                f"the server must honour ignore_eos (vLLM does)"
            )
        steps = [(s[stop] - s[start]) / (stop - start) for s in streams]
        context = batch * (prompt_len + DECODE_TOKENS // 2)
        return Measurement(StepShape(batch, context, context), statistics.median(steps), False)


async def measure(url: str, repeats: int = 2) -> tuple[str, int, list[Measurement]]:
    """(model name, KV capacity in tokens, measurements) of the server at `url`."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        p = Profiler(url, session)
        await p.describe()
        capacity = await p.kv_capacity_tokens()
        await p.prefill(16)  # warm-up, not kept
        measurements = []
        for _ in range(repeats):
            for length in PREFILL_LENGTHS:
                if length + 1 < p.max_model_len:
                    measurements.append(await p.prefill(length))
            for prompt_len in DECODE_PROMPTS:
                if prompt_len + DECODE_TOKENS < p.max_model_len:
                    for batch in DECODE_BATCHES:
                        measurements.append(await p.decode(batch, prompt_len))
        return p.model, capacity, measurements


def profile(url: str, repeats: int = 2) -> tuple[FittedCost, list[Measurement]]:
    model, capacity, measurements = asyncio.run(measure(url, repeats))
    return FittedCost.fit(measurements, capacity, f"fitted:{model}@{url}"), measurements
