"""`fairway experiment agents`: coding agents and tool-calling assistants, whose contexts grow
turn by turn, under every policy.

Closed-loop agent sessions (traces.generators.agent_sessions): a preamble per tenant of ~6k
tokens, then each turn adds the model's answer and a tool result of a few hundred to a few
thousand tokens, to contexts of 15-40k tokens by the last turns; tenants of Zipf-unequal demand.
llama-3-8b on H100s, 8 workers, then 64 with eight times the session rate.

A first turn can hit only its tenant's preamble; a later turn can hit everything the previous
turn read and wrote, if it runs where that turn ran. So the figures are the hit rate against
the infinite-cache bound (one unbounded cache shared by every worker: what no placement can
beat), TTFT of first and of later turns, and the fairness between tenants (the service gap
between backlogged tenants and Jain's index, as `fairway simulate` reports them).
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dashboards.tables import format_table
from router.cost_model import roofline
from router.records import RequestRecord
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.progress import map_runs, summary_counts
from traces.generators import agent_sessions

MODEL, GPU = "llama-3-8b", "h100"
POLICIES = ("round_robin", "least_load", "lpm", "dlpm", "d2lpm", "vtc", "preble")
# Locality-blind baselines: what a policy's hits are measured against.
BLIND = ("round_robin", "least_load")
TIE = 0.05  # figures within 5 % of the best share the win


@dataclass(frozen=True)
class Fleet:
    """A fleet size and the agent sessions sized to it."""

    workers: int
    sessions: int
    rate: float  # sessions started a second
    mean_turns: float = 16

    def trace_params(self) -> dict[str, object]:
        return {"num_sessions": self.sessions, "rate": self.rate, "mean_turns": self.mean_turns}


# 160 sessions at 2 a second keep about a hundred agents busy on 8 workers: enough that a later
# turn sent away from its history re-prefills ~20k tokens behind others doing the same. 64
# workers get eight times the rate (half as long: the same number of busy agents per worker).
FLEETS = (Fleet(8, 160, 2.0), Fleet(64, 640, 16.0))
QUICK_FLEETS = (Fleet(4, 24, 1.0, mean_turns=6),)


@dataclass(frozen=True)
class Run:
    fleet: Fleet
    policy: str


def turn_ttfts(records: Sequence[RequestRecord]) -> tuple[list[float], list[float]]:
    """TTFTs of each session's first turn, and of its later turns (a request with no session
    is a first turn)."""
    sessions: dict[str, list[RequestRecord]] = defaultdict(list)
    first: list[float] = []
    for r in records:
        if r.session is None:
            first.append(r.ttft)
        else:
            sessions[r.session].append(r)
    later: list[float] = []
    for turns in sessions.values():
        turns.sort(key=lambda r: r.arrival)
        first.append(turns[0].ttft)
        later += [r.ttft for r in turns[1:]]
    return first, later


def _mean_p90(values: list[float]) -> tuple[float | None, float | None]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (None, None)
    return statistics.fmean(values), statistics.quantiles(values, n=10, method="inclusive")[-1]


def _run_one(run: Run, seed: int) -> tuple[Run, dict]:
    trace = agent_sessions(**run.fleet.trace_params(), seed=seed)  # type: ignore[arg-type]
    config = SimConfig(
        num_workers=run.fleet.workers, policy=run.policy, closed_loop=True, seed=seed
    )
    result = simulate(trace, roofline(MODEL, GPU), config)
    first, later = turn_ttfts(result.records)
    summary = result.summary
    summary["turns"] = {"first": _mean_p90(first), "later": _mean_p90(later)}
    return run, summary


def agents_row(run: Run, summary: dict) -> dict[str, object]:
    cache, fairness = summary["prefix_cache"], summary["fairness"]
    (first_mean, first_p90), (later_mean, later_p90) = (
        summary["turns"]["first"],
        summary["turns"]["later"],
    )
    return {
        "policy": run.policy,
        "hit %": 100 * cache["hit_rate"],
        "bound %": 100 * cache["bound"],
        "of bound %": 100 * cache["hit_rate"] / cache["bound"] if cache["bound"] else None,
        "first TTFT s": first_mean,
        "first p90 s": first_p90,
        "later TTFT s": later_mean,
        "later p90 s": later_p90,
        "out tok/s": summary["throughput"]["output_tokens_per_s"],
        "gap M tok": fairness["max_service_gap"] / 1e6,
        "Jain": fairness["jain"],
    }


def _n(x: float) -> str:
    """Three significant figures, as the sentences quote them."""
    return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"


def _names(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def verdict(workers: int, rows: Sequence[dict[str, object]]) -> str:
    """Who wins later turns' TTFT and why (its hits against the bound and the blind
    baselines'), then the fairest of the policies within 2x its TTFT."""
    later = {str(r["policy"]): float(r["later TTFT s"]) for r in rows}  # type: ignore[arg-type]
    hit = {str(r["policy"]): float(r["hit %"]) for r in rows}  # type: ignore[arg-type]
    gap = {str(r["policy"]): float(r["gap M tok"]) for r in rows}  # type: ignore[arg-type]
    bound = max(float(r["bound %"]) for r in rows)  # type: ignore[arg-type]
    best = min(later.values())
    winners = sorted((p for p, v in later.items() if v <= best * (1 + TIE)), key=later.__getitem__)
    lead = winners[0]
    blind = [p for p in BLIND if p in hit] or [min(hit, key=hit.__getitem__)]
    ref = min(blind, key=later.__getitem__)
    verb = "wins" if len(winners) == 1 else "win"
    head = (
        f"{workers} workers: {_names(winners)} {verb} later turns' TTFT ({_n(later[lead])} s "
        f"mean, {_n(later[ref] / later[lead])}x faster than {ref})"
    )
    if hit[lead] >= hit[ref] + 5:
        why = (
            f"{lead} hit {_n(hit[lead])} % of prompt tokens, {_n(100 * hit[lead] / bound)} % "
            f"of the infinite-cache bound ({_n(bound)} %), against {ref}'s {_n(hit[ref])} %: a "
            f"later turn sent where its session last ran re-reads only the newest tool result"
        )
    else:
        why = (
            f"{lead} hit no more than {ref} ({_n(hit[lead])} % against {_n(hit[ref])} %, bound "
            f"{_n(bound)} %), so spreading load decided"
        )
    # Locality policies that kept less of it than the winner (above the blind ones' level).
    floor = max(hit[p] for p in blind) + 5
    missed = sorted(
        (p for p in hit if p not in winners and floor < hit[p] < hit[lead] - 2),
        key=hit.__getitem__,
    )
    if missed:
        kept = _names([f"{p} ({_n(hit[p])} %)" for p in missed])
        why += f"; {kept} kept less of that locality"
    fast = [p for p in later if later[p] <= 2 * later[lead]]
    least = min(gap[p] for p in fast)
    fair = sorted((p for p in fast if gap[p] <= least * (1 + TIE)), key=gap.__getitem__)
    verb = "keeps" if len(fair) == 1 else "keep"
    fair_part = (
        f"of the policies within 2x its TTFT, {_names(fair)} {verb} tenants fairest (a service "
        f"gap of {_n(gap[fair[0]])}M tokens between backlogged tenants, against "
        f"{_n(max(gap.values()))}M at most)"
    )
    return f"{head}: {why}; {fair_part}."


