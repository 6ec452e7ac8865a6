"""`fairway profile`: time a running OpenAI-compatible server (vLLM, or the emulated one) and fit
the simulator's step-cost model to it (`router.cost_model.FittedCost`).

Prompts are random token ids, so nothing hits the prefix cache unless a measurement asks for it,
and `ignore_eos` makes every answer as long as asked. Three kinds of measurement:
- prefill: one request at a time, a prompt of L tokens answered with one token. Its wall time
  is one prefill step plus what the request costs around it (HTTP, tokenizing, scheduling).
  vLLM also times the step itself (its prefill-time histogram, read before and after): both
  are kept, so the fit tells the request's overhead from the step's own fixed cost (from wall
  times alone the two are nearly collinear, and the overhead came out anywhere in 15-160 ms).
- prefill after a cached prefix: the same prompt again with T new tokens after it, so the
  step reads L cached tokens while it computes T (what a prefix hit costs).
- decode: B streams started together, each a prompt of P tokens and N answer tokens, B x P
  within one step's token budget (`ONE_STEP_TOKENS`; a longer P is cut to fit). Where vLLM
  times its requests (its decode-time histogram: first token to last, engine timestamps), a
  step-long prompt is started first and the streams are sent while it runs, so they wait,
  prefill together in the next step and decode together to the end: their decode times sum
  to B x (N - 1) decode steps of B sequences, whenever a busy client or API server happens to
  read or send the events (the emulated server exports the same histograms). Elsewhere, from
  the client's clock: while every stream decodes (after the last first token, before the
  first stream ends), each token is one decode step of B sequences; a stream's time per token
  over that span is taken, the median over the streams. A span, not single gaps: a client or
  API server held off the CPU reads or sends events in bursts (vLLM then merges tokens into
  one event), which bends gaps, not the span of many (though a client held off for most of
  the span still reads it all at once: on a loaded 2-core machine, half the client-timed
  decode steps came out as bursts).
  Short and long P tell the cost of reading the KV cache apart from the per-step cost
  (prefills alone cannot: their tokens and KV reads grow together), and several B tell a
  decoding sequence's own cost (`per_decode_seq`) apart from both.

Prefill steps alone price prefill tokens and attention; decode steps alone price decoding
sequences. A decode token costs differently from a prefill token (one pass over the weights
serves the whole batch, and each sequence is sampled and sent on its own), so the fit prices
them apart and needs both kinds: `Plan` always has prefills and at least two decode batch sizes.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import random
import statistics
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.cost_model import FittedCost, Measurement, StepShape
from router.proxy.monitor import kv_cache_blocks

PREFILL_LENGTHS = (16, 64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_PROMPTS = (32, 1024)
DECODE_TOKENS = 48
CACHED_TAIL = 128  # new tokens after a cached prefix
PREFILL_METRIC = "vllm:request_prefill_time_seconds"  # first step to first token, engine-side
DECODE_METRIC = "vllm:request_decode_time_seconds"  # first token to last, engine-side
RUNNING_METRIC = "vllm:num_requests_running"
# Prompt tokens one step surely takes: vLLM's token budget on CPU (its GPU defaults are larger).
ONE_STEP_TOKENS = 2048
HOLD_POLLS = 250  # looks at RUNNING_METRIC, 2 ms apart, for the step-long prompt to start


@dataclass(frozen=True)
class Plan:
    """What to measure. The default covers the whole model length; `for_prompts` focuses on
    the prompt lengths a workload has (a linear fit is best where it was measured)."""

    prefill_lengths: tuple[int, ...] = PREFILL_LENGTHS
    cached_prefill: bool = True  # after each prefill, its prompt again with CACHED_TAIL more
    decode_batches: tuple[int, ...] = DECODE_BATCHES
    decode_prompts: tuple[int, ...] = DECODE_PROMPTS
    decode_tokens: int = DECODE_TOKENS

    def __post_init__(self) -> None:
        if not self.prefill_lengths or len(set(self.decode_batches)) < 2:
            raise ValueError(
                "profile plan: prefill lengths and two or more decode batch sizes are needed "
                f"to price decode apart from prefill, got {self}"
            )

    @classmethod
    def for_prompts(cls, longest: int, quick: bool = False) -> Plan:
        """Prefills up to `longest` tokens (and `longest` itself, up to whole blocks of 128),
        decodes at short and long context; `quick` halves the points (for tests)."""
        lengths = [n for n in PREFILL_LENGTHS if n < longest] + [-(-longest // 128) * 128]
        if quick:
            lengths = lengths[::-2][::-1]  # every other, keeping the longest
        return cls(
            prefill_lengths=tuple(lengths),
            decode_batches=(1, 4, 16) if quick else DECODE_BATCHES,
            decode_prompts=(32, max(32, min(longest, 1024))),
            decode_tokens=32 if quick else DECODE_TOKENS,
        )


class Profiler:
    """Times the server at `url`; its vLLM metrics (KV size, prefill timing) are read from
    `metrics_url` (default: the same server; another when `url` is a proxy in front of it)."""

    def __init__(
        self, url: str, session: aiohttp.ClientSession, metrics_url: str | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.metrics_url = (metrics_url or url).rstrip("/")
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
        async with self.session.get(f"{self.metrics_url}/metrics") as r:
            r.raise_for_status()
            text = await r.text()
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:cache_config_info":
                blocks = kv_cache_blocks(family.samples)
                if blocks is not None:
                    return blocks[0] * blocks[1]
        raise ValueError(
            f"{self.metrics_url}/metrics has no vllm:cache_config_info with the KV size"
        )

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 1000) for _ in range(n)]

    def _body(self, prompt: int | list[int], max_tokens: int, stream: bool) -> dict:
        if isinstance(prompt, int):
            prompt = self._tokens(prompt)
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
            "temperature": 0,
        }

    async def _scrape(self, *families: str) -> dict[str, float]:
        """The samples of these metric families ({sample name: value summed over labels}: a
        histogram's NAME_sum and NAME_count, a gauge's NAME); what the server lacks is absent."""
        async with self.session.get(f"{self.metrics_url}/metrics") as r:
            r.raise_for_status()
            text = await r.text()
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name in families:
                for sample in family.samples:
                    found[sample.name] = found.get(sample.name, 0.0) + sample.value
        return found

    async def server_seconds(self, metric: str) -> tuple[float, float] | None:
        """vLLM's own timing `metric` so far (sum of seconds, count of requests), from its
        engine timestamps; None when the server does not export it."""
        found = await self._scrape(metric)
        total, count = found.get(f"{metric}_sum"), found.get(f"{metric}_count")
        return None if total is None or count is None else (total, count)

    async def _answer(self, prompt: list[int]) -> None:
        async with self.session.post(
            f"{self.url}/v1/completions", json=self._body(prompt, 1, stream=False)
        ) as r:
            r.raise_for_status()
            await r.read()

    async def _hold_engine(self) -> asyncio.Task[None]:
        """Starts a prompt of one step's tokens and returns once the engine runs it (as far as
        its running gauge tells, looked at up to HOLD_POLLS times): what is sent now waits for
        that step, and then starts together."""
        hold = asyncio.create_task(
            self._answer(self._tokens(min(ONE_STEP_TOKENS, self.max_model_len - 2)))
        )
        for _ in range(HOLD_POLLS):
            running = (await self._scrape(RUNNING_METRIC)).get(RUNNING_METRIC)
            if running is None or running >= 1 or hold.done():
                break
            await asyncio.sleep(0.002)
        return hold

    async def _timed(self, prompt: list[int]) -> tuple[float, float | None, int]:
        """Seconds for `prompt` answered with one token, the server's own prefill seconds
        (None if it does not say), and the tokens it found cached."""
        before = await self.server_seconds(PREFILL_METRIC)
        started = time.perf_counter()
        async with self.session.post(
            f"{self.url}/v1/completions", json=self._body(prompt, 1, stream=False)
        ) as r:
            r.raise_for_status()
            usage = (await r.json()).get("usage") or {}
        seconds = time.perf_counter() - started
        after = await self.server_seconds(PREFILL_METRIC) if before is not None else None
        step = None
        if before is not None and after is not None and after[1] - before[1] == 1:
            step = after[0] - before[0]  # this request's alone: they go one at a time
        details = usage.get("prompt_tokens_details") or {}
        return seconds, step, int(details.get("cached_tokens") or 0)

    async def prefill(self, prompt_len: int, cached_tail: int = 0) -> list[Measurement]:
        """A cold prefill of `prompt_len` tokens; with `cached_tail`, then the same prompt
        with that many tokens more, its prefix cached by the first (the cached length is what
        the server reports, whole blocks). Each is measured whole (its step and the request's
        overhead) and, when the server times its own prefills (vLLM), as the step alone:
        the pair tells the overhead apart from the step's fixed cost."""
        prompt = self._tokens(prompt_len)
        shapes = [(prompt, StepShape.prefill(prompt_len, 0))]
        if cached_tail and prompt_len + cached_tail + 1 < self.max_model_len:
            shapes.append((prompt + self._tokens(cached_tail), None))
        out = []
        for tokens, shape in shapes:
            seconds, step, cached = await self._timed(tokens)
            shape = shape or StepShape.prefill(len(tokens) - cached, cached)
            out.append(Measurement(shape, seconds, True))
            if step is not None:
                out.append(Measurement(shape, step, False))
        return out

    async def _stream_stamps(self, body: dict) -> list[tuple[float, int]]:
        """(arrival time, tokens so far) of each event of a stream. A server falling behind
        merges tokens into fewer events (vLLM does), so events are not tokens: the count is
        the usage vLLM sends with each event (`continuous_usage_stats`), else one per event."""
        body = {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        stamps: list[tuple[float, int]] = []
        async with self.session.post(f"{self.url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("choices"):  # tokens (not the final usage event)
                    usage = event.get("usage") or {}
                    count = usage.get("completion_tokens") or (stamps[-1][1] + 1 if stamps else 1)
                    stamps.append((time.perf_counter(), int(count)))
        return stamps

    async def decode(self, batch: int, prompt_len: int, tokens: int = DECODE_TOKENS) -> Measurement:
        """`batch` streams of `prompt_len` prompt and `tokens` answer tokens: the time of one
        decode step of `batch` sequences, timed by vLLM where it can be (see the module)."""
        bodies = [self._body(prompt_len, tokens, stream=True) for _ in range(batch)]
        before = await self.server_seconds(DECODE_METRIC)
        engine_timed = before is not None and batch * prompt_len <= ONE_STEP_TOKENS
        hold = await self._hold_engine() if engine_timed else None
        streams = await asyncio.gather(*(self._stream_stamps(b) for b in bodies))
        if hold is not None:
            await hold
        after = await self.server_seconds(DECODE_METRIC) if engine_timed else None
        if any(not s or s[-1][1] < tokens for s in streams):
            counts = sorted({s[-1][1] if s else 0 for s in streams})
            raise ValueError(
                f"{self.url}: streams of {tokens} tokens ended after {counts}; "
                f"the server must honour ignore_eos (vLLM does)"
            )
        context = batch * (prompt_len + tokens // 2)
        shape = StepShape.decode(batch, context)
        # The batch's requests and the hold (its one token: no decode time) and nothing else.
        if before is not None and after is not None and after[1] - before[1] in (batch, batch + 1):
            return Measurement(shape, (after[0] - before[0]) / (batch * (tokens - 1)), False)
        steps = decode_steps(streams)
        if not steps:  # no span had every stream decoding: each stream from its first token
            steps = [x for s in streams if (x := _step(s, s[0][0] - 1, s[-1][0])) is not None]
        if not steps:
            raise ValueError(f"{self.url}: no stream of {batch} had two events apart in time")
        return Measurement(shape, statistics.median(steps), False)


def decode_steps(streams: list[list[tuple[float, int]]], min_steps: int = 4) -> list[float]:
    """Each stream's seconds per token while all of them decode: from its first event after
    the last stream's first token to its last event before the first stream's end.

        stream 1  x . . . . . . . . . . x|          x first token, . decoded, | its end
        stream 2      x . . . . . . . . . . . x|
                      ^ all decoding    ^ first end: the span is in between
    """
    start, stop = max(s[0][0] for s in streams), min(s[-1][0] for s in streams)
    steps = [_step(s, start, stop, min_steps) for s in streams]
    return [x for x in steps if x is not None]


def _step(
    stamps: list[tuple[float, int]], start: float, stop: float, min_steps: int = 1
) -> float | None:
    times = [t for t, _ in stamps]
    i, j = bisect.bisect_right(times, start), bisect.bisect_right(times, stop) - 1
    if j <= i or stamps[j][1] - stamps[i][1] < min_steps or stamps[j][0] <= stamps[i][0]:
        return None  # too short, or all read in one burst
    return (stamps[j][0] - stamps[i][0]) / (stamps[j][1] - stamps[i][1])


async def measure(
    url: str, repeats: int = 2, plan: Plan = Plan(), metrics_url: str | None = None
) -> tuple[str, int, list[Measurement]]:
    """(model name, KV capacity in tokens, measurements) of the server at `url` (or of the
    one server behind it, whose vLLM metrics are at `metrics_url`)."""
    timeout = aiohttp.ClientTimeout(total=600)
    # Idle connections closed before the server's keep-alive ends (uvicorn's: 5 s), or a
    # request can go out on one the server is closing: "Server disconnected".
    connector = aiohttp.TCPConnector(keepalive_timeout=2.0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        p = Profiler(url, session, metrics_url)
        await p.describe()
        capacity = await p.kv_capacity_tokens()
        await p.prefill(16)  # warm-up, not kept
        measurements = []
        tail = CACHED_TAIL if plan.cached_prefill else 0
        for _ in range(repeats):
            for length in plan.prefill_lengths:
                if length + 1 < p.max_model_len:
                    measurements += await p.prefill(length, tail)
            for prompt_len in plan.decode_prompts:
                if prompt_len + plan.decode_tokens < p.max_model_len:
                    for batch in plan.decode_batches:
                        # Prompts cut to prefill in one step, so the streams start together.
                        prompt = min(prompt_len, ONE_STEP_TOKENS // batch)
                        measurements.append(await p.decode(batch, prompt, plan.decode_tokens))
        return p.model, capacity, measurements


def profile(
    url: str, repeats: int = 2, plan: Plan = Plan()
) -> tuple[FittedCost, list[Measurement]]:
    model, capacity, measurements = asyncio.run(measure(url, repeats, plan))
    return fit(measurements, capacity, f"fitted:{model}@{url}"), measurements


def fit(
    measurements: list[Measurement], capacity: int, name: str, trim: float = 0.25
) -> FittedCost:
    """The step-cost model, robust to a shared machine and fitted for relative error.

    1. Plain least squares in seconds (`FittedCost.fit`), as a reference.
    2. Drop what the reference predicts worst, beyond 3x the median relative error (at most
       `trim` of the measurements): a step stalled behind another process, or a stream read
       in one burst (a decode "step" of microseconds).
    3. Refit the rest weighted by one over the reference's prediction, so a 1 s prefill and a
       10 ms decode step count alike (in seconds the prefills decide every term: decode steps
       came out 2-4x off here), and a measurement far below its prediction gets no say.
    4. Steps 2-3 once more against the refit."""
    measurements = [m for m in measurements if m.seconds > 0]
    cost = FittedCost.fit(measurements, capacity, name)
    for _ in range(2):
        predicted = [max(_predicted(cost, m), 1e-6) for m in measurements]
        errors = [abs(m.seconds / p - 1) for m, p in zip(measurements, predicted, strict=True)]
        limit = 3 * statistics.median(errors)
        worst = sorted(range(len(errors)), key=errors.__getitem__, reverse=True)
        drop = {i for i in worst[: int(trim * len(errors))] if errors[i] > limit}
        kept = [i for i in range(len(measurements)) if i not in drop]
        if len(kept) < len(FittedCost.COEFFICIENTS):
            break
        cost = FittedCost.fit(
            [measurements[i] for i in kept], capacity, name, scale=[predicted[i] for i in kept]
        )
    return cost


def _predicted(cost: FittedCost, m: Measurement) -> float:
    return cost.step_time(m.shape) + m.request * cost.request_overhead
