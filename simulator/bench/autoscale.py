"""`fairway experiment autoscale`: what the fleet planner is worth on a day of ServeGen traffic.

Four ServeGen clients (language, m-small: chunk-6, -31, -36 and -41; arrivals and lengths drawn
from the dataset's per-window fits) merged into one day, served by llama-3-8b on H100 under
TTFT 2 s and TPOT 0.1 s, five ways:

- static peak: a fixed fleet sized for the busiest 600 s window;
- static mean: a fixed fleet sized for the day's mean rate;
- reactive: a utilization-threshold autoscaler (router.planner.ReactivePlanner, as HPA/KPA);
- planner: Fairway's planner (router.planner.Planner);
- oracle: knows the trace: each decision targets the most workers any 600 s window between now
  and a start-up and an interval ahead needs.

Every fleet is sized with the planner's own per-worker rate (its cost-model estimate at its
headroom), so the static fleets and the oracle are what the planner would pick if it knew the
load. The day is played `speedup` times faster (each 600 s window at its own rate for
600/speedup s), and the autoscalers' start-up, interval and cool-down shrink with it, so each
sees the day's ramps as it would in real time; GPU-hours are reported for the day (the run's
times `speedup`).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from dashboards.tables import format_table
from router.classes import TrafficClass
from router.cost_model import CostModel, roofline
from router.planner import Fleet, Plan, Planner, PlannerConfig, ReactivePlanner, Window
from simulator.config import SimConfig
from simulator.driver import SimCluster
from simulator.progress import map_runs, summary_counts
from traces.loaders import SERVEGEN_WINDOW, load_servegen
from traces.schema import Trace

MODEL, GPU = "llama-3-8b", "h100"
SERVEGEN = Path("../shared/traces/servegen/language/m-small")
# A morning ramp (41 and 31 wake at 08:00), a midday burst of long answers (6, 10:00-13:00)
# and a steady base (36).
CLIENTS = ("chunk-6", "chunk-31", "chunk-36", "chunk-41")
TARGETS = (TrafficClass("default", priority=0, ttft=2.0, tpot=0.1),)
POLICY = "least_load"  # lpm routes a cold worker little until its imbalance rule trips
GOAL = 0.99  # the attainment the planner must reach
WITHIN = 1.15  # ... on at most this many times the oracle's GPU-hours
HOUR = 3600.0


@dataclass(frozen=True)
class Day:
    """`duration` trace seconds from `start`, played `speedup` times faster; the autoscalers'
    times are in trace seconds too (divided by `speedup` when run)."""

    start: float = 0.0
    duration: float = 24 * HOUR
    speedup: float = 48.0
    startup: float = 60.0
    interval: float = 60.0
    seed: int = 0

    def load(self) -> Trace:
        return load_servegen(
            SERVEGEN,
            seed=self.seed,
            start=self.start,
            duration=self.duration,
            clients=CLIENTS,
            speedup=self.speedup,
        )

    @property
    def window(self) -> float:
        """A ServeGen window in run seconds."""
        return SERVEGEN_WINDOW / self.speedup


FULL = Day()
# The morning ramp and the midday burst, 08:00-12:00, played in a minute.
QUICK = Day(start=8 * HOUR, duration=4 * HOUR, speedup=240.0)


def window_needs(trace: Trace, planner: Planner, span: float) -> list[int]:
    """Workers each `span`-second window of `trace` needs at the planner's headroom, for its
    own rate and mix."""
    bins: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in trace.requests:
        b = bins[int(r.arrival // span)]
        b[0] += 1
        b[1] += r.prompt_len
        b[2] += r.output_len
    count = max(bins) + 1 if bins else 0
    rates: dict[tuple[int, int], float] = {}
    needs = []
    for k in range(count):
        n, prompt, output = bins.get(k, (0, 0, 0))
        if not n:
            needs.append(0)
            continue
        mix = (round(prompt / n), round(output / n))
        if mix not in rates:
            rates[mix] = planner.worker_rate(*mix, 0.0)
        planned = planner.config.headroom * rates[mix]
        needs.append(math.ceil(n / span / planned) if planned > 0 else planner.config.max_workers)
    return needs


class OraclePlanner(Planner):
    """Knows the future: at each decision, the most workers any window from now to a start-up
    and an interval ahead needs (`needs`, one a `span`-second window), at once either way."""

    def __init__(
        self,
        config: PlannerConfig,
        cost: CostModel,
        max_num_seqs: int,
        needs: Sequence[int],
        span: float,
    ) -> None:
        super().__init__(config, cost, max_num_seqs)
        self.needs, self.span = needs, span

    def need_at(self, now: float) -> int:
        c = self.config
        first = int(now // self.span)
        last = int((now + c.startup + c.interval) // self.span)
        return max(self.needs[first : last + 1], default=0)

    def decide(self, window: Window, fleet: Fleet) -> Plan:
        c = self.config
        needed = self.need_at(window.end)
        self.target = min(max(needed, c.min_workers), c.max_workers)
        return Plan(self.target, "oracle", window.rate, 0.0, needed)


@dataclass(frozen=True)
class Run:
    label: str
    workers: int = 0  # a static fleet's size; 0: autoscaled by `kind`
    kind: str = ""  # "reactive", "planner" or "oracle"


def _settings(day: Day, peak: int, first: int) -> PlannerConfig:
    return PlannerConfig(
        min_workers=1,
        max_workers=2 * peak,
        startup=day.startup / day.speedup,
        interval=day.interval / day.speedup,
        initial=first,
    )


def _sizes(day: Day, trace: Trace, cost: CostModel) -> tuple[list[int], int, int]:
    """Each window's need, the peak fleet and the mean one."""
    probe = Planner(PlannerConfig(), cost)
    needs = window_needs(trace, probe, day.window)
    span = trace.requests[-1].arrival or 1.0
    prompt = sum(r.prompt_len for r in trace.requests) / len(trace)
    output = sum(r.output_len for r in trace.requests) / len(trace)
    planned = probe.config.headroom * probe.worker_rate(prompt, output, 0.0)
    mean = math.ceil(len(trace) / span / planned)
    return needs, max(needs), max(mean, 1)


