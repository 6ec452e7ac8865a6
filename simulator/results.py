"""The run summary (and its per-worker records) every report, test and table reads."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path

import numpy as np

from router.classes import REFUSAL_REASONS, ClassTable
from router.records import RecordWriter, Refusal, RequestRecord, weighted_tokens
from simulator.columns import RecordColumns, columns
from simulator.fairness import (
    jain_while_backlogged,
    max_service_gap,
    service_by_window,
    service_curves,
    vtc_bound,
)


@dataclass(slots=True)
class WorkerRecord:
    id: int
    requests: int
    tokens_processed: int
    kv_blocks: int
    peak_kv_blocks: int
    preemptions: int
    evictions: int
    steps: int
    events: int
    adapter_loads: int = 0
    group: str | None = None  # its model group, when the fleet was given as groups
    role: str = "mixed"  # router.traits.Role


@dataclass
class SimResult:
    """A simulated run: its records (kept as columns; `records` makes them on first read), each
    worker's record and the summary."""

    columns: RecordColumns
    workers: list[WorkerRecord]
    summary: dict[str, object]

    @cached_property
    def records(self) -> list[RequestRecord]:
        """By id."""
        return self.columns.records()


def _worker_dict(worker: WorkerRecord) -> dict[str, object]:
    """`dataclasses.asdict` of a worker's record, whose fields are all plain values: asdict
    copies each one deeply, a thousandth of a second per worker."""
    return {name: getattr(worker, name) for name in _WORKER_FIELDS}


_WORKER_FIELDS = tuple(f.name for f in fields(WorkerRecord))


