"""`make bench` (proxy part): what the proxy costs, against calling a worker directly and against
sglang-router (a Rust gateway) in front of the same emulated workers, in one run.

- TTFT overhead: one streaming request at a time, time to the first content byte, through
  each router and straight to a worker in turn (so that both see the same machine: on a shared
  one, what else runs moves a median by more than the overhead measured).
- Sustained streaming throughput: the router pinned to core 0 (taskset), the emulated workers to
  core 1; closed loop with fixed concurrency for a fixed time. The load generator (Python) floats
  over both cores, so streams/s is what router and generator reach together; the router's own
  cost is its CPU time (from /proc) per stream: streams per CPU-second is its rate per core.
- Both routers with a locality-blind policy (round robin) and with their prefix-aware one
  (Fairway's lpm tokenizes and hashes every prompt; sglang-router's cache_aware matches text).
- A reference: aiohttp relaying the same streams with nothing else (router/proxy/bench/relay.py),
  which tells aiohttp's share of Fairway's cost from Fairway's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from dashboards.tables import format_table
from router.proxy.ports import free_port
from router.runtime.processes import cpu_seconds, process, wait_healthy
from workers.emulated.cli import emulated_command

ROOT = Path(__file__).resolve().parents[2]


# A tenant with classes, latency routing, admission control and a budget it never exhausts:
# what they cost the proxy per stream (router/proxy/ratelimit.py, admission.py).
BENCH_KEY = "bench-key-0123456789abcdef"
WITH_CLASSES = f"""tenants:
  - api_key: {BENCH_KEY}
    client: bench
    priority: 0
    rate_limit: {{requests_per_s: 1.0e6, burst: 1.0e6, input_tokens_per_min: 1.0e12,
                 output_tokens_per_min: 1.0e12}}
classes:
  interactive: {{priority: 0, ttft: 10, tpot: 1, max_queue_time: 60}}