def _run_one(day: Day, run: Run) -> tuple[Run, dict[str, object]]:
    trace = day.load()
    cost = roofline(MODEL, GPU)
    needs, peak, _ = _sizes(day, trace, cost)
    if run.workers:
        config = SimConfig(num_workers=run.workers, policy=POLICY, classes=TARGETS, seed=day.seed)
        cluster = SimCluster(trace, cost, config)
    else:
        first = max(needs[0], 1)
        settings = _settings(day, peak, first)
        config = SimConfig(policy=POLICY, classes=TARGETS, autoscale=settings, seed=day.seed)
        cluster = SimCluster(trace, cost, config)
        assert cluster.scaler is not None
        seqs = config.engine.max_num_seqs
        if run.kind == "reactive":
            cluster.scaler.planner = ReactivePlanner(settings, cost, seqs)
        elif run.kind == "oracle":
            cluster.scaler.planner = OraclePlanner(settings, cost, seqs, needs, day.window)
    result = cluster.run()
    cluster.release()
    summary = result.summary
    summary["missed_arrivals"] = _missed(result.records)
    summary["requests"] = len(trace)
    return run, summary


def _missed(records: Sequence[object]) -> list[float]:
    """When the requests missing a target arrived (run seconds)."""
    ttft, tpot = TARGETS[0].ttft, TARGETS[0].tpot
    return [
        r.arrival  # type: ignore[attr-defined]
        for r in records
        if r.ttft > ttft or (r.tpot is not None and r.tpot > tpot)  # type: ignore[attr-defined]
    ]


def _serving_at(summary: dict[str, object], t: float) -> int:
    """Workers serving at run time `t`, as of the decision before it."""
    series = summary["workers_over_time"]
    times = [point[0] for point in series]  # type: ignore[union-attr]
    return series[max(bisect.bisect_right(times, t) - 1, 0)][1]  # type: ignore[index]


