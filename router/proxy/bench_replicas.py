"""`make bench` (replicas part): `fairway serve --routers N` against one router, same load.

- Throughput: streams/s through 1, 2 and 4 replicas on one port, the proxy bench's closed
  loop (router/proxy/bench_proxy.py: fixed concurrency, 16-token streams) for a fixed time.
- Locality: LPM's prefix hit rate (the workers' own cached-token counts) and how many workers
  each document ends on, when rounds of requests return to the same documents: a replica
  learns where another one placed a document only at the next sync.
- Fairness: VTC's maximum service gap between backlogged tenants, and the calm tenants' TTFT,
  when one tenant floods (open loop, as the simulator's `flood`) and the router's queues order:
  each replica orders by counters the others update late. The window in flight per worker is
  split over the replicas, so the total is the same.

Service is measured at the client: prompt tokens at the first byte, output ramped to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from router.proxy.bench_proxy import free_port, process, throughput, wait_healthy
from router.records import RequestRecord
from router.tables import format_table
from workers import emulated

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Setup:
    routers: int
    sync: float = 0.1

    @property
    def label(self) -> str:
        if self.routers == 1:
            return "1 router"
        never = " (none in the run)" if self.sync >= 60 else ""
        return f"{self.routers} routers, sync {self.sync:g} s{never}"


@contextlib.contextmanager
def fairway(scratch: Path, model: Path, workers: list[str], setup: Setup, policy: str, window: int):
    """`fairway serve` with `setup.routers` replicas (its own Redis); yields its URL."""
    port = free_port()
    own = [free_port() for _ in range(setup.routers)] if setup.routers > 1 else []
    config = {
        "model": str(model),
        "port": port,
        "policy": {"name": policy},
        "window": window,
        "trust_client_headers": True,
        "routers": setup.routers,
        "router_sync": setup.sync,
        "replica_ports": own,
        "workers": {"urls": workers},
    }
    path = scratch / f"fairway-{setup.routers}-{setup.sync:g}-{policy}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(path)]
    with process(argv, None, path.with_suffix(".log"), {"PYTHONPATH": str(ROOT)}):
        for p in [port, *own]:
            wait_healthy(f"http://127.0.0.1:{p}", 120)
        yield f"http://127.0.0.1:{port}"


async def stream_one(
    session: aiohttp.ClientSession, url: str, prompt: str, tenant: str, max_tokens: int, t0: float
) -> RequestRecord | None:
    """One streamed completion, timed at the client; None if it did not end complete."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    start = time.monotonic()
    first, usage, done = None, None, False
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"X-Client-Id": tenant}) as r:  # fmt: skip
        if r.status != 200:
            await r.read()
            return None
        worker = int(r.headers.get("X-Fairway-Worker", -1))
        buf = b""
        async for chunk in r.content.iter_any():
            first = first or time.monotonic()
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    done = True
                elif data.startswith(b"{") and b'"usage"' in data:
                    usage = json.loads(data).get("usage") or usage
    if not done or usage is None or first is None:
        return None
    end = time.monotonic()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return RequestRecord(
        id=0, client=tenant, session=None, worker=worker, arrival=start - t0,
        admitted=first - t0, first_token=first - t0, finish=end - t0,
        prompt_tokens=usage["prompt_tokens"], cached_tokens=cached,
        output_tokens=usage["completion_tokens"], preemptions=0,
    )  # fmt: skip


async def documents_load(
    url: str, num_docs: int, per_doc: int, concurrency: int, salt: str
) -> list[RequestRecord]:
    """Rounds over the documents: request i asks about document i % num_docs. A replica that
    has not yet heard where another sent a document places it anew (often elsewhere). `salt`
    makes the documents new to the workers' caches."""
    t0, next_i, out = time.monotonic(), 0, []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def loop() -> None:
            nonlocal next_i
            while next_i < num_docs * per_doc:
                i, next_i = next_i, next_i + 1
                d = i % num_docs
                doc = f"{salt} document {d} about subject {d * 7919} " * 60
                record = await stream_one(session, url, doc + f"question {i}", "docs", 8, t0)
                if record is not None:
                    record.id = d
                    out.append(record)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return out


def flood_prompt(salt: str, tenant: str, j: int) -> str:
    return f"{salt} {tenant} shared manual page " * 30 + f"question {j}"


async def flood_load(
    url: str, seconds: float, flood_rate: float, calm_rate: float, num_calm: int, salt: str
) -> list[RequestRecord]:
    """Open loop, as the simulator's `flood`: one tenant sends Poisson arrivals faster than the
    workers serve, `num_calm` others slowly, each over a prompt prefix of its own."""
    rng = random.Random(0)
    arrivals = []
    for tenant, rate in [
        ("flood", flood_rate),
        *((f"calm-{k}", calm_rate) for k in range(num_calm)),
    ]:
        t = rng.expovariate(rate)
        while t < seconds:
            arrivals.append((t, tenant))
            t += rng.expovariate(rate)
    arrivals.sort()
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        for j, (at, tenant) in enumerate(arrivals):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            prompt = flood_prompt(salt, tenant, j)
            tasks.append(asyncio.create_task(stream_one(session, url, prompt, tenant, 32, t0)))
        done = await asyncio.gather(*tasks)
    return [r for r in done if r is not None]