def _stats(values: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    if len(values) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "mean": float(a.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
    }


def summarize(
    records: Sequence[RequestRecord] | RecordColumns,
    workers: Sequence[WorkerRecord],
    *,
    total: int,
    cache_bound: float,
    simulated_seconds: float,
    wall_seconds: float,
    config: dict[str, object],
    classes: ClassTable | None = None,
    refusals: Sequence[Refusal] = (),
) -> dict[str, object]:
    cols = columns(records)
    prompt, cached = int(cols.prompt_tokens.sum()), int(cols.cached_tokens.sum())
    output = int(cols.output_tokens.sum())
    span = float(cols.finish.max() - cols.arrival.min()) if len(cols) else 0.0
    ttft, e2e = cols.first_token - cols.arrival, cols.finish - cols.arrival
    # The grid resolves the gap to a tenth of the run, or a second, whichever is finer.
    curves = service_curves(cols, step=min(1.0, max(span, 1e-3) / 10))
    backlogged_s = dict(
        zip(
            curves.clients,
            curves.backlogged.sum(axis=1)
            * (curves.times[1] - curves.times[0] if len(curves.times) > 1 else 0.0),
            strict=True,
        )
    )
    # Per-client service and backlog over 20 windows of the run, on a grid 10x finer.
    window = max(span, 1e-3) / 20
    fine = service_curves(cols, step=window / 10)
    windows = service_by_window(fine, window)
    backlog = {
        c: [float(fine.backlogged[i, k : k + 10].mean()) for k in range(0, len(fine.times) - 1, 10)]
        for i, c in enumerate(fine.clients)
    }
    # Divided by the weight, as VTC's counters and the service curves count it: equal figures
    # mean each client got its weighted share. (weighted_tokens' arithmetic, on arrays.)
    tokens = weighted_tokens(cols.prompt_tokens, cols.output_tokens)  # type: ignore[arg-type]
    weighted = tokens / cols.weight
    per_client = {
        client: {
            "requests": len(at),
            "weight": float(cols.weight[at[0]]),
            # Summed one by one, in order, as a running total would be.
            "service": sum(weighted[at].tolist()),
            "prompt_tokens": int(cols.prompt_tokens[at].sum()),
            "output_tokens": int(cols.output_tokens[at].sum()),
            "backlogged_seconds": float(backlogged_s[client]),
            "window_seconds": window,
            "service_by_window": windows[client],
            "backlogged_by_window": backlog[client][: len(windows[client])],
            "ttft": _stats(ttft[at]),
            "e2e": _stats(e2e[at]),
        }
        for client, at in sorted(cols.by_client.items())
    }
    group_of = {w.id: w.group for w in workers if w.group is not None}
    by_group: dict[str, list[int]] = {g: [] for g in dict.fromkeys(group_of.values())}
    if group_of:
        for i, worker in enumerate(cols.worker.tolist()):
            if worker in group_of:
                by_group[group_of[worker]].append(i)
    work = [w.tokens_processed for w in workers]
    mean_work = float(np.mean(work)) if work else 0.0
    out = {
        "config": config,
        "completed": len(cols),
        "total": total,
        "ttft": _stats(ttft),
        "tpot": _stats(cols.tpot()),
        "e2e": _stats(e2e),
        "queue_time": _stats(cols.admitted - cols.arrival),
        "throughput": {
            "requests_per_s": len(cols) / span if span > 0 else None,
            "output_tokens_per_s": output / span if span > 0 else None,
        },
        "tokens": {"prompt": prompt, "cached": cached, "output": output},
        "prefix_cache": {
            "hit_rate": cached / prompt if prompt else 0.0,
            "bound": cache_bound,
        },
        "preemptions": int(cols.preemptions.sum()),
        "adapter_loads": sum(w.adapter_loads for w in workers),
        "model_groups": {
            group: {
                "workers": sum(1 for g in group_of.values() if g == group),
                "requests": len(at),
                "ttft": _stats(ttft[at]),
            }
            for group, at in by_group.items()
        },
        "load_imbalance": (max(work) / mean_work) if mean_work else None,
        "workers": [_worker_dict(w) for w in workers],
        "per_client": per_client,
        "fairness": {
            "jain": jain_while_backlogged(fine),
            "max_service_gap": max_service_gap(curves),
            "vtc_bound": vtc_bound(cols),
        },
        "simulated_seconds": simulated_seconds,
        "wall_seconds": wall_seconds,
    }
    if any(w.role != "mixed" for w in workers):
        out["roles"] = role_summary(workers)
        moved = cols.kv_transfer[~np.isnan(cols.kv_transfer)]
        out["kv_transfer"] = {"requests": len(moved), **_stats(moved)}
    if classes or refusals or cols.priority.any():
        reasons = (*REFUSAL_REASONS, *sorted({x.reason for x in refusals} - {*REFUSAL_REASONS}))
        out["refusals"] = {reason: sum(1 for x in refusals if x.reason == reason)
                           for reason in reasons}  # fmt: skip
        out["classes"] = by_class = class_summary(cols, refusals, classes or ClassTable())
        out["goodput"] = fleet_goodput(by_class, span)
        out["ttft_prediction"] = ttft_prediction(cols)
    return out


def role_summary(workers: Sequence[WorkerRecord]) -> dict[str, dict[str, object]]:
    """Each role's workers in sum (a split fleet's pools apart): requests each took (routed
    to a prefill or mixed worker, handed to a decode one), tokens computed, and its own load
    imbalance, since work differs in kind from one pool to the other."""
    out: dict[str, dict[str, object]] = {}
    for role in ("mixed", "prefill", "decode"):
        pool = [w for w in workers if w.role == role]
        if not pool:
            continue
        work = [w.tokens_processed for w in pool]
        mean = float(np.mean(work))
        out[role] = {
            "workers": len(pool),
            "requests": sum(w.requests for w in pool),
            "tokens_processed": sum(work),
            "peak_kv_blocks": max(w.peak_kv_blocks for w in pool),
            "preemptions": sum(w.preemptions for w in pool),
            "load_imbalance": max(work) / mean if mean else None,
        }
    return out


def class_summary(
    records: Sequence[RequestRecord] | RecordColumns,
    refusals: Sequence[Refusal],
    classes: ClassTable,
) -> dict[str, dict[str, object]]:
    """Per traffic class, highest band first: what arrived, what was refused and why, SLO
    attainment (the share of the class's requests, refused ones included, that met both its
    targets) and goodput (such requests per second of the class's span)."""
    cols = columns(records)
    priorities = sorted(set(cols.priority.tolist()) | {x.priority for x in refusals}
                        | set(classes.priorities()))  # fmt: skip
    ttft, tpot = cols.first_token - cols.arrival, cols.tpot_or_nan()
    out: dict[str, dict[str, object]] = {}
    for priority in priorities:
        traffic = classes.of_priority(priority)
        done = cols.priority == priority
        refused = [x for x in refusals if x.priority == priority]
        met = sum(
            1
            for t, p in zip(ttft[done].tolist(), tpot[done].tolist(), strict=True)
            if traffic.meets(t, None if p != p else p)  # NaN is not equal to itself
        )
        completed = int(done.sum())
        arrived = completed + len(refused)
        # Over the class's own span (its first arrival to its last answer): a class served
        # in time is not charged for the time another's backlog took to drain.
        own_span = float(cols.finish[done].max() - cols.arrival[done].min()) if completed else 0.0
        out[traffic.name] = {
            "priority": priority,
            "ttft_target": traffic.ttft,
            "tpot_target": traffic.tpot,
            "requests": arrived,
            "completed": completed,
            "refused": {
                reason: sum(1 for x in refused if x.reason == reason) for reason in REFUSAL_REASONS
            },  # fmt: skip
            "met_targets": met,
            "attainment": met / arrived if arrived else None,
            "goodput": met / own_span if own_span > 0 else None,
            "ttft": _stats(ttft[done]),
            "tpot": _stats(tpot[done & ~np.isnan(tpot)]),
        }
    return out


def fleet_goodput(by_class: dict[str, dict[str, object]], span: float) -> dict[str, object]:
    """Over every class: the share of requests that met their class's targets, and such
    requests per second of the whole run."""
    requests = sum(int(c["requests"]) for c in by_class.values())  # type: ignore[call-overload]
    met = sum(int(c["met_targets"]) for c in by_class.values())  # type: ignore[call-overload]
    return {
        "attainment": met / requests if requests else None,
        "requests_per_s": met / span if span > 0 else None,
    }


def ttft_prediction(records: Sequence[RequestRecord] | RecordColumns) -> dict[str, object]:
    """How far the router's predicted time to first token was from the actual: the error
    (predicted - actual, seconds) and its size relative to the actual."""
    cols = columns(records)
    predicted = ~np.isnan(cols.predicted_ttft)
    p, a = cols.predicted_ttft[predicted], (cols.first_token - cols.arrival)[predicted]
    return {
        "requests": int(predicted.sum()),
        "error": _stats(p - a),
        "relative_error": _stats(np.abs(p - a)[a > 0] / a[a > 0]),
    }


def write_results(
    out: Path, summary: dict[str, object], records: Sequence[RequestRecord] | RecordColumns
) -> None:
    """DIR/summary.json and DIR/requests.csv (one row per completed request)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    writer = RecordWriter(out / "requests.csv")
    if isinstance(records, RecordColumns):
        writer.write_rows(records.csv_rows())
    else:
        for r in records:
            writer.write(r)
    writer.close()
