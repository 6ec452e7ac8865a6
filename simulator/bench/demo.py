"""`make demo`: every policy on two workloads side by side, a verdict for each, then reports.

The bundled Mooncake sample is production chat traffic with little reuse: a load-spreading
policy wins there. The shared-document workload is what a cache-aware, fair router is for:
tenants of unequal demand asking many questions over long documents. The verdicts are computed
from each run's figures (the cache-hit bound, who has the lowest TTFT, who is fairest), so they
stay true when the numbers move.
"""

from __future__ import annotations

import functools
import os
import textwrap
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import policies
from dashboards.report import load_run, write_report
from dashboards.tables import format_table
from router.cost_model import roofline
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.progress import command_bar, summary_counts, wait_runs
from simulator.results import write_results
from traces.generators import shared_prefix
from traces.loaders import load_trace
from traces.schema import Trace
from traces.transform import assign_tenants

SAMPLE = "samples/mooncake_conversation_head1000.jsonl"
MODEL, GPU = "llama-3-8b", "a100-80g"
OUT = Path("build/demo")
# 16 tenants x 24 documents of ~3k tokens (1.15M tokens: about 2.7 workers' KV on
# llama-3-8b/A100, so they fit the cluster's caches together but not one worker's), 200-token
# questions and 128-token answers at 100 req/s: routing blind to the caches re-reads documents
# often enough to swamp 8 workers, while questions sent where their document is cached do not.
# Demand is Zipf 1.5 over the tenants: the busiest sends about half the requests, the quietest
# under 1 %. 5,000 requests (50 simulated seconds) take 1 to 3 s per policy.
DOCUMENTS: dict[str, float] = {
    "num_requests": 5000,
    "num_tenants": 16,
    "prefixes_per_tenant": 24,
    "prefix_tokens": 3000,
    "question_tokens": 200,
    "output_tokens": 128,
    "rate": 100.0,
    "tenant_skew": 1.5,
}
TIE = 0.05  # figures within 5 % of the best share the win
# A winner that hit at least this fraction of the best hit rate kept locality; below it, it won
# by spreading load.
KEPT_LOCALITY = 0.9


@dataclass(frozen=True)
class Workload:
    key: str  # its folder under the demo's output
    title: str  # how its table and verdict name it
    about: str  # one line on what it is
    build: Callable[[], Trace]  # a fresh trace per run: a replay may rewrite arrivals


@dataclass
class Comparison:
    workload: Workload
    summaries: dict[str, dict]  # policy -> summary.json
    rows: list[dict[str, object]]
    verdict: str
    report: Path


def _mooncake_trace(requests: int | None, tenants: int) -> Trace:
    trace = load_trace(str(resources.files("traces") / SAMPLE))
    if requests is not None:
        trace.requests = trace.requests[:requests]
    return assign_tenants(trace, tenants, skew=1.0)


def _documents_trace(p: dict[str, float]) -> Trace:
    ints = {k: int(v) for k, v in p.items() if k not in ("rate", "tenant_skew")}
    return shared_prefix(**ints, rate=p["rate"], tenant_skew=p["tenant_skew"])


def mooncake_sample(requests: int | None = None, tenants: int = 4) -> Workload:
    """The bundled Mooncake sample (its first `requests`), its requests dealt to `tenants`
    with Zipf-skewed shares so the fairness columns have something to say."""
    n = f"the first {requests:,}" if requests is not None else "1,000"
    return Workload(
        "mooncake",
        "Mooncake sample",
        f"traces/{SAMPLE}: {n} requests of Mooncake's chat service, dealt to {tenants} tenants",
        functools.partial(_mooncake_trace, requests, tenants),
    )


def shared_documents(**overrides: float) -> Workload:
    """`shared_prefix` with DOCUMENTS' parameters (or `overrides`): tenants of unequal demand
    asking questions over their own long documents."""
    p = {**DOCUMENTS, **overrides}
    return Workload(
        "documents",
        "Shared documents",
        f"generator shared_prefix: {int(p['num_tenants'])} tenants with "
        f"{int(p['prefixes_per_tenant'])} documents of ~{p['prefix_tokens'] / 1000:g}k tokens "
        f"each, {int(p['num_requests']):,} questions at {p['rate']:g} req/s, demand Zipf "
        f"{p['tenant_skew']:g} over the tenants",
        functools.partial(_documents_trace, p),
    )


