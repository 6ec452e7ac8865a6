"""`make demo`: every policy side by side on the bundled Mooncake sample, then a report."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import policies
from dashboards.report import load_run, write_report
from dashboards.tables import format_table, summary_row
from router.cost_model import roofline
from simulator.cluster import SimConfig, simulate
from simulator.results import write_results
from traces.loaders import load_trace
from traces.transform import assign_tenants

SAMPLE = "samples/mooncake_conversation_head1000.jsonl"
MODEL, GPU = "llama-3-8b", "a100-80g"
OUT = Path("build/demo")


def run_demo(workers: int = 8) -> int:
    path = resources.files("traces") / SAMPLE
    cost = roofline(MODEL, GPU)
    print(
        f"Replaying {SAMPLE} (1,000 Mooncake requests, 4 tenants with Zipf-skewed shares) on "
        f"{workers} simulated {MODEL} workers ({GPU}), one run per policy:\n"
    )
    rows, runs = [], []
    for name in policies.global_policies.names():
        trace = load_trace(str(path))  # fresh per run: replay may rewrite arrivals
        assign_tenants(trace, 4, skew=1.0)  # so the fairness columns have something to say
        result = simulate(trace, cost, SimConfig(num_workers=workers, policy=name))
        rows.append(summary_row(name, result.summary))
        write_results(OUT / name, result.summary, result.records)
        runs.append(load_run(OUT / name))
    print(format_table(rows))
    best = min(rows, key=lambda r: r["TTFT mean s"])
    print(
        f"\nLowest mean TTFT: {best['policy']}. `fairway simulate --help` replays your own trace."
    )
    report = write_report(runs, OUT / "report.html", title="Fairway demo: policies on Mooncake")
    print(f"Report: {report.resolve()}")
    return 0