def run_replicas_bench(quick: bool = False) -> int:
    from router.proxy.serve import ensure_tiny_model
    from simulator.fairness import max_service_gap, service_curves

    if shutil.which("redis-server") is None:
        print("bench-replicas: needs redis-server (`make test` installs it)", file=sys.stderr)
        return 1
    model = ensure_tiny_model(ROOT / "build" / "tiny-tokenizer", weights=False)
    scratch = Path(tempfile.mkdtemp(prefix="fairway-bench-replicas-"))
    seconds, concurrency = (5.0, 32) if quick else (15.0, 64)
    docs, per_doc, fair_seconds = (12, 6, 6.0) if quick else (24, 8, 12.0)
    stream = {"model": "tiny", "prompt": "benchmark " * 100, "max_tokens": 16, "stream": True}
    window = 4  # per worker, over all replicas, for the fairness runs
    compare = [Setup(1), Setup(2, 0.1), Setup(4, 0.1), Setup(4, 1.0), Setup(4, 60.0)]
    throughput_rows, quality_rows = [], []
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        fast, slow = [], []  # workers for throughput (cheap) and for fairness (a backlog)
        for name, speed, out in (("fast", 50, fast), ("slow", 2, slow)):
            for i in range(2):
                port = free_port()
                argv = emulated.command(port, model, speed=speed)
                log = scratch / f"worker-{name}-{i}.log"
                stack.enter_context(process(argv, None, log, {"PYTHONPATH": str(ROOT)}))
                out.append(f"http://127.0.0.1:{port}")
        for url in fast + slow:
            wait_healthy(url)

        base = None
        for n in (1, 2, 4):
            with fairway(scratch, model, fast, Setup(n), "vtc", 256) as url:
                rate = asyncio.run(throughput(url, seconds, concurrency, stream))
            base = base or rate
            throughput_rows.append({"routers": n, "streams/s": rate, "vs 1 router": rate / base})

        # The flood's rate: 1.5 x what the slow workers serve here (measured, not assumed).
        probe = {"model": "tiny", "prompt": flood_prompt("probe", "flood", 0), "max_tokens": 32,
                 "stream": True, "ignore_eos": True}  # fmt: skip
        with fairway(scratch, model, slow, Setup(1), "vtc", window) as url:
            capacity = asyncio.run(throughput(url, 4.0, 4 * window, probe))
        flood_rate, calm_rate, num_calm = 1.5 * capacity, 0.05 * capacity, 4
        for k, setup in enumerate(compare):
            with fairway(scratch, model, fast, setup, "lpm", 64) as url:
                hits = asyncio.run(documents_load(url, docs, per_doc, 24, f"run {k}"))
            share = max(1, window // setup.routers)
            with fairway(scratch, model, slow, setup, "vtc", share) as url:
                fair = asyncio.run(
                    flood_load(url, fair_seconds, flood_rate, calm_rate, num_calm, f"run {k}")
                )
            prompt = sum(r.prompt_tokens for r in hits)
            placements = {(r.id, r.worker) for r in hits}
            calm = [r.ttft for r in fair if r.client != "flood"]
            quality_rows.append({
                "setup": setup.label,
                "LPM hit rate": sum(r.cached_tokens for r in hits) / max(prompt, 1),
                "workers per document": len(placements) / max(1, len({r.id for r in hits})),
                "VTC max service gap": max_service_gap(service_curves(fair, step=0.25)),
                "calm TTFT mean s": sum(calm) / max(1, len(calm)),
                "window per replica": share,
                "requests ok": len(hits) + len(fair),
            })  # fmt: skip
    cpu = platform.processor() or _cpu_model()
    print(
        f"Router replicas on one port (SO_REUSEPORT), this machine: {os.cpu_count()} cores "
        f"({cpu}); replicas, Redis, 2 emulated workers and the load generator all share them; "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after."
    )
    print(
        f"Throughput: VTC, 2 workers (50x time), 16-token streams of a ~200-token prompt, "
        f"{concurrency} concurrent for {seconds:.0f} s."
    )
    print(format_table(throughput_rows))
    print(
        f"\nLocality: LPM, {docs} documents of ~530 tokens (4 blocks), asked {per_doc} times "
        f"each in rounds, 24 concurrent (hit rate from the workers' cached-token counts). "
        f"Fairness: VTC with the router's queues ordering (window {window} per worker over all "
        f"replicas), 2 workers (2x time) serving about {capacity:.0f} requests/s here; for "
        f"{fair_seconds:.0f} s one tenant floods at {flood_rate:.0f}/s and {num_calm} calm ones "
        f"send {calm_rate:.1f}/s each (Poisson); service gap in weighted tokens (in + 2 x out) "
        f"as the client sees it, and the calm tenants' mean TTFT."
    )
    print(format_table(quality_rows))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"