def demo_workloads() -> list[Workload]:
    return [mooncake_sample(), shared_documents()]


def demo_row(policy: str, summary: dict) -> dict[str, object]:
    """The columns the demo's tables show, from a summary.json dict."""
    ttft, fairness = summary["ttft"], summary["fairness"]
    return {
        "policy": policy,
        "TTFT mean s": ttft["mean"],
        "TTFT p50 s": ttft["p50"],
        "TTFT p99 s": ttft["p99"],
        "hit %": 100 * summary["prefix_cache"]["hit_rate"],
        "out tok/s": summary["throughput"]["output_tokens_per_s"],
        "Jain": fairness["jain"],
        "gap M tok": fairness["max_service_gap"] / 1e6,
    }


def _n(x: float) -> str:
    """Three significant figures, as the sentences quote them."""
    return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def _names(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _lowest(values: dict[str, float]) -> list[str]:
    """The policy with the lowest value and any within TIE of it, lowest first."""
    best = min(values.values())
    return sorted((p for p, v in values.items() if v <= best * (1 + TIE)), key=values.__getitem__)


def best_ttft(summaries: dict[str, dict]) -> list[str]:
    """The policies with the lowest mean TTFT (within TIE of the lowest), best first."""
    return _lowest({p: s["ttft"]["mean"] for p, s in summaries.items()})


def fairest(summaries: dict[str, dict]) -> list[str]:
    """The policies with the smallest service gap between backlogged tenants (within TIE)."""
    return _lowest({p: s["fairness"]["max_service_gap"] for p, s in summaries.items()})


def verdict(title: str, summaries: dict[str, dict]) -> str:
    """One sentence from the figures: who wins TTFT and why (the cache-hit bound, and whether
    the winner kept locality or spread load), then who keeps tenants fairest."""
    ttft = {p: s["ttft"]["mean"] for p, s in summaries.items()}
    hit = {p: 100 * s["prefix_cache"]["hit_rate"] for p, s in summaries.items()}
    gap = {p: s["fairness"]["max_service_gap"] / 1e6 for p, s in summaries.items()}
    bound = 100 * max(s["prefix_cache"]["bound"] for s in summaries.values())
    winners = best_ttft(summaries)
    lead = winners[0]
    most = max(hit, key=hit.__getitem__)
    # The reference for locality: least_load spreads load and ignores caches.
    spread = "least_load" if "least_load" in hit else min(hit, key=hit.__getitem__)
    level = "low" if bound < 40 else "high" if bound >= 60 else "moderate"
    reuse = f"reuse is {level} ({_n(bound)} % of prompt tokens could hit a cache)"
    times = " and ".join(_n(ttft[p]) for p in winners[:2]) + (" ..." if len(winners) > 2 else "")
    verb = "wins" if len(winners) == 1 else "win"
    head = f"{title}: {_names(winners)} {verb} TTFT ({times} s mean)"
    if hit[most] <= (1 + TIE) * hit[spread] + 1:  # within 5 % and a point: no locality to win
        why = (
            f"{reuse}, and every policy hit about as much ({_n(min(hit.values()))}-"
            f"{_n(hit[most])} %), so load and queue order decide"
        )
    elif hit[lead] >= KEPT_LOCALITY * hit[most] and lead != spread:
        why = (
            f"{reuse} and {lead} hit {_n(hit[lead])} % against {spread}'s {_n(hit[spread])} %, "
            f"so sending each prompt where its prefix is cached matters more than spreading load"
        )
    else:
        why = (
            f"{reuse}, and the policy that hit the most ({most}, {_n(hit[most])} %) averaged "
            f"{_n(ttft[most])} s, so spreading load matters more than locality"
        )
    fair = fairest(summaries)
    worst = max(gap, key=gap.__getitem__)
    also = " also" if fair[0] in winners else ""
    fair_part = (
        f"{_names(fair)}{also} {'keeps' if len(fair) == 1 else 'keep'} tenants fairest (a "
        f"service gap of {_n(gap[fair[0]])}M tokens between backlogged tenants, against "
        f"{_n(gap[worst])}M under {worst})"
    )
    if not also:
        fair_part += f" but at {_n(ttft[fair[0]])} s mean TTFT"
        # The fairness the fast policies give: the fairest of those within 2x the best TTFT.
        fast = {p: gap[p] for p in ttft if ttft[p] <= 2 * ttft[lead]}
        fast_fair = min(fast, key=fast.__getitem__)
        if fast_fair not in fair:
            fair_part += (
                f"; of the policies within 2x the best TTFT, {fast_fair} is fairest "
                f"({_n(gap[fast_fair])}M)"
            )
    return f"{head}: {why}; {fair_part}."


def _run_policy(workload: Workload, policy: str, workers: int, out: Path) -> tuple[str, dict]:
    """One policy on one workload, in a pool process: its run written under OUT/KEY/POLICY;
    the run's folder and summary."""
    config = SimConfig(num_workers=workers, policy=policy, show_progress=False)
    result = simulate(workload.build(), roofline(MODEL, GPU), config)
    run_dir = out / workload.key / policy
    write_results(run_dir, result.summary, result.records)
    return str(run_dir), result.summary


def compare_workload(workload: Workload, runs: Sequence[tuple[str, dict]], out: Path) -> Comparison:
    """A workload's runs (folder and summary per policy), ranked, with a verdict and a
    report."""
    summaries = {Path(folder).name: summary for folder, summary in runs}
    report = write_report(
        [load_run(Path(folder)) for folder, _ in runs],
        out / workload.key / "report.html",
        title=f"Fairway demo: {workload.title}",
    )
    ranked = sorted(summaries, key=lambda n: summaries[n]["ttft"]["mean"])
    rows = [demo_row(n, summaries[n]) for n in ranked]
    return Comparison(workload, summaries, rows, verdict(workload.title, summaries), report)


def _demand(trace: Trace) -> str:
    counts = Counter(r.client for r in trace.requests)
    top, low = max(counts.values()), min(counts.values())
    return (
        f"the busiest tenant sends {_n(100 * top / len(trace))} % of the requests, the "
        f"quietest {_n(100 * low / len(trace))} %"
    )


def run_demo(workers: int = 8, out: Path = OUT) -> int:
    """`fairway demo`: both workloads under every policy, printed, with a report each."""
    demo(workers, out)
    return 0


def demo(
    workers: int = 8,
    out: Path = OUT,
    workloads: Sequence[Workload] | None = None,
    policy_names: Sequence[str] | None = None,
) -> list[Comparison]:
    """Print a table and a verdict per workload; write the runs and reports under `out`."""
    workloads = list(workloads or demo_workloads())
    names = list(policy_names or policies.global_policies.names())

    def say(text: str) -> None:
        print(textwrap.fill(text, width=100))

    say(
        f"Fairway demo: {len(names)} policies on {len(workloads)} workloads, each on {workers} "
        f"simulated {MODEL} workers ({GPU}), ranked by mean TTFT. Fairness: gap is the largest "
        f"service difference between two backlogged tenants (lower is fairer), Jain the index "
        f"over the tenants waiting together (higher is fairer)."
    )
    done = []
    jobs = min(len(names) * len(workloads), os.cpu_count() or 1)
    with (
        command_bar("demo", num_runs=len(names) * len(workloads)),
        ProcessPoolExecutor(jobs) as pool,
    ):
        # Every run is queued at once: the next workload's runs go on while this one's report
        # is drawn.
        queued = [
            [pool.submit(_run_policy, workload, name, workers, out) for name in names]
            for workload in workloads
        ]
        for workload, futures in zip(workloads, queued, strict=True):
            print()
            say(f"== {workload.title} ({workload.about}); {_demand(workload.build())}.")
            comparison = compare_workload(workload, wait_runs(futures, summary_counts), out)
            bound = 100 * max(s["prefix_cache"]["bound"] for s in comparison.summaries.values())
            print()
            print(format_table(comparison.rows))
            print(f"(cache-hit bound: {_n(bound)} % of prompt tokens)\n")
            say(comparison.verdict)
            done.append(comparison)
    print("\nReports (latency CDFs, per-tenant service and TTFT, per-worker load):")
    for comparison in done:
        print(f"  {comparison.workload.title}: {comparison.report.resolve()}")
    print(
        "`fairway simulate --help` replays your own trace; `fairway compare` runs policies on it."
    )
    return done
