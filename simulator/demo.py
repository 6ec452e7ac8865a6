"""`make demo`: the baseline policies side by side on the bundled Mooncake sample."""

from __future__ import annotations

from importlib import resources

import policies
from router.tables import format_table, summary_row
from simulator.cluster import SimConfig, simulate
from simulator.cost_model import roofline
from traces.loaders import load_trace

SAMPLE = "samples/mooncake_conversation_head1000.jsonl"
MODEL, GPU = "llama-3-8b", "a100-80g"


def run_demo(workers: int = 8) -> int:
    path = resources.files("traces") / SAMPLE
    cost = roofline(MODEL, GPU)
    print(
        f"Replaying {SAMPLE} (1,000 Mooncake requests) on {workers} simulated "
        f"{MODEL} workers ({GPU}), one run per policy:\n"
    )
    rows = []
    for name in policies.global_policies.names():
        trace = load_trace(str(path))  # fresh per run: replay may rewrite arrivals
        result = simulate(trace, cost, SimConfig(num_workers=workers, policy=name))
        rows.append(summary_row(name, result.summary))
    print(format_table(rows))
    best = min(rows, key=lambda r: r["TTFT mean s"])
    print(
        f"\nLowest mean TTFT: {best['policy']}. `fairway simulate --help` replays your own trace."
    )
    return 0
