"""Bounded mixed load against an OpenAI endpoint, and a strict judge of how each request ended.

The proxy's promise: every accepted request ends either complete or with a clear OpenAI-shaped
error. This module checks it from the client's side, byte for byte, for the fault-injection
tests and the soak benchmark:

    ok       200 and the whole answer (a stream: its tokens, then `data: [DONE]`)
    error    an OpenAI error: a JSON `{"error": {...}}` with a 4xx/5xx status, or once a stream
             has begun, an SSE error event followed by `data: [DONE]`
    refused  never accepted: the connection was refused (nothing was promised)
    lost     anything else: a truncated stream, a stream error with no `[DONE]`, a bare 500,
             a body that is not the OpenAI shape, a reset after the request was sent, a hang

Load is closed loop (a fixed number of requests in flight) and bounded both in count and in
time; targets are loopback only, since it exists to hurt servers on purpose.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp


@dataclass(slots=True)
class Outcome:
    kind: str  # ok | error | refused | lost
    detail: str
    stream: bool
    status: int | None = None
    tokens: int = 0
    latency: float = 0.0


@dataclass(frozen=True, slots=True)
class LoadSpec:
    num_requests: int = 300
    concurrency: int = 32
    duration: float = 60.0  # no request starts after this many seconds
    stream_fraction: float = 0.5
    chat_fraction: float = 0.25
    num_tenants: int = 4
    max_tokens: int = 24
    prompt_words: int = 60
    timeout: float = 60.0  # a request not ended by then is lost (hung)
    model: str = "tiny"
    seed: int = 0


@dataclass(slots=True)
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall: float = 0.0

    @property
    def counts(self) -> Counter[str]:
        return Counter(o.kind for o in self.outcomes)

    @property
    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind == "lost"]

    def summary(self) -> str:
        c = self.counts
        return (
            f"{len(self.outcomes)} sent: {c['ok']} ok, {c['error']} clean errors, "
            f"{c['refused']} refused, {c['lost']} lost in {self.wall:.1f} s"
        )


def require_loopback(base: str) -> None:
    host = urlsplit(base).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"load targets loopback only, not {base}")


def request_body(i: int, spec: LoadSpec, rng: random.Random) -> tuple[str, dict, str]:
    """(path, body, tenant) of request `i`: tenants share a document prefix each."""
    tenant = f"tenant-{rng.randrange(spec.num_tenants)}"
    words = f"{tenant} shared document " * (spec.prompt_words // 3) + f"question {i}"
    stream = rng.random() < spec.stream_fraction
    body: dict = {
        "model": spec.model,
        "max_tokens": spec.max_tokens,
        "ignore_eos": True,  # vLLM's: the answer is exactly max_tokens long
        "user": tenant,
    }
    if rng.random() < spec.chat_fraction:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": words}]
    else:
        path = "/v1/completions"
        body["prompt"] = words
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return path, body, tenant


async def send(
    session: aiohttp.ClientSession,
    base: str,
    path: str,
    body: dict,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Outcome:
    stream = bool(body.get("stream"))
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            outcome = await _exchange(session, base + path, body, headers or {}, stream)
    except TimeoutError:
        outcome = Outcome("lost", f"no end after {timeout:.0f} s (hung)", stream)
    except aiohttp.ClientConnectorError as e:
        outcome = Outcome("refused", f"{type(e).__name__}: {e}", stream)
    except (aiohttp.ClientError, ConnectionError) as e:
        outcome = Outcome("lost", f"connection broke: {type(e).__name__}: {e}", stream)
    outcome.latency = time.monotonic() - start
    return outcome


async def _exchange(
    session: aiohttp.ClientSession, url: str, body: dict, headers: dict, stream: bool
) -> Outcome:
    want = body.get("max_tokens")
    async with session.post(url, json=body, headers=headers) as resp:
        status = resp.status
        if status != 200 or "text/event-stream" not in resp.content_type:
            data = await resp.read()
            return _judge_json(data, status, stream, want)
        events: list[bytes] = []
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            *whole, buf = buf.split(b"\n\n")
            events += whole
        if buf.strip():
            events.append(buf)
        return _judge_stream(events, status, want)


def _is_error(doc: object) -> bool:
    err = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err


def _judge_json(data: bytes, status: int, stream: bool, want: int | None) -> Outcome:
    try:
        doc = json.loads(data)
    except ValueError:
        return Outcome(
            "lost", f"{status} with a body that is not JSON: {data[:80]!r}", stream, status
        )
    if status >= 400:
        if _is_error(doc):
            return Outcome("error", f"{status} {doc['error'].get('code')}", stream, status)
        return Outcome(
            "lost", f"{status} not in the OpenAI error shape: {data[:80]!r}", stream, status
        )
    if status == 200 and not stream and isinstance(doc, dict) and doc.get("choices"):
        tokens = int((doc.get("usage") or {}).get("completion_tokens") or 0)
        if want is not None and tokens != want:
            return Outcome("lost", f"{tokens} of {want} tokens", stream, status, tokens)
        return Outcome("ok", "", stream, status, tokens)
    return Outcome("lost", f"{status} unexpected answer: {data[:80]!r}", stream, status)


def _judge_stream(events: list[bytes], status: int, want: int | None) -> Outcome:
    """Complete: `[DONE]` last, no error event, a finish_reason, and the usage event's count
    (when the client asked for one) equal to what was asked. Token events alone are not
    counted against it: vLLM merges the tokens of several steps into one event when its
    client reads slowly."""
    tokens, error, done, finished, usage = 0, None, False, False, None
    for event in events:
        if not event.strip():
            continue
        if done:
            return Outcome("lost", f"bytes after [DONE]: {event[:80]!r}", True, status, tokens)
        payload = event.strip().removeprefix(b"data: ")
        if payload == b"[DONE]":
            done = True
            continue
        try:
            doc = json.loads(payload)
        except ValueError:
            return Outcome("lost", f"a malformed event: {event[:80]!r}", True, status, tokens)
        if _is_error(doc):
            error = doc["error"]
            continue
        if doc.get("usage") and not doc.get("choices"):
            usage = int(doc["usage"].get("completion_tokens") or 0)
        for choice in doc.get("choices") or []:
            delta = choice.get("delta")
            if "text" in choice or (delta and "role" not in delta and "content" in delta):
                tokens += 1
            finished = finished or bool(choice.get("finish_reason"))
    if not done:
        what = f"error event {error.get('code')} without [DONE]" if error else "truncated"
        return Outcome("lost", f"{what} after {tokens} events", True, status, tokens)
    if error is not None:
        return Outcome("error", f"stream error {error.get('code')}", True, status, tokens)
    if not finished:
        return Outcome(
            "lost", f"[DONE] without a finish_reason after {tokens} events", True, status, tokens
        )
    if usage is not None:
        tokens = usage
    if want is not None and (tokens > want or (usage is not None and tokens != want)):
        return Outcome("lost", f"{tokens} of {want} tokens, no error", True, status, tokens)
    return Outcome("ok", "", True, status, tokens)


async def run_load(
    base: str,
    spec: LoadSpec,
    on_outcome: Callable[[int, Outcome], None] | None = None,
) -> LoadResult:
    """Send up to `spec.num_requests`, `spec.concurrency` at a time, starting none after
    `spec.duration` seconds; every request sent has an outcome."""
    require_loopback(base)
    result = LoadResult()
    start = time.monotonic()
    next_i = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal next_i
            while next_i < spec.num_requests and time.monotonic() - start < spec.duration:
                i = next_i
                next_i += 1
                # Request i is the same whichever worker sends it, and whenever.
                path, body, tenant = request_body(i, spec, random.Random(spec.seed << 32 | i))
                outcome = await send(
                    session, base, path, body, {"X-Client-Id": tenant}, spec.timeout
                )
                result.outcomes.append(outcome)
                if on_outcome is not None:
                    on_outcome(i, outcome)

        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    result.wall = time.monotonic() - start
    return result
