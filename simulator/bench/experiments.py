"""`fairway experiment NAME`: the scenarios that show the policies behave as published.

Each experiment is a list of runs (a label, a workload, a cluster config) over one seeded
workload; runs go to parallel processes and come back as summary rows. Nothing is tuned to agree
with the papers: the workload parameters are set once, here, and the README reports the outcome.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from dashboards.tables import format_table, summary_row
from router.cost_model import roofline
from simulator.bench import agents, autoscale, pd, priority
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.fleet import ModelGroup
from simulator.progress import map_runs, summary_counts
from traces.generators import agent_loops, flood, late_joiner, lora_tenants, shared_prefix
from traces.loaders import load_trace
from traces.schema import Trace

MOONCAKE = Path("../shared/traces/mooncake/conversation_trace.jsonl")


@dataclass(frozen=True)
class Run:
    label: str
    workload: str  # a key of WORKLOADS
    config: SimConfig  # its seed is the experiment's


def _run(label: str, workload: str, policy: str, workers: int, **config: object) -> Run:
    return Run(label, workload, SimConfig(num_workers=workers, policy=policy, **config))


def _shared_prefix(rate: float) -> Callable[[int], Trace]:
    # 60 tenants x 4 documents of ~8k tokens: 1.9M prefix tokens, ~5 workers' worth of KV on
    # llama-3-8b/A100: they fit the cluster's caches together, not any one worker's.
    def make(seed: int) -> Trace:
        return shared_prefix(
            num_requests=int(170 * rate),
            num_tenants=60,
            prefixes_per_tenant=4,
            prefix_tokens=8000,
            question_tokens=200,
            output_tokens=128,
            rate=rate,
            seed=seed,
        )

    return make


def _flood(scale: int) -> Callable[[int], Trace]:
    def make(seed: int) -> Trace:
        return flood(
            duration=120.0,
            flood_rate=20.0 * scale,
            num_calm=4,
            calm_rate=1.0 * scale,
            flood_prefix_tokens=4000,
            calm_prefix_tokens=1000,
            seed=seed,
        )

    return make


def _mooncake(seed: int) -> Trace:
    return load_trace(MOONCAKE)


def _mooncake_head(seed: int) -> Trace:
    trace = load_trace(MOONCAKE)
    trace.requests = trace.requests[:3000]  # the first ~15 minutes
    return trace


def _documents(
    tenants: int, per_tenant: int, tokens: int, question: int, output: int, rate: float
) -> Callable[[int], Trace]:
    def make(seed: int) -> Trace:
        return shared_prefix(
            num_requests=int(150 * rate),
            num_tenants=tenants,
            prefixes_per_tenant=per_tenant,
            prefix_tokens=tokens,
            question_tokens=question,
            output_tokens=output,
            rate=rate,
            seed=seed,
        )

    return make


def _lora_tenants(seed: int) -> Trace:
    # 48 tenants, each its own adapter and ~6k-token system prompt (288k tokens in all, most
    # of one worker's KV), Zipf(1) popularity: more adapters than the fleet's 32 slots, the
    # head of the tail hot enough to hold on several workers. 30 req/s is about where the best
    # placement saturates once adapter loads are paid (LPM's TTFT p99 passes 10 s near 40).
    return lora_tenants(num_requests=3600, num_tenants=48, zipf=1.0, system_tokens=6000,
                        rate=30.0, seed=seed)  # fmt: skip


# 8 workers x 4 adapter slots (vLLM's --max-loras 4). A load takes 0.2 s: a rank-16 adapter on
# every projection of an 8B model is ~80 MB, read from local disk and copied in while the step
# waits (vLLM loads synchronously), so about as long as prefilling a 2k-token prompt here.
LORA_FLEET = ModelGroup(name="llama-3-8b", workers=8, adapter_slots=4, adapter_load_time=0.2)
FREE_ADAPTERS = LORA_FLEET.model_copy(update={"adapter_slots": 0, "adapter_load_time": 0.0})


def _agents(seed: int) -> Trace:
    # Preble's tool/agent kind: a shared tool preamble, then each session's growing history.
    return agent_loops(num_sessions=240, steps=10, preamble_tokens=3000, rate=2.0, seed=seed)


WORKLOADS: dict[str, Callable[[int], Trace]] = {
    "shared_prefix_8": _shared_prefix(8.0),
    "shared_prefix_24": _shared_prefix(24.0),
    "flood_1": _flood(1),
    "flood_4": _flood(4),
    "mooncake": _mooncake,
    "mooncake_3k": _mooncake_head,
    "light_late": lambda seed: late_joiner(rate=18.0, late_rate=6.0, seed=seed),
    "heavy_late": lambda seed: late_joiner(rate=12.0, late_rate=12.0, seed=seed),
    # One worker's cache holds about half of these 128 documents of ~8k tokens: locality is
    # worth throughput (DLPM's setting), and the worker is overloaded.
    "documents_1w": _documents(32, 4, 8000, 200, 128, 5.0),
    # Preble's workload kinds: long-document QA (many long documents, a few questions each) and
    # shared long prefixes such as video QA (a few very long prefixes, many short questions).
    "long_documents": _documents(40, 2, 16000, 100, 64, 6.0),
    "video_qa": _documents(4, 2, 10000, 30, 32, 24.0),
    "agents": _agents,
    "lora_tenants": _lora_tenants,
}

_REPLICA_WORKLOADS: list[tuple[str, str, str, int, dict[str, object]]] = [
    ("mooncake lpm", "mooncake_3k", "lpm", 8, {}),
    ("flood vtc", "flood_4", "vtc", 4, {"placement": "router", "window": 64}),
]
# (routers, sync seconds): one router, then 2, 4 and 8 replicas at each sync interval.
_REPLICA_SETTINGS = [(1, 0.0), *((n, s) for n in (2, 4, 8) for s in (0.0, 0.1, 1.0, 10.0))]


def _replicas(n: int, extra: dict[str, object]) -> dict[str, object]:
    """Split a router-side window over the replicas, so N routers hold as much in flight at a
    worker as one (each replica's queue has its own window)."""
    return {**extra, "window": max(1, extra["window"] // n)} if "window" in extra else extra


def _beside_one_router(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """The replicas rows with each one's service gap over one router's on the same workload,
    and every column on every row (the table takes its columns from the first)."""
    for kind, *_ in _REPLICA_WORKLOADS:
        one = next((r["gap (k tok)"] for r in rows if r["policy"] == f"{kind} 1 router"), 0)
        for row in rows:
            if one and str(row["policy"]).startswith(f"{kind} "):
                row["gap / 1 router"] = row["gap (k tok)"] / one  # type: ignore[operator]
    columns = list(dict.fromkeys(c for row in rows for c in row))
    return [{c: row.get(c) for c in columns} for row in rows]


EXPERIMENTS: dict[str, tuple[str, list[Run]]] = {
    "vtc": (
        "VTC's headline comparison on one overloaded worker: a steady client from the start and "
        "one that idles for the first minute, then asks for a third as much (light) or as much "
        "(heavy); FCFS, least counter first without VTC's lift, VTC",
        [
            _run(f"{kind} {local}", f"{kind}_late", "least_load", 1, local_policy=local)
            for kind in ("light", "heavy")
            for local in ("fcfs", "lcf", "vtc")
        ],
    ),
    "dlpm": (
        "DLPM's headline comparison: 32 tenants x 4 documents of ~8k tokens on one overloaded "
        "worker whose cache holds about half of them; DLPM's quantum swept between VTC "
        "(fairness) and LPM (locality)",
        [
            _run("fcfs", "documents_1w", "least_load", 1, local_policy="fcfs"),
            _run("vtc", "documents_1w", "least_load", 1, local_policy="vtc"),
            *(
                _run(
                    f"dlpm Q={q}",
                    "documents_1w",
                    "lpm",
                    1,
                    local_policy="dlpm",
                    local_params={"quantum": q},
                )
                for q in (256, 2048, 16384, 131072)
            ),
            _run("lpm", "documents_1w", "lpm", 1, local_policy="lpm"),
        ],
    ),
    "preble": (
        "Preble's headline comparison on its workload kinds, 8 workers: tool/agent sessions "
        "(closed loop), long-document QA, shared long prefixes (video QA)",
        [
            _run(f"{kind} {policy}", kind, policy, 8, closed_loop=kind == "agents")
            for kind in ("agents", "long_documents", "video_qa")
            for policy in ("round_robin", "least_load", "lpm", "preble")
        ],
    ),
    "shared-prefix": (
        "Tenants with long shared documents, Poisson arrivals at 8 and 24 req/s, 8 workers "
        "(Preble's setting)",
        [
            _run(f"{rate} req/s {policy}", f"shared_prefix_{rate}", policy, 8)
            for rate in (8, 24)
            for policy in ("round_robin", "least_load", "lpm", "preble")
        ],
    ),
    "flood": (
        "One client floods over a 4k-token shared prefix next to 4 calm clients: one worker "
        "(local disciplines), then four (global + local)",
        [
            _run("1w fcfs", "flood_1", "least_load", 1),
            _run("1w lpm", "flood_1", "lpm", 1),
            _run("1w vtc", "flood_1", "vtc", 1),
            *(
                _run(
                    f"1w dlpm Q={q}",
                    "flood_1",
                    "lpm",
                    1,
                    local_policy="dlpm",
                    local_params={"quantum": q},
                )
                for q in (256, 2048, 16384, 131072)
            ),
            _run("4w least_load", "flood_4", "least_load", 4),
            _run("4w lpm", "flood_4", "lpm", 4),
            _run("4w vtc", "flood_4", "vtc", 4),
            _run("4w dlpm", "flood_4", "dlpm", 4),
            _run("4w d2lpm", "flood_4", "d2lpm", 4),
        ],
    ),
    "mooncake": (
        "Mooncake conversation trace (12,031 requests, 1 hour), 8 workers",
        [
            _run(name, "mooncake", name, 8)
            for name in (
                "round_robin",
                "random",
                "least_load",
                "power_of_two",
                "lpm",
                "preble",
                "vtc",
                "dlpm",
                "d2lpm",
            )
        ],
    ),
    "index-modes": (
        "Mooncake conversation trace, 8 workers: the router's index updated on routing "
        "(approximate) or from the engines' KV events, on time or 1 s late (precise)",
        [
            _run(f"{policy} {label}", "mooncake", policy, 8, index=index, kv_event_delay=delay)
            for policy in ("lpm", "preble", "d2lpm")
            for label, index, delay in (
                ("approximate", "approximate", 0.0),
                ("precise", "precise", 0.0),
                ("precise +1 s", "precise", 1.0),
            )
        ],
    ),
    "placement": (
        "The flood on one worker with VTC in the engine's scheduler, or in the router's queue in "
        "front of an FCFS engine with N requests in flight (the live proxy's arrangement)",
        [
            _run("fcfs in the engine", "flood_1", "least_load", 1),
            _run("vtc in the engine", "flood_1", "vtc", 1),
            *(
                _run(f"vtc at the router, N={n}", "flood_1", "vtc", 1, placement="router", window=n)
                for n in (1, 4, 16, 64, 256)
            ),
        ],
    ),
    "replicas": (
        "Router replicas that share counters and routing decisions every S seconds: the "
        "Mooncake trace's first 3,000 requests with LPM on 8 workers (hit rate), and the flood "
        "with VTC at the router on 4 workers (a window of 64 split over the replicas; service gap, "
        "and the gap over one router's)",
        [
            _run(
                f"{kind} {n} routers sync {sync:g} s" if n > 1 else f"{kind} 1 router",
                workload,
                policy,
                workers,
                routers=n,
                router_sync=sync,
                **_replicas(n, extra),
            )
            for kind, workload, policy, workers, extra in _REPLICA_WORKLOADS
            for n, sync in _REPLICA_SETTINGS
        ],
    ),
    "adapters": (
        "48 tenants, each with its own LoRA adapter and 6k-token system prompt, Zipf(1) "
        "popularity, 30 req/s on 8 workers with 4 adapter slots each and 0.2 s loads: routing "
        "blind to adapters, or preferring their holders (unless a load elsewhere starts sooner); "
        "last, LPM with loads free and unlimited slots (the fleet without adapter costs)",
        [
            *(
                _run(
                    f"blind {policy}",
                    "lora_tenants",
                    policy,
                    8,
                    groups=(LORA_FLEET,),
                    adapter_affinity=False,
                )  # fmt: skip
                for policy in ("least_load", "lpm")
            ),
            *(
                _run(f"affinity {policy}", "lora_tenants", policy, 8, groups=(LORA_FLEET,))
                for policy in ("least_load", "lpm", "d2lpm")
            ),
            _run(
                "lpm, adapters free",
                "lora_tenants",
                "lpm",
                8,
                groups=(FREE_ADAPTERS,),
                adapter_affinity=False,
            ),  # fmt: skip
        ],
    ),
    "cache-pressure": (
        "Shared documents at 24 req/s on 8 workers (more documents than one worker's cache, "
        "overloaded): fairness against locality, D²LPM's quantum as its charges set it (the "
        "default), then swept",
        [
            _run("vtc", "shared_prefix_24", "vtc", 8),
            _run("lpm", "shared_prefix_24", "lpm", 8),
            _run("dlpm", "shared_prefix_24", "dlpm", 8),
            _run("d2lpm Q from its charges", "shared_prefix_24", "d2lpm", 8),
            *(
                _run(
                    f"d2lpm Q={q}",
                    "shared_prefix_24",
                    "d2lpm",
                    8,
                    policy_params={"quantum": q},
                    local_params={"quantum": q},
                )
                for q in (2048, 8192, 32768)
            ),
        ],
    ),
}


def _run_one(run: Run, seed: int) -> tuple[Run, dict[str, object]]:
    trace = WORKLOADS[run.workload](seed)
    config = replace(run.config, seed=seed)
    result = simulate(trace, roofline("llama-3-8b", "a100-80g"), config)
    return run, result.summary


def experiment_row(label: str, summary: dict[str, object]) -> dict[str, object]:
    row = summary_row(label, summary)
    clients = summary["per_client"]
    calm = [c for name, c in clients.items() if name != "flood"]  # type: ignore[union-attr]
    if "flood" in clients:  # type: ignore[operator]
        row["calm TTFT s"] = sum(c["ttft"]["mean"] for c in calm) / len(calm)
        row["flood TTFT s"] = clients["flood"]["ttft"]["mean"]  # type: ignore[index]
    if "late" in clients:  # type: ignore[operator]
        for name in ("steady", "late"):
            row[f"{name} TTFT s"] = clients[name]["ttft"]["mean"]  # type: ignore[index]
    row["gap (k tok)"] = summary["fairness"]["max_service_gap"] / 1000  # type: ignore[index]
    promised = summary["prefix_cache"]["predicted_hit_rate"]  # type: ignore[index]
    row["promised hit %"] = None if promised is None else 100 * promised  # type: ignore[operator]
    if summary["config"].get("groups"):  # type: ignore[attr-defined]
        row["TTFT p50 s"] = summary["ttft"]["p50"]  # type: ignore[index]
        minutes = summary["simulated_seconds"] / 60  # type: ignore[operator]
        row["adapter loads/min"] = summary["adapter_loads"] / minutes if minutes else None  # type: ignore[operator]
    for key in ("done", "TPOT ms", "imbalance", "bound %"):
        row.pop(key, None)
    return row


def run_experiment(name: str, seed: int = 0, out: Path | None = None, jobs: int | None = None):
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of: {', '.join(EXPERIMENTS)}")
    title, runs = EXPERIMENTS[name]
    if any(r.workload.startswith("mooncake") for r in runs) and not MOONCAKE.exists():
        raise ValueError(f"experiment {name} needs {MOONCAKE}")
    jobs = jobs or min(len(runs), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = map_runs(pool, _run_one, runs, [seed] * len(runs), counts=summary_counts)
    rows = [experiment_row(run.label, summary) for run, summary in results]
    if name == "replicas":
        rows = _beside_one_router(rows)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for run, summary in results:
            slug = re.sub(r"[^A-Za-z0-9.]+", "_", run.label)
            (out / f"{name}-{slug}.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / f"{name}.md").write_text(f"{title}\n\n{format_table(rows)}\n")
    return title, rows


# Experiments that measure the fleet before they choose their runs, each with its own runner
# returning its tables, (title, rows) each; `quick` is their smallest configuration.
MEASURED: dict[str, Callable[..., list[tuple[str, list[dict[str, object]]]]]] = {
    "priority": priority.run,
    "pd": pd.run,
    "agents": agents.run,
    "autoscale": autoscale.run,
}
NAMES = [*EXPERIMENTS, *MEASURED]


def experiment_tables(
    name: str, seed: int = 0, out: Path | None = None, quick: bool = False
) -> list[tuple[str, list[dict[str, object]]]]:
    """Any experiment's tables, (title, rows) each."""
    if name in MEASURED:
        return MEASURED[name](seed=seed, out=out, quick=quick)
    return [run_experiment(name, seed=seed, out=out)]