latency_routing: true
admission_control: true
"""


async def ttfts(
    url: str, workers: list[str], n: int, body: dict, headers: dict[str, str] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """TTFTs in ms through the router at `url` and straight to `workers`, one request at a
    time, alternating (and alternating which goes first): (through the router, direct)."""
    routed, direct = [], []
    async with aiohttp.ClientSession(headers=headers) as s:

        async def first_byte(target: str) -> float:
            start = time.perf_counter()
            async with s.post(f"{target}/v1/completions", json=body) as r:
                async for _chunk in r.content.iter_any():
                    break
                elapsed = time.perf_counter() - start
                await r.read()
            return elapsed

        for i in range(n + 5):
            pair = (url, workers[i % len(workers)])
            first, second = pair if i % 2 else pair[::-1]
            times = {first: await first_byte(first), second: await first_byte(second)}
            if i >= 5:  # warm-up dropped
                routed.append(times[url])
                direct.append(times[pair[1]])
    return np.array(routed) * 1000, np.array(direct) * 1000


@dataclass(frozen=True)
class Throughput:
    streams_per_s: float
    router_cores: float  # CPU-seconds the router used per second of the run
    streams_per_cpu_s: float  # streams per CPU-second of the router: its rate on one core


def measured(
    url: str,
    pid: int,
    seconds: float,
    concurrency: int,
    body: dict,
    headers: dict[str, str] | None = None,
) -> Throughput:
    """`throughput`, with the CPU time the router `pid` (and its children) used meanwhile."""
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    rate = asyncio.run(throughput(url, seconds, concurrency, body, headers))
    cpu, wall = cpu_seconds(pid) - cpu0, time.monotonic() - t0
    return Throughput(rate, cpu / wall, rate * seconds / cpu if cpu > 0 else float("nan"))


async def throughput(
    url: str, seconds: float, concurrency: int, body: dict, headers: dict[str, str] | None = None
) -> float:
    done = 0
    stop = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as s:

        async def loop() -> None:
            nonlocal done
            while time.monotonic() < stop:
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / seconds


TARGET_RATIO, TARGET_P50_MS, TARGET_P99_MS = 1.0, 0.5, 2.0  # the proxy's targets


def run_proxy_bench(quick: bool = False) -> int:
    from workers.launch import ensure_tiny_model

    model = ensure_tiny_model(ROOT / "build" / "tiny-tokenizer", weights=False)
    scratch = Path(tempfile.mkdtemp(prefix="fairway-bench-"))
    n, seconds, concurrency = (60, 5.0, 32) if quick else (200, 15.0, 64)
    stream = {"model": "tiny", "prompt": "benchmark " * 100, "max_tokens": 16, "stream": True}
    with contextlib.ExitStack() as stack:
        workers = []
        for i in range(2):
            port = free_port()
            argv = emulated_command(port, model, speed=50)
            stack.enter_context(
                process(argv, 1, scratch / f"worker{i}.log", {"PYTHONPATH": str(ROOT)})
            )
            workers.append(f"http://127.0.0.1:{port}")
        for url in workers:
            wait_healthy(url)
        rows = []
        directs = []
        routers = [("fairway", "round_robin"), ("fairway", "lpm"), ("fairway+classes", "lpm")]
        routers.append(("aiohttp relay", "round_robin"))
        if _has_sglang_router():
            routers += [("sglang-router", "round_robin"), ("sglang-router", "cache_aware")]
        # One router at a time, so that each has core 0 to itself.
        for kind, policy in routers:
            classes = kind == "fairway+classes"
            headers = {"Authorization": f"Bearer {BENCH_KEY}"} if classes else None
            with _router(kind, policy, workers, model, scratch) as (url, pid):
                t, direct = asyncio.run(ttfts(url, workers, n, stream, headers))
                rate = measured(url, pid, seconds, concurrency, stream, headers)
            directs.append(direct)
            if classes:
                label = "fairway (lpm, classes + budgets)"
            elif kind == "aiohttp relay":
                label = "aiohttp relay, nothing else (reference)"
            else:
                label = f"{kind} ({policy})"
            rows.append(
                {
                    "path": label,
                    "TTFT p50 ms": float(np.median(t)),
                    "TTFT p99 ms": float(np.percentile(t, 99)),
                    "overhead p50 ms": float(np.median(t) - np.median(direct)),
                    "overhead p99 ms": float(np.percentile(t, 99) - np.percentile(direct, 99)),
                    "streams/s": rate.streams_per_s,
                    "router cores": rate.router_cores,
                    "streams per router CPU-s": rate.streams_per_cpu_s,
                }
            )
        direct = np.concatenate(directs)
        rows.insert(
            0,
            {
                "path": "direct to a worker",
                "TTFT p50 ms": float(np.median(direct)),
                "TTFT p99 ms": float(np.percentile(direct, 99)),
                "overhead p50 ms": 0.0,
                "overhead p99 ms": 0.0,
                "streams/s": None,
                "router cores": None,
                "streams per router CPU-s": None,
            },
        )
    print(
        f"Proxy overhead: 2 emulated workers (50x time), 16-token streams of a ~200-token "
        f"prompt; {n} sequential requests for TTFT, each router's alternating with as many "
        f"straight to a worker (its overhead is against those); {concurrency} concurrent for "
        f"{seconds:.0f} s for throughput; the router pinned to core 0, workers to core 1, the "
        f"load generator floating; router cores: its CPU-seconds per second (from /proc)."
    )
    print(format_table(rows))
    print(verdict(rows))
    if not _has_sglang_router():
        print("(sglang-router not installed: `pip install sglang-router` to compare)")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def verdict(rows: list[dict]) -> str:
    """The proxy against its targets, as ratios of this run's figures."""
    by = {r["path"]: r for r in rows}
    ours = by["fairway (round_robin)"]
    lines = [
        f"Fairway's TTFT overhead: p50 {ours['overhead p50 ms']:.2f} ms (target < "
        f"{TARGET_P50_MS}), p99 {ours['overhead p99 ms']:.2f} ms (target < {TARGET_P99_MS})."
    ]
    for policy, theirs in (("round_robin", "round_robin"), ("lpm", "cache_aware")):
        other = by.get(f"sglang-router ({theirs})")
        if other is None:
            continue
        mine = by[f"fairway ({policy})"]
        lines.append(
            f"fairway {policy} against sglang-router {theirs}: streams/s "
            f"{mine['streams/s'] / other['streams/s']:.2f}x, streams per router CPU-second "
            f"{mine['streams per router CPU-s'] / other['streams per router CPU-s']:.2f}x "
            f"(target >= {TARGET_RATIO:.1f}x per core)."
        )
    relay = by.get("aiohttp relay, nothing else (reference)")
    theirs = by.get("sglang-router (round_robin)")
    if relay is not None and theirs is not None:
        per_core = "streams per router CPU-s"
        lines.append(
            f"aiohttp relaying alone (no routing, accounting or metrics): "
            f"{relay[per_core] / theirs[per_core]:.2f}x sglang-router round_robin per core; "
            f"fairway round_robin {ours[per_core] / relay[per_core]:.2f}x of it."
        )
    classes = by.get("fairway (lpm, classes + budgets)")
    if classes is not None:
        plain = by["fairway (lpm)"]
        lines.append(
            f"fairway lpm with classes, latency routing, admission and a tenant budget: "
            f"streams/s {classes['streams/s'] / plain['streams/s']:.2f}x plain lpm's, streams "
            f"per router CPU-second "
            f"{classes['streams per router CPU-s'] / plain['streams per router CPU-s']:.2f}x "
            f"(target >= 0.95x)."
        )
    return "\n".join(lines)


@contextlib.contextmanager
def _router(kind: str, policy: str, workers: list[str], model: Path, scratch: Path):
    """A router on core 0 in front of `workers`; yields its URL and pid."""
    port = free_port()
    log = scratch / f"{kind}-{policy}.log"
    if kind.startswith("fairway"):
        config = scratch / f"{kind}-{policy}.yaml"
        urls = "\n".join(f"    - {u}" for u in workers)
        config.write_text(
            f"model: {model}\nport: {port}\npolicy: {{name: {policy}}}\n"
            f"window: 256\nworkers:\n  urls:\n{urls}\n"
            + (WITH_CLASSES if kind == "fairway+classes" else "")
        )
        argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(config)]
        env = {"PYTHONPATH": str(ROOT)}
    elif kind == "aiohttp relay":
        argv = [sys.executable, "-m", "router.proxy.bench.relay", str(port), *workers]
        env = {"PYTHONPATH": str(ROOT)}
    else:
        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *workers,
            "--policy",
            policy,
            "--log-level",
            "warn",
        ]
        env = {}
    with process(argv, 0, log, env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 120)
        yield url, proc.pid


def _has_sglang_router() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True
