"""`fairway experiment priority`: traffic classes when batch work outgrows the fleet, and routing
by predicted latency.

Classes. Interactive tenants at a steady rate with TTFT/TPOT targets beside batch tenants whose
rate grows from 1x to 10x the fleet's capacity, on 2 workers, each load run three ways:

    no classes         every request priority 0 (the classes' figures are computed afterwards,
                       against the same targets, from each request's own class)
    bands              strict priority bands, the policy's own discipline inside each
    bands + admission  and admission control: a queue-time limit per class, and early refusal of
                       a request no worker is predicted to serve within its class's TTFT target

under lpm, vtc and dlpm (each the global policy with its default discipline in the bands).

Capacity is measured first: the batch requests alone, offered at 25 req/s per worker (documents
of ~2k tokens: over four times what an A100 prefills on llama-3-8b), counted as completions per
second of the run, the fleet's saturated throughput. The batch loads are multiples of it.

Latency routing. The bundled Mooncake sample (the demo's) on 8 workers, one class with targets:
least_load and lpm as they route, then routing among the workers predicted to meet the TTFT
target, and that with admission control; each with the prediction's error against the TTFT
that followed.

Goodput, as a run's summary counts it: requests that met their class's targets per second of
the run (first arrival to last finish, so a backlog that drains long after the last arrival
counts against it). Attainment: the share of a class's requests, refused ones included, that
met its targets.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from dashboards.tables import format_table
from router.classes import ClassTable, TrafficClass
from router.cost_model import roofline
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.engine import EngineConfig
from simulator.progress import map_runs, summary_counts
from simulator.results import class_summary, fleet_goodput
from traces.generators import priority_mix
from traces.loaders import load_trace
from traces.schema import Trace

MODEL, GPU = "llama-3-8b", "a100-80g"
# An operator's targets for chat on llama-3-8b/A100: the first token within a second, then at
# least 10 tokens a second; batch documents want an answer started within a minute. Waiting
# past the queue limit, a request is refused (503 with Retry-After) rather than served late;
# the limit leaves room for the prefill after the wait, so what is admitted meets its target.
INTERACTIVE = TrafficClass("interactive", 0, ttft=1.0, tpot=0.1, max_queue_time=0.8)
BATCH = TrafficClass("batch", 1, ttft=60.0, max_queue_time=50.0)
CLASSES = (INTERACTIVE, BATCH)
# Bands order who starts, not what shares a step: a running batch prompt is prefilled in chunks
# beside the interactive decodes. A full 1,024-token chunk takes 0.09 s here, inside the TPOT
# target; vLLM's default on an 80 GB GPU, 8,192, makes such a step 0.8 s (a row shows it).
STEP_TOKENS = 1024
ENGINE = EngineConfig(max_num_batched_tokens=STEP_TOKENS)
WORKERS = 2
DURATION, QUICK_DURATION = 60.0, 20.0  # seconds of arrivals
INTERACTIVE_RATE = 4.0  # req/s over 4 chat tenants, each with its own 1k-token system prompt
SATURATING_RATE = 25.0  # batch req/s per worker for the capacity run
LOADS, QUICK_LOADS = (1, 2, 5, 10), (1, 10)
POLICIES, QUICK_POLICIES = ("lpm", "vtc", "dlpm"), ("lpm",)
MODES = {  # label -> SimConfig fields
    "no classes": {},
    "bands": {"classes": CLASSES},
    "bands + admission": {"classes": CLASSES, "admission": True},
}
# The Mooncake sample: prompts of 8.4k tokens at the median, so a 2 s first token.
SAMPLE = "samples/mooncake_conversation_head1000.jsonl"
CHAT = TrafficClass("chat", 0, ttft=2.0, tpot=0.1)
SAMPLE_WORKERS = 8
LATENCY_RUNS = {  # label -> SimConfig fields
    "least_load": {"policy": "least_load"},
    "lpm": {"policy": "lpm"},
    "least_load, latency routing": {"policy": "least_load", "latency_routing": True},
    "lpm, latency routing": {"policy": "lpm", "latency_routing": True},
    "lpm, latency routing + admission": {
        "policy": "lpm",
        "latency_routing": True,
        "admission": True,
    },
}


@dataclass(frozen=True)
class Run:
    label: str
    load: float | None  # batch rate in multiples of the capacity (None: the Mooncake sample)
    batch_rate: float
    duration: float
    config: SimConfig  # its seed is the experiment's


def mix(
    batch_rate: float,
    seed: int,
    duration: float = DURATION,
    classes: bool = True,
    interactive: bool = True,
) -> Trace:
    """The two classes' traffic; without `classes` every request is priority 0, and without
    `interactive` only the batch requests are kept (the same ones, at the same times)."""
    trace = priority_mix(duration=duration, interactive_rate=INTERACTIVE_RATE,
                         batch_rate=batch_rate, seed=seed)  # fmt: skip
    if not interactive:
        trace.requests = [r for r in trace.requests if r.priority == BATCH.priority]
    if not classes:
        for r in trace.requests:
            r.priority = 0
    return trace


def measure_capacity(seed: int, duration: float = DURATION, workers: int = WORKERS) -> float:
    """Batch requests per second the fleet completes when offered far more, batch alone."""
    config = SimConfig(num_workers=workers, policy="least_load", engine=ENGINE, seed=seed)
    trace = mix(SATURATING_RATE * workers, seed, duration, interactive=False)
    summary = simulate(trace, roofline(MODEL, GPU), config).summary
    return summary["throughput"]["requests_per_s"]  # type: ignore[index]


def class_runs(capacity: float, quick: bool = False) -> list[Run]:
    duration = QUICK_DURATION if quick else DURATION
    runs = []
    for policy in QUICK_POLICIES if quick else POLICIES:
        for load in QUICK_LOADS if quick else LOADS:
            for mode, fields in MODES.items():
                config = SimConfig(num_workers=WORKERS, policy=policy, engine=ENGINE, **fields)
                runs.append(Run(f"{policy}, {mode}", load, load * capacity, duration, config))
    if not quick:  # the same bands with vLLM's default step budget on this GPU
        config = SimConfig(num_workers=WORKERS, policy="lpm", classes=CLASSES)
        for load in (LOADS[0], LOADS[-1]):
            label = "lpm, bands, 8192-token steps"
            runs.append(Run(label, load, load * capacity, duration, config))
    return runs


def latency_runs() -> list[Run]:
    return [
        Run(label, None, 0.0, 0.0,
            SimConfig(num_workers=SAMPLE_WORKERS, engine=ENGINE, classes=(CHAT,), **fields))
        for label, fields in LATENCY_RUNS.items()
    ]  # fmt: skip


def _run_one(run: Run, seed: int) -> tuple[Run, dict]:
    config = replace(run.config, seed=seed)
    if run.load is None:
        trace = load_trace(str(resources.files("traces") / SAMPLE))
    else:
        trace = mix(run.batch_rate, seed, run.duration, classes=bool(config.classes))
    result = simulate(trace, roofline(MODEL, GPU), config)
    summary = result.summary
    if run.load is not None and not config.classes:
        # The same targets, judged afterwards: each request back in its own class.
        interactive = {r.id for r in trace.requests if r.client.startswith("chat-")}
        records = result.records
        for r in records:
            r.priority = INTERACTIVE.priority if r.id in interactive else BATCH.priority
        by_class = summary["classes"] = class_summary(records, [], ClassTable(CLASSES))
        span = max(r.finish for r in records) - min(r.arrival for r in records)
        summary["goodput"] = fleet_goodput(by_class, span)
        summary["refusals"] = {}
    return run, summary


def _percent(value: object) -> float | None:
    return None if value is None else 100 * value  # type: ignore[operator]


def _refused(summary: dict) -> str:
    reasons = [f"{n:,} {reason}" for reason, n in summary.get("refusals", {}).items() if n]
    return " + ".join(reasons) or "0"


def class_row(run: Run, summary: dict) -> dict[str, object]:
    figures = summary["classes"]
    row: dict[str, object] = {"run": run.label, "batch x": run.load}
    for short, traffic in (("I", INTERACTIVE), ("B", BATCH)):
        c = figures[traffic.name]
        row[f"{short} TTFT p99 s"] = c["ttft"]["p99"]
        if traffic.tpot is not None:
            row[f"{short} TPOT p99 s"] = c["tpot"]["p99"]
        row[f"{short} met %"] = _percent(c["attainment"])
        row[f"{short} goodput/s"] = c["goodput"]
    row["goodput/s"] = summary["goodput"]["requests_per_s"]
    row["refused"] = _refused(summary)
    return row


def latency_row(run: Run, summary: dict) -> dict[str, object]:
    c = summary["classes"][CHAT.name]  # type: ignore[index]
    prediction = summary["ttft_prediction"]  # type: ignore[index]
    return {
        "run": run.label,
        "TTFT p50 s": c["ttft"]["p50"],
        "TTFT p99 s": c["ttft"]["p99"],
        "met %": _percent(c["attainment"]),
        "goodput/s": c["goodput"],
        "hit %": 100 * summary["prefix_cache"]["hit_rate"],  # type: ignore[index]
        "refused": _refused(summary),
        # Predicted less actual TTFT (a bias), and its size over the actual.
        "pred. error mean s": prediction["error"]["mean"],
        "rel. error p50 %": _percent(prediction["relative_error"]["p50"]),
        "rel. error p90 %": _percent(prediction["relative_error"]["p90"]),
    }


Section = tuple[str, list[dict[str, object]]]


def run(seed: int = 0, out: Path | None = None, jobs: int | None = None,
        quick: bool = False) -> list[Section]:  # fmt: skip
    """Both parts' tables (title, rows); `quick`: lpm only, at 1x and 10x the capacity, over
    20 s of arrivals."""
    capacity = measure_capacity(seed, QUICK_DURATION if quick else DURATION)
    runs = [*class_runs(capacity, quick), *latency_runs()]
    # The heaviest first, so the pool's processes finish together.
    order = sorted(range(len(runs)), key=lambda i: -(runs[i].batch_rate or 0.0))
    jobs = jobs or min(len(runs), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        ordered = map_runs(pool, _run_one, [runs[i] for i in order], [seed] * len(runs),
                           counts=summary_counts)  # fmt: skip
        done = dict(zip(order, ordered, strict=True))
    results = [done[i] for i in range(len(runs))]
    sections: list[Section] = [
        (
            f"Interactive ({INTERACTIVE_RATE:g} req/s; TTFT {INTERACTIVE.ttft:g} s, TPOT "
            f"{INTERACTIVE.tpot:g} s) beside batch (TTFT {BATCH.ttft:g} s) at 1-10x the "
            f"capacity of {WORKERS} workers, {capacity:.2f} batch req/s alone; "
            "I: interactive, B: batch",
            [class_row(r, s) for r, s in results if r.load is not None],
        ),
        (
            f"The Mooncake sample on {SAMPLE_WORKERS} workers, targets TTFT {CHAT.ttft:g} s and "
            f"TPOT {CHAT.tpot:g} s: routing by predicted TTFT, and the prediction's error",
            [latency_row(r, s) for r, s in results if r.load is None],
        ),
    ]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for r, summary in results:
            name = r.label if r.load is None else f"{r.label} {r.load}x"
            slug = re.sub(r"[^A-Za-z0-9.]+", "_", name)
            (out / f"priority-{slug}.json").write_text(json.dumps(summary, indent=2) + "\n")
        text = "\n\n".join(f"{title}\n\n{format_table(rows)}" for title, rows in sections)
        (out / "priority.md").write_text(text + "\n")
    return sections
