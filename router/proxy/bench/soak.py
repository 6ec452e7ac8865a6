"""`make bench` (soak part): `fairway serve` under mixed load for a long while, watched from
outside and from inside.

    fairway bench-soak [--duration 600] [--workers 3] [--concurrency 32] [--policy vtc]

Emulated workers (Ray-managed, as `fairway serve --backend emulated` starts them); a closed loop
of requests, half streaming, a quarter chat, over several tenants, for `--duration` seconds.
Every `--sample` seconds it prints the proxy process's RSS (from /proc) and its event loop's
lag (the proxy samples it itself: `fairway_event_loop_lag_seconds`, read from /metrics, p99 per
interval from the histogram's buckets). At the end: requests, outcomes, and the number lost,
judged byte by byte (traces/load.py), which must be 0; the exit status says
whether it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from dashboards.tables import format_table
from router.proxy.ports import free_ports
from router.runtime.processes import memory_mib
from traces.load import LoadSpec, Outcome, run_load

ROOT = Path(__file__).resolve().parents[3]
LAG = "fairway_event_loop_lag_seconds"


@dataclass
class LagHistogram:
    """Cumulative bucket counts of the proxy's loop-lag histogram at one scrape."""

    bounds: list[float] = field(default_factory=list)  # upper bounds, +inf last
    counts: list[float] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> LagHistogram:
        pairs = []
        for line in text.splitlines():
            if line.startswith(f"{LAG}_bucket"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                pairs.append((float(le), float(line.rsplit(" ", 1)[1])))
        pairs.sort()
        return cls([b for b, _ in pairs], [c for _, c in pairs])

    def since(self, before: LagHistogram) -> LagHistogram:
        if not before.counts:
            return self
        return LagHistogram(
            self.bounds, [a - b for a, b in zip(self.counts, before.counts, strict=True)]
        )

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def quantile(self, q: float) -> float | None:
        """Linear within the bucket the rank falls in (Prometheus' histogram_quantile)."""
        if not self.total:
            return None
        rank, lower, below = q * self.total, 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= rank:
                if bound == float("inf"):
                    return lower  # beyond the last finite bucket: at least this
                return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
            lower, below = bound, count
        return lower

    def worst(self) -> float | None:
        """The upper bound of the highest non-empty bucket (the largest lag, rounded up)."""
        previous = 0.0
        worst = None
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count > previous:
                worst = bound if bound != float("inf") else self.bounds[-2]
            previous = count
        return worst


async def scrape_lag(session: aiohttp.ClientSession, base: str) -> LagHistogram:
    async with session.get(f"{base}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        return LagHistogram.parse(await r.text())


@contextlib.contextmanager
def serving(config: dict, scratch: Path):
    """`fairway serve` with `config`, in a session of its own; stopped as an operator would
    (SIGTERM), killed if it does not stop within a minute."""
    path = scratch / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(scratch / "serve.log", "wb")  # noqa: SIM115
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


async def wait_up(base: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"fairway serve exited with {proc.returncode}; see {log}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(f"{base}/health", timeout=aiohttp.ClientTimeout(2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the proxy was not up after {timeout:.0f} s; see {log}")


async def soak(
    base: str, admin: str, pid: int, spec: LoadSpec, sample: float
) -> tuple[list[dict[str, object]], Counter[str], float | None, float]:
    """Run the load on `base`; every `sample` seconds a row of progress, the lag read from the
    admin listener's /metrics. Returns the rows, the outcome counts, the whole run's loop-lag
    p99 and its wall time."""
    counts: Counter[str] = Counter()
    lost: list[Outcome] = []

    def on_outcome(_: int, outcome: Outcome) -> None:
        counts[outcome.kind] += 1
        if outcome.kind in ("lost", "refused") and len(lost) < 10:
            lost.append(outcome)

    rows: list[dict[str, object]] = []
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        first = previous = await scrape_lag(session, admin)
        load = asyncio.create_task(run_load(base, spec, on_outcome))
        while not load.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(load), sample)
            now = await scrape_lag(session, admin)
            interval = now.since(previous)
            previous = now
            p99, worst = interval.quantile(0.99), interval.worst()
            rows.append(
                {
                    "t s": round(time.monotonic() - started),
                    "requests": sum(counts.values()),
                    "ok": counts["ok"],
                    "errors": counts["error"],
                    "lost": counts["lost"] + counts["refused"],
                    "RSS MiB": memory_mib("VmRSS", pid),
                    "lag p99 ms": None if p99 is None else p99 * 1e3,
                    "lag max ms": None if worst is None else worst * 1e3,
                }
            )
            print(
                format_table(rows).splitlines()[-1] if len(rows) > 1 else format_table(rows),
                flush=True,
            )
        result = load.result()
        whole = (await scrape_lag(session, admin)).since(first)
    for outcome in lost:
        print(f"lost: {outcome.detail}")
    return rows, counts, whole.quantile(0.99), result.wall


def run_soak_bench(
    duration: float = 600.0,
    workers: int = 3,
    concurrency: int = 32,
    policy: str = "vtc",
    sample: float | None = None,
    tenants: int = 6,
) -> int:
    sample = sample or max(5.0, duration / 20)
    scratch = Path(tempfile.mkdtemp(prefix="fairway-soak-"))
    *worker_ports, port, admin_port = free_ports(workers + 2, consecutive=True)
    first_port = worker_ports[0]
    config = {
        "workers": {"backend": "emulated", "count": workers, "first_port": first_port},
        "policy": {"name": policy},
        "port": port,
        "admin_port": admin_port,
    }
    base, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    spec = LoadSpec(
        num_requests=10**9,
        concurrency=concurrency,
        duration=duration,
        stream_fraction=0.5,
        chat_fraction=0.25,
        num_tenants=tenants,
        max_tokens=32,
        prompt_words=150,
        timeout=120,
    )
    print(
        f"soak: {duration:.0f} s of mixed load on `fairway serve` ({workers} emulated workers "
        f"through Ray, {policy}): {concurrency} concurrent, half streaming, {tenants} tenants"
    )
    with serving(config, scratch) as proc:
        asyncio.run(wait_up(base, proc, 180, scratch / "serve.log"))
        rss_start = memory_mib("VmRSS", proc.pid)
        rows, counts, p99, wall = asyncio.run(soak(base, admin, proc.pid, spec, sample))
    total = sum(counts.values())
    lost = counts["lost"] + counts["refused"]
    rss = [r["RSS MiB"] for r in rows if r["RSS MiB"] is not None]
    print()
    print(
        format_table(
            [
                {
                    "requests": total,
                    "per s": total / wall if wall else 0.0,
                    "ok": counts["ok"],
                    "clean errors": counts["error"],
                    "lost": lost,
                    "RSS start MiB": rss_start,
                    "RSS end MiB": rss[-1] if rss else None,
                    "RSS max MiB": max(rss) if rss else None,
                    "lag p99 ms": None if p99 is None else p99 * 1e3,
                }
            ]
        )
    )
    ok = lost == 0 and total > 0
    print(f"lost: {lost} (must be 0)" + ("" if ok else f"; proxy log: {scratch / 'serve.log'}"))
    if ok:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if ok else 1
