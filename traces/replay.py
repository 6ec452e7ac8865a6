"""`fairway replay`: send a trace to a live OpenAI endpoint (the proxy, or one server) at its
timestamps and record what happened in the simulator's columns, so `fairway report` can put the
live run beside simulated ones (the simulator's error against a real cluster, on one page).

Prompts are token ids made from the trace's block hashes: each hash seeds its block's tokens, so
requests that share a prefix in the trace share it token for token at the server (the tokens mean
nothing); a fresh salt per replay keeps one replay's prompts out of the next one's cache.
Every answer is `output_len` tokens long (`ignore_eos`). Requests go out open loop, each at its
arrival time, or closed loop by session; each carries its client in `X-Client-Id` (and its
weight and priority in `X-Client-Weight`, `X-Priority`) so the proxy's fairness and classes see
the tenants.
Live records know no admission time: `admitted` is the arrival.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from router.records import RecordWriter, RequestRecord
from router.request import Request
from traces.schema import Trace

TOKEN_IDS = (10, 1000)  # ids every vocabulary has, clear of the special tokens at the start


def prompt_tokens(req: Request, block_size: int, salt: str = "") -> list[int]:
    """`req.prompt_len` token ids: one seeded run per block hash, then the request's own tail.
    Another `salt` gives other tokens for the same structure."""
    low, high = TOKEN_IDS
    ids: list[int] = []
    for h in req.prompt_blocks(block_size):
        rng = random.Random(f"{salt}:{h}")
        ids.extend(rng.randrange(low, high) for _ in range(block_size))
    rng = random.Random(f"{salt}:tail:{req.id}")
    ids.extend(rng.randrange(low, high) for _ in range(req.prompt_len - len(ids)))
    return ids


@dataclass
class ReplayResult:
    records: list[RequestRecord] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)  # by reason

    def failed(self, reason: str) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1


async def _model_card(session: aiohttp.ClientSession, url: str) -> dict:
    try:
        async with session.get(f"{url}/v1/models") as r:
            r.raise_for_status()
            return (await r.json())["data"][0]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{url}: no model list at /v1/models ({type(e).__name__}: {e})") from None


async def replay(
    trace: Trace,
    url: str,
    out: Path,
    closed_loop: bool = False,
    salt: str | None = None,
    timeout: float = 600.0,
) -> ReplayResult:
    """Replay `trace` against `url`: open loop, every request at its arrival, or `closed_loop`,
    each session's next turn `think_time` after the previous answer (as the simulator's closed
    loop). Each replay draws a fresh `salt` unless given one, so it meets a cold prefix cache
    however often the server has seen this trace, as a simulation starts cold."""
    url = url.rstrip("/")
    salt = secrets.token_hex(8) if salt is None else salt
    result = ReplayResult()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        card = await _model_card(session, url)
        limit = int(card.get("max_model_len") or 1 << 30)
        too_long = [r for r in trace.requests if r.prompt_len + r.output_len > limit]
        if too_long:
            raise ValueError(
                f"{len(too_long)} of {len(trace)} requests need more than the served model's "
                f"{limit} tokens (request {too_long[0].id}: {too_long[0].prompt_len} + "
                f"{too_long[0].output_len}); cut the trace (--limit, --window) or use a "
                f"generator with shorter prompts"
            )
        writer = RecordWriter(out / "requests.csv")
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()

        async def send(req: Request) -> None:
            record = await _one(session, url, card["id"], req, trace.block_size, salt, t0, result)
            if record is not None:
                result.records.append(record)
                writer.write(record, flush=True)

        requests = sorted(trace.requests, key=lambda r: r.arrival)
        first = requests[0].arrival if requests else 0.0  # a trace cut from later starts now
        chains: dict[object, list[Request]] = {}  # one chain per session, or per request
        for req in requests:
            key = req.session if closed_loop and req.session is not None else ("request", req.id)
            chains.setdefault(key, []).append(req)

        async def run_chain(turns: list[Request]) -> None:
            delay = turns[0].arrival - first - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            for i, req in enumerate(turns):
                if i:
                    await asyncio.sleep(req.think_time or 0.0)
                await send(req)

        await asyncio.gather(*(loop.create_task(run_chain(c)) for c in chains.values()))
        writer.close()
    return result


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    req: Request,
    block_size: int,
    salt: str,
    t0: float,
    result: ReplayResult,
) -> RequestRecord | None:
    body = {
        "model": model,
        "prompt": prompt_tokens(req, block_size, salt),
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"X-Client-Id": req.client}
    if req.weight != 1.0:
        headers["X-Client-Weight"] = str(req.weight)
    if req.priority != 0:
        headers["X-Priority"] = str(req.priority)
    sent = time.monotonic()
    first = None
    usage: dict = {}
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                result.failed(f"http_{r.status}")
                await r.read()
                return None
            worker = r.headers.get("X-Fairway-Worker", "-1")
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and first is None:
                    first = time.monotonic()
                if event.get("usage"):
                    usage = event["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.failed(type(e).__name__)
        return None
    if first is None or not usage:
        result.failed("no tokens" if first is None else "no usage")
        return None
    details = usage.get("prompt_tokens_details") or {}
    return RequestRecord(
        id=req.id,
        client=req.client,
        session=req.session,
        worker=int(worker) if worker.lstrip("-").isdigit() else -1,
        arrival=sent - t0,
        admitted=sent - t0,
        first_token=first - t0,
        finish=time.monotonic() - t0,
        prompt_tokens=int(usage.get("prompt_tokens", req.prompt_len)),
        cached_tokens=int(details.get("cached_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens", 0)),
        preemptions=0,
        weight=req.weight,
    )