Section = tuple[str, list[dict[str, object]]]


def run(
    seed: int = 0, out: Path | None = None, jobs: int | None = None, quick: bool = False
) -> list[Section]:
    """The experiment's tables (title, rows), one per fleet, then the verdicts; `quick`: 24
    short sessions on 4 workers."""
    fleets = QUICK_FLEETS if quick else FLEETS
    runs = [Run(f, p) for f in fleets for p in POLICIES]
    jobs = jobs or min(len(runs), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = map_runs(pool, _run_one, runs, [seed] * len(runs), counts=summary_counts)
    sections: list[Section] = []
    verdicts = []
    for f in fleets:
        mine = [(r, s) for r, s in results if r.fleet == f]
        rows = [agents_row(r, s) for r, s in mine]
        requests = mine[0][1]["total"]
        title = (
            f"{f.workers} {GPU} workers, {MODEL}: {f.sessions:,} agent sessions ({requests:,} "
            f"requests) started at {f.rate:g} a second, closed loop; hit rate against the "
            f"infinite-cache bound, TTFT of first and later turns, fairness between tenants"
        )
        sections.append((title, rows))
        verdicts.append({"verdict": verdict(f.workers, rows)})
    sections.append(("Verdict", verdicts))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for r, summary in results:
            name = f"agents-{r.fleet.workers}w-{r.policy}.json"
            (out / name).write_text(json.dumps(summary, indent=2) + "\n")
        text = "\n\n".join(f"{title}\n\n{format_table(rows)}" for title, rows in sections)
        (out / "agents.md").write_text(text + "\n")
    return sections
