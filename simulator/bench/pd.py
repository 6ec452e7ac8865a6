"""`fairway experiment pd`: a fleet split into prefill and decode workers against the same GPUs
kept mixed, under TTFT and TPOT targets.

Eight H100s serving llama-3-8b (one GPU a worker, dgx-h100's network: NVLink inside a host,
one 400 Gb/s NIC a GPU between hosts), run mixed and split at several P:D ratios on three
traces: a Mooncake conversation window (long prompts, shared prefixes), and Azure's code and
conversation traces (no prefix ids: no hits), each sped up to load the fleet. lpm routes the
prefill pool (or the mixed fleet); every worker runs vLLM's default 8,192-token chunked
steps, so on a mixed worker a prompt's chunks share steps with the decodes running there.

Goodput per GPU: the requests meeting both targets, per second of the run (first arrival to
last finish), per GPU. DistServe and Splitwise report that splitting wins under tight TPOT
targets (no decode step waits behind a prefill chunk) and loses to mixed under loose ones
(every GPU can prefill). The tables say whether this model shows that, at these loads.

Locality: lpm against least_load on the prefill pool of a split fleet and on the mixed one,
on the Mooncake window (Azure's traces name no prefixes).
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from dashboards.tables import format_table
from router.cost_model import roofline
from router.records import RequestRecord
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.progress import map_runs, summary_counts
from traces import transform
from traces.loaders import load_trace
from traces.schema import Trace

MODEL, GPU = "llama-3-8b", "h100"
GPUS = 8
TOPOLOGY = "dgx-h100"
SHARED = Path("../shared/traces")


@dataclass(frozen=True)
class Workload:
    """A window of a trace, sped up `rate_scale` times."""

    name: str
    path: str  # under ../shared/traces, or "sample:" and a bundled sample's name
    seconds: float
    rate_scale: float

    def load(self) -> Trace:
        if self.path.startswith("sample:"):
            trace = load_trace(str(resources.files("traces") / self.path.removeprefix("sample:")))
        else:
            trace = load_trace(SHARED / self.path)
        trace = transform.window(trace, 0.0, self.seconds)
        return transform.scale_rate(trace, self.rate_scale) if self.rate_scale != 1 else trace


WORKLOADS = (
    Workload("Mooncake conversation", "mooncake/conversation_trace.jsonl", 600.0, 1.0),
    Workload("Azure code", "azure2023/AzureLLMInferenceTrace_code.csv", 300.0, 6.0),
    Workload("Azure conversation", "azure2023/AzureLLMInferenceTrace_conv.csv", 300.0, 24.0),
)
QUICK_WORKLOADS = (
    Workload("Mooncake sample", "sample:samples/mooncake_conversation_head1000.jsonl", 120.0, 1.0),
)
RATIOS = ((0, 0), (2, 6), (4, 4), (5, 3), (6, 2))  # (prefill, decode); (0, 0): all mixed
QUICK_RATIOS = ((0, 0), (4, 4), (6, 2))
# Targets for llama-3-8b on H100: a 20 ms token is a fast reader's stream, 50 ms a chat's,
# 200 ms a batch answer's.
SLOS = {
    "tight TPOT": (2.0, 0.02),
    "chat": (2.0, 0.05),
    "loose": (5.0, 0.2),
}


@dataclass(frozen=True)
class Run:
    workload: Workload
    prefill: int
    decode: int
    policy: str = "lpm"

    @property
    def fleet(self) -> str:
        return f"{self.prefill}:{self.decode}" if self.prefill else "mixed"

    def config(self, seed: int) -> SimConfig:
        return SimConfig(
            num_workers=GPUS,
            prefill_workers=self.prefill,
            decode_workers=self.decode,
            topology=TOPOLOGY,
            policy=self.policy,
            seed=seed,
        )


def goodput_per_gpu(records: list[RequestRecord], ttft: float, tpot: float) -> float:
    """Requests meeting both targets per second of the run, per GPU."""
    if not records:
        return 0.0
    span = max(r.finish for r in records) - min(r.arrival for r in records)
    met = sum(1 for r in records if r.ttft <= ttft and (r.tpot is None or r.tpot <= tpot))
    return met / span / GPUS if span > 0 else 0.0


def _run_one(run: Run, seed: int) -> tuple[Run, dict]:
    result = simulate(run.workload.load(), roofline(MODEL, GPU), run.config(seed))
    summary = result.summary
    summary["goodput_per_gpu"] = {
        name: goodput_per_gpu(result.records, *targets) for name, targets in SLOS.items()
    }
    return run, summary


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def ratio_row(run: Run, summary: dict) -> dict[str, object]:
    moved = summary.get("kv_transfer", {})
    row: dict[str, object] = {
        "fleet": run.fleet,
        "TTFT p50 s": summary["ttft"]["p50"],
        "TTFT p99 s": summary["ttft"]["p99"],
        "TPOT p50 ms": _ms(summary["tpot"]["p50"]),
        "TPOT p99 ms": _ms(summary["tpot"]["p99"]),
        "e2e p50 s": summary["e2e"]["p50"],
        "KV mean ms": _ms(moved.get("mean")),
        "KV p99 ms": _ms(moved.get("p99")),
        "hit %": 100 * summary["prefix_cache"]["hit_rate"],
    }
    for name, value in summary["goodput_per_gpu"].items():
        row[f"{name} /s/GPU"] = value
    return row


def best_row(workload: Workload, results: list[tuple[Run, dict]]) -> dict[str, object]:
    """The fleet with the most goodput per GPU under each SLO, and by how much it beats mixed
    (a ratio below 1: mixed is best)."""
    mine = [(r, s) for r, s in results if r.workload == workload and r.policy == "lpm"]
    mixed = next(s for r, s in mine if not r.prefill)["goodput_per_gpu"]
    row: dict[str, object] = {"trace": workload.name}
    for name in SLOS:
        best, _ = max(mine, key=lambda rs: (rs[1]["goodput_per_gpu"][name], -rs[0].prefill))
        split = max(s["goodput_per_gpu"][name] for r, s in mine if r.prefill)
        row[f"{name}: best"] = best.fleet
        row[f"{name}: best split / mixed"] = split / mixed[name] if mixed[name] else None
    return row


def locality_row(run: Run, summary: dict) -> dict[str, object]:
    return {
        "fleet": run.fleet,
        "policy": run.policy,
        "hit %": 100 * summary["prefix_cache"]["hit_rate"],
        "TTFT p50 s": summary["ttft"]["p50"],
        "TTFT p99 s": summary["ttft"]["p99"],
        **{f"{name} /s/GPU": v for name, v in summary["goodput_per_gpu"].items()},
    }


Section = tuple[str, list[dict[str, object]]]


def run(
    seed: int = 0, out: Path | None = None, jobs: int | None = None, quick: bool = False
) -> list[Section]:
    """The experiment's tables (title, rows); `quick`: the bundled Mooncake sample, mixed,
    4:4 and 6:2."""
    workloads = QUICK_WORKLOADS if quick else WORKLOADS
    ratios = QUICK_RATIOS if quick else RATIOS
    runs = [Run(w, p, d) for w in workloads for p, d in ratios]
    local = workloads[0]
    runs += [Run(local, p, d, "least_load") for p, d in ((0, 0), (4, 4))]
    jobs = jobs or min(len(runs), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = map_runs(pool, _run_one, runs, [seed] * len(runs), counts=summary_counts)
    targets = ", ".join(f"{n}: TTFT {t:g} s, TPOT {1e3 * p:g} ms" for n, (t, p) in SLOS.items())
    sections: list[Section] = []
    for w in workloads:
        rows = [ratio_row(r, s) for r, s in results if r.workload == w and r.policy == "lpm"]
        count = len(w.load())
        title = (
            f"{w.name}: {count:,} requests over {w.seconds / w.rate_scale:g} s "
            f"({w.rate_scale:g}x the trace's rate), {GPUS} {GPU} GPUs, lpm; goodput per GPU "
            f"under each SLO ({targets})"
        )
        sections.append((title, rows))
    sections.append(
        (
            "The best fleet per SLO, and the best split's goodput over mixed's",
            [best_row(w, results) for w in workloads],
        )
    )
    sections.append(
        (
            f"Locality on the prefill pool ({local.name}): lpm against least_load, mixed and 4:4",
            [
                locality_row(r, s)
                for r, s in results
                if r.workload == local and (r.fleet in ("mixed", "4:4"))
            ],
        )
    )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for r, summary in results:
            slug = re.sub(r"[^A-Za-z0-9.]+", "_", f"{r.workload.name} {r.fleet} {r.policy}")
            (out / f"pd-{slug}.json").write_text(json.dumps(summary, indent=2) + "\n")
        text = "\n\n".join(f"{title}\n\n{format_table(rows)}" for title, rows in sections)
        (out / "pd.md").write_text(text + "\n")
    return sections
