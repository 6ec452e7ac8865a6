"""`make bench` (proxy part): what the proxy costs, against calling a worker directly and against
sglang-router (a Rust gateway) in front of the same emulated workers, in one run.

- TTFT overhead: one streaming request at a time, time to the first content byte, direct vs
  through each router (p50, p99 of the difference of medians is noise-prone, so both are shown).
- Sustained streaming throughput: the router pinned to one core (taskset), emulated workers and
  the load generator on the other; closed loop with fixed concurrency for a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from dashboards.tables import format_table
from router.proxy.ports import free_port
from router.runtime.processes import process, wait_healthy
from workers import emulated

ROOT = Path(__file__).resolve().parents[3]


async def ttfts(url: str, n: int, body: dict) -> np.ndarray:
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            start = time.perf_counter()
            async with s.post(f"{url}/v1/completions", json=body) as r:
                async for _chunk in r.content.iter_any():
                    out.append(time.perf_counter() - start)
                    break
                await r.read()
    return np.array(out[5:]) * 1000  # drop warm-up


async def throughput(url: str, seconds: float, concurrency: int, body: dict) -> float:
    done = 0
    stop = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as s:

        async def loop() -> None:
            nonlocal done
            while time.monotonic() < stop:
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done / seconds


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
            argv = emulated.command(port, model, speed=50)
            stack.enter_context(
                process(argv, 1, scratch / f"worker{i}.log", {"PYTHONPATH": str(ROOT)})
            )
            workers.append(f"http://127.0.0.1:{port}")
        routers: dict[str, str] = {}
        port = free_port()
        config = scratch / "fairway.yaml"
        urls = "\n".join(f"    - {u}" for u in workers)
        config.write_text(
            f"model: {model}\nport: {port}\npolicy: {{name: round_robin}}\n"
            f"window: 256\nworkers:\n  urls:\n{urls}\n"
        )
        stack.enter_context(
            process(
                [sys.executable, "-m", "router.cli", "serve", "--config", str(config)],
                0,
                scratch / "fairway.log",
                {"PYTHONPATH": str(ROOT)},
            )
        )
        routers["fairway (round_robin)"] = f"http://127.0.0.1:{port}"
        if _has_sglang_router():
            port = free_port()
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
                "round_robin",
                "--log-level",
                "warn",
            ]
            stack.enter_context(process(argv, 0, scratch / "sglang.log"))
            routers["sglang-router (round_robin)"] = f"http://127.0.0.1:{port}"
        for url in [*workers, *routers.values()]:
            wait_healthy(url)

        # The load generator is left to float: pinned beside the workers, on two cores, it
        # made core 1 the ceiling (822 streams/s direct to a worker), not the router.
        direct = asyncio.run(ttfts(workers[0], n, stream))
        rows = [
            {
                "path": "direct to a worker",
                "TTFT p50 ms": float(np.median(direct)),
                "TTFT p99 ms": float(np.percentile(direct, 99)),
                "overhead p50 ms": 0.0,
                "overhead p99 ms": 0.0,
                "streams/s (1 core)": None,
            }
        ]
        for name, url in routers.items():
            t = asyncio.run(ttfts(url, n, stream))
            rate = asyncio.run(throughput(url, seconds, concurrency, stream))
            rows.append(
                {
                    "path": name,
                    "TTFT p50 ms": float(np.median(t)),
                    "TTFT p99 ms": float(np.percentile(t, 99)),
                    "overhead p50 ms": float(np.median(t) - np.median(direct)),
                    "overhead p99 ms": float(np.percentile(t, 99) - np.percentile(direct, 99)),
                    "streams/s (1 core)": rate,
                }
            )
    print(
        f"Proxy overhead: 2 emulated workers (50x time), 16-token streams of a ~200-token "
        f"prompt; {n} sequential requests for TTFT, {concurrency} concurrent for "
        f"{seconds:.0f} s for throughput; routers pinned to core 0, workers to core 1."
    )
    print(format_table(rows))
    if not _has_sglang_router():
        print("(sglang-router not installed: `pip install sglang-router` to compare)")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _has_sglang_router() -> bool:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        return False
    return True