def _serving_by_hour(day: Day, summary: dict[str, object]) -> dict[int, float]:
    """Mean workers serving per hour of the day, from the run's decisions."""
    by: dict[int, list[int]] = defaultdict(list)
    for t, serving, _ in summary["workers_over_time"]:  # type: ignore[union-attr]
        by[int((day.start + t * day.speedup) // HOUR)].append(serving)
    return {h: sum(v) / len(v) for h, v in by.items()}


def row(day: Day, run: Run, summary: dict[str, object]) -> dict[str, object]:
    classes = summary["classes"]["default"]  # type: ignore[index]
    series = summary.get("workers_over_time")
    if series:
        serving = [s for _, s, _ in series]  # type: ignore[union-attr]
        fleet = f"{min(serving)} to {max(serving)}"
    else:
        fleet = str(run.workers)
    return {
        "fleet": run.label,
        "workers": fleet,
        "GPU-hours": summary["gpu_seconds"] * day.speedup / HOUR,  # type: ignore[operator]
        "attainment": classes["attainment"],
        "TTFT p99 s": summary["ttft"]["p99"],  # type: ignore[index]
        "TPOT p99 ms": 1e3 * summary["tpot"]["p99"],  # type: ignore[index,operator]
        "completed": summary["completed"],
    }


def verdict(day: Day, rows: list[dict[str, object]], summaries: dict[str, dict]) -> str:
    """Whether the planner reaches `GOAL` within `WITHIN` of the oracle's GPU-hours; where it
    spends more than the oracle (the hours with the most workers over the oracle's), and where
    it misses most (the hour, and its fleet there beside the oracle's)."""
    by = {r["fleet"]: r for r in rows}
    planner, oracle = by["planner"], by["oracle"]
    ratio = planner["GPU-hours"] / oracle["GPU-hours"]  # type: ignore[operator]
    meets = planner["attainment"] >= GOAL  # type: ignore[operator]
    reaches = meets and ratio <= WITHIN
    text = (
        f"the planner {'reaches' if reaches else 'does not reach'} the goal: attainment "
        f"{planner['attainment']:.3f} ({'at least' if meets else 'under'} {GOAL:g}) on "
        f"{ratio:.2f}x the oracle's GPU-hours ({'within' if ratio <= WITHIN else 'over'} "
        f"{WITHIN:g}x)"
    )
    mine = _serving_by_hour(day, summaries["planner"])
    best = _serving_by_hour(day, summaries["oracle"])
    excess = sorted(mine, key=lambda h: best.get(h, 0.0) - mine[h])[:3]
    text += "; most workers over the oracle's at " + ", ".join(
        f"{h % 24:02d}:00 ({mine[h]:.1f} against {best.get(h, 0.0):.1f})"
        for h in sorted(excess)
        if mine[h] > best.get(h, 0.0)
    )
    missed = summaries["planner"]["missed_arrivals"]
    if missed:
        hours: dict[int, int] = defaultdict(int)
        for t in missed:
            hours[int((day.start + t * day.speedup) // HOUR)] += 1
        hour = max(hours, key=hours.get)  # type: ignore[arg-type]
        lag = sum(
            1
            for t in missed
            if _serving_at(summaries["planner"], t) < _serving_at(summaries["oracle"], t)
        )
        text += (
            f"; {len(missed)} requests missed, most at {hour % 24:02d}:00 ({hours[hour]}); "
            f"{lag} of them while it served fewer workers than the oracle (lag behind a rise), "
            f"the rest on as many or more (bursts within a window)"
        )
    return text


Section = tuple[str, list[dict[str, object]]]


def run(
    seed: int = 0, out: Path | None = None, jobs: int | None = None, quick: bool = False
) -> list[Section]:
    """The experiment's table (title, rows) and its verdict (one row);
    `quick`: 08:00-12:00 played in a minute."""
    day = replace(QUICK if quick else FULL, seed=seed)
    if not SERVEGEN.exists():
        raise ValueError(f"experiment autoscale needs {SERVEGEN}")
    trace = day.load()
    _, peak, mean = _sizes(day, trace, roofline(MODEL, GPU))
    runs = [
        Run("static peak", workers=peak),
        Run("static mean", workers=mean),
        Run("reactive", kind="reactive"),
        Run("planner", kind="planner"),
        Run("oracle", kind="oracle"),
    ]
    jobs = jobs or min(len(runs), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = map_runs(pool, _run_one, [day] * len(runs), runs, counts=summary_counts)
    rows = [row(day, r, s) for r, s in results]
    summaries = {r.label: s for r, s in results}
    hours = day.duration / HOUR
    title = (
        f"ServeGen m-small, clients {', '.join(c.removeprefix('chunk-') for c in CLIENTS)}: "
        f"{len(trace):,} requests over {hours:g} h from {day.start / HOUR:02g}:00 played "
        f"{day.speedup:g}x faster; {MODEL} on {GPU}, {POLICY}, TTFT {TARGETS[0].ttft:g} s, "
        f"TPOT {TARGETS[0].tpot:g} s; start-up {day.startup:g} s, interval {day.interval:g} s "
        f"(day time); GPU-hours for the day"
    )
    line = verdict(day, rows, summaries)
    sections: list[Section] = [(title, rows), ("Verdict", [{"verdict": line}])]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for r, summary in results:
            slug = re.sub(r"[^A-Za-z0-9.]+", "_", r.label)
            (out / f"autoscale-{slug}.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "autoscale.md").write_text(f"{title}\n\n{format_table(rows)}\n\n{line}\n")
    return sections
