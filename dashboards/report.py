"""Policy-comparison reports: one self-contained HTML file (plots embedded) and a Markdown summary.

A run directory holds `requests.csv` (one row per request, the simulator's and the proxy's
recorder write the same columns) and, from the simulator, `summary.json`. Everything a report
shows is computed from those two files, so simulated and live runs compare side by side.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dashboards.tables import class_rows, format_table, goodput, pool_rows  # noqa: E402
from router.records import RequestRecord  # noqa: E402
from simulator.fairness import service_curves  # noqa: E402
from simulator.results import summarize  # noqa: E402


@dataclass
class Run:
    name: str
    path: Path
    records: list[RequestRecord]
    summary: dict


def load_run(path: str | Path) -> Run:
    path = Path(path)
    csv_path = path / "requests.csv"
    if not csv_path.exists():
        raise ValueError(f"{path}: no requests.csv (not a simulate, compare or live run)")
    records = read_records(csv_path)
    summary_path = path / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
    else:  # a live recording: the same summary, computed here
        span = max((r.finish for r in records), default=0.0)
        summary = summarize(
            records,
            [],
            total=len(records),
            cache_bound=float("nan"),
            simulated_seconds=span,
            wall_seconds=span,
            config={"live": True},
        )
    name = str(summary.get("config", {}).get("policy") or path.name)
    if summary.get("config", {}).get("live"):
        name = f"{path.name} (live)"
    return Run(name, path, records, summary)


def read_records(path: Path) -> list[RequestRecord]:
    types = {f.name: f.type for f in fields(RequestRecord)}
    defaulted = {f.name for f in fields(RequestRecord) if f.default is not MISSING}
    out = []
    with open(path, newline="") as f:
        for lineno, row in enumerate(csv.DictReader(f), 2):
            try:
                values = {}
                for name, kind in types.items():
                    raw = row.get(name, "")
                    if name in defaulted and not raw:
                        continue  # its default: an older file, or nothing known
                    if name in ("session", "api"):
                        values[name] = raw or None
                    elif name == "client":
                        values[name] = raw
                    elif "int" in str(kind):
                        values[name] = int(float(raw))
                    else:
                        values[name] = float(raw)
                out.append(RequestRecord(**values))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: cannot read row ({e})") from None
    return out


# ------------------------------------------------------------------------ figures


def _png(fig: plt.Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)  # constrained layout: already fitted
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def latency_cdfs(runs: list[Run]) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    for ax, metric, label in ((axes[0], "ttft", "TTFT (s)"), (axes[1], "e2e", "end-to-end (s)")):
        for run in runs:
            values = np.sort([getattr(r, metric) for r in run.records])
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=run.name)
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.set_title(f"{label.split(' (')[0]} CDF")
    axes[1].legend(fontsize=8, loc="lower right")
    return _png(fig)


def _grid(runs: list[Run], title: str):
    cols = min(3, len(runs))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False, layout="constrained"
    )
    fig.suptitle(title)
    for ax in axes.flat[len(runs) :]:
        ax.axis("off")
    return fig, list(axes.flat)


def client_service(runs: list[Run]) -> str:
    """Cumulative weighted service per client over time: the VTC paper's fairness picture."""
    fig, axes = _grid(runs, "Service received per client (input + 2 x output tokens)")
    for ax, run in zip(axes, runs, strict=False):
        span = max((r.finish for r in run.records), default=1.0)
        curves = service_curves(run.records, step=max(span / 300, 1e-3))
        for i, client in enumerate(curves.clients[:12]):
            ax.plot(curves.times, curves.service[i] / 1e3, label=client)
        ax.set_title(run.name)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("k tokens")
        ax.grid(alpha=0.3)
        if len(curves.clients) <= 12:
            ax.legend(fontsize=7)
    return _png(fig)


def client_ttft(runs: list[Run]) -> str:
    fig, axes = _grid(runs, "TTFT per client over time (by arrival)")
    for ax, run in zip(axes, runs, strict=False):
        clients = sorted({r.client for r in run.records})[:12]
        for client in clients:
            rs = sorted((r for r in run.records if r.client == client), key=lambda r: r.arrival)
            ax.plot([r.arrival for r in rs], [r.ttft for r in rs], ".", ms=2, label=client)
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_title(run.name)
        ax.set_xlabel("arrival (s)")
        ax.set_ylabel("TTFT (s)")
        ax.grid(alpha=0.3)
        if len(clients) <= 12:
            ax.legend(fontsize=7, markerscale=4)
    return _png(fig)


def worker_load(runs: list[Run]) -> str:
    """Requests in the system per worker, and each worker's prefix-cache hit rate, over time."""
    fig, axes = plt.subplots(
        2, len(runs), figsize=(4.6 * len(runs), 6.4), squeeze=False, layout="constrained"
    )
    fig.suptitle("Per-worker load (requests in system) and prefix-cache hit rate over time")
    for j, run in enumerate(runs):
        span = max((r.finish for r in run.records), default=1.0)
        times = np.linspace(0, span, 200)
        width = span / 20
        for w in sorted({r.worker for r in run.records}):
            rs = [r for r in run.records if r.worker == w]
            arrivals = np.sort([r.arrival for r in rs])
            finishes = np.sort([r.finish for r in rs])
            load = np.searchsorted(arrivals, times, "right") - np.searchsorted(
                finishes, times, "right"
            )
            axes[0][j].plot(times, load, label=f"worker {w}")
            bins = np.arange(0, span + width, width)
            at = np.array([r.arrival for r in rs])
            prompt = np.histogram(at, bins, weights=[r.prompt_tokens for r in rs])[0]
            cached = np.histogram(at, bins, weights=[r.cached_tokens for r in rs])[0]
            with np.errstate(invalid="ignore", divide="ignore"):
                axes[1][j].plot(bins[:-1] + width / 2, 100 * cached / prompt, marker=".")
        axes[0][j].set_title(run.name)
        axes[0][j].set_ylabel("requests in system")
        axes[1][j].set_ylabel("hit rate %")
        axes[1][j].set_xlabel("time (s)")
        for ax in (axes[0][j], axes[1][j]):
            ax.grid(alpha=0.3)
        if len({r.worker for r in run.records}) <= 8:
            axes[0][j].legend(fontsize=7)
    return _png(fig)


# ------------------------------------------------------------------------- tables

METRICS = [
    # (label, getter, lower is better)
    ("throughput req/s", lambda s: s["throughput"]["requests_per_s"], False),
    ("output tok/s", lambda s: s["throughput"]["output_tokens_per_s"], False),
    ("TTFT mean s", lambda s: s["ttft"]["mean"], True),
    ("TTFT p99 s", lambda s: s["ttft"]["p99"], True),
    ("e2e mean s", lambda s: s["e2e"]["mean"], True),
    ("e2e p99 s", lambda s: s["e2e"]["p99"], True),
    ("hit rate %", lambda s: 100 * s["prefix_cache"]["hit_rate"], False),
    ("bound %", lambda s: 100 * s["prefix_cache"]["bound"], None),
    ("Jain", lambda s: s["fairness"]["jain"], False),
    ("max service gap (k tok)", lambda s: s["fairness"]["max_service_gap"] / 1e3, True),
    ("preemptions", lambda s: s["preemptions"], True),
]
# Shown after the throughput when a run has traffic classes (each class's targets).
CLASS_METRICS = [
    ("SLO met %", lambda s: 100 * goodput(s)[0], False),
    ("goodput req/s", lambda s: goodput(s)[1], False),
]
ALL_METRICS = [*METRICS[:2], *CLASS_METRICS, *METRICS[2:]]


def metrics(runs: list[Run]) -> list:
    """The summary's columns: SLO attainment and goodput too when any run has classes."""
    return ALL_METRICS if any(run.summary.get("classes") for run in runs) else METRICS


def summary_rows(runs: list[Run]) -> list[dict[str, object]]:
    rows = []
    for run in runs:
        row: dict[str, object] = {"policy": run.name}
        for label, get, _ in metrics(runs):
            try:
                value = get(run.summary)
            except (KeyError, TypeError):
                value = None
            row[label] = None if value is None or value != value else value  # NaN -> None
        rows.append(row)
    return rows


def verdict(rows: list[dict[str, object]]) -> list[str]:
    lines = []
    for label, _, lower in ALL_METRICS:
        if lower is None or label not in rows[0]:
            continue
        scored = [(r[label], r["policy"]) for r in rows if isinstance(r[label], (int, float))]
        if len(scored) < 2:
            continue
        best = (min if lower else max)(scored, key=lambda x: x[0])
        worst = (max if lower else min)(scored, key=lambda x: x[0])
        if best[0] == worst[0]:
            continue
        lines.append(
            f"Best {label}: {best[1]} ({_fmt(best[0])}, against {_fmt(worst[0])} for {worst[1]})."
        )
    return lines


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"  # not known for this run (a live recording has no trace bound)
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


# ------------------------------------------------------------------------- output

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; max-width: 1200px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-variant-numeric: tabular-nums; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; }
figcaption { color: #555; font-size: 13px; }
.verdict li { margin: 2px 0; }
"""


def write_report(runs: list[Run], out: Path, title: str = "Fairway policy comparison") -> Path:
    if not runs:
        raise ValueError("no runs to report")
    rows = summary_rows(runs)
    figures = [
        ("latency", "Latency CDFs (log time axis past 0.1 s)", latency_cdfs(runs)),
        (
            "service",
            "Per-client service over time: parallel lines are fair shares",
            client_service(runs),
        ),
        ("ttft", "Per-client TTFT over time", client_ttft(runs)),
        ("workers", "Per-worker load and cache-hit rate over time", worker_load(runs)),
    ]
    classes = [row for run in runs for row in class_rows(run.name, run.summary)]
    pools = [row for run in runs for row in pool_rows(run.name, run.summary)]
    sources = "".join(
        f"<li>{html.escape(r.name)}: {html.escape(str(r.path))} ({len(r.records)} requests)</li>"
        for r in runs
    )
    figs = "".join(
        f'<figure id="fig-{key}"><img alt="{html.escape(caption)}" '
        f'src="data:image/png;base64,{data}"><figcaption>{html.escape(caption)}</figcaption>'
        f"</figure>"
        for key, caption, data in figures
    )
    verdict_html = "".join(f"<li>{html.escape(line)}</li>" for line in verdict(rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<h2>Verdict</h2><ul class='verdict'>{verdict_html}</ul>"
        f"<h2>Summary</h2>{_html_table(rows, 'summary')}"
        f"<p>Service: input + 2 x output tokens per client weight. Max service gap: the "
        f"largest difference in service two clients received while both had requests waiting. "
        f"Jain: Jain's index over the service of the clients waiting at the same time (1: equal "
        f"shares), averaged over time. "
        f"Bound: the hit rate of one unbounded cache shared by all workers.</p>"
        f"{_section_html('Traffic classes', classes, 'classes', CLASSES_NOTE)}"
        f"{_section_html('Prefill and decode pools', pools, 'pools', POOLS_NOTE)}{figs}"
        f"<h2>Runs</h2><ul>{sources}</ul></body></html>"
    )
    md = out.with_suffix(".md")
    classes_md = f"\n## Traffic classes\n\n```\n{format_table(classes)}\n```\n" if classes else ""
    md.write_text(
        f"# {title}\n\n```\n{format_table(rows)}\n```\n\n"
        + "\n".join(f"- {line}" for line in verdict(rows))
        + "\n"
        + classes_md
        + (f"\n## Prefill and decode pools\n\n```\n{format_table(pools)}\n```\n" if pools else "")
    )
    return out


def _html_table(rows: list[dict[str, object]], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(_fmt(row.get(k)) if row.get(k) is not None else '-')}</td>"
                  for k in rows[0])
        + "</tr>"
        for row in rows
    )  # fmt: skip
    return f"<table id='{table_id}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


POOLS_NOTE = (
    "Requests: routed to a prefill (or mixed) worker, handed to a decode worker. Tokens "
    "computed: prompt and output tokens the pool's engines ran. Load imbalance: the busiest "
    "worker's tokens over the pool's mean. KV in: the time a prompt's KV took from its "
    "prefill GPU to its decode GPU."
)
CLASSES_NOTE = (
    "Met: the share of a class's requests, refused ones included, that met its TTFT and "
    "TPOT targets (a class without targets meets them by finishing). Goodput: such requests "
    "per second of the run, from its first arrival to its last finish. Refused: by admission "
    "control (queue time: waited past the class's limit; unmeetable: no worker was predicted "
    "to meet its TTFT target) and by tenant budgets (rate limit)."
)


def _section_html(heading: str, rows: list[dict[str, object]], table_id: str, note: str) -> str:
    """A heading, the table and what its columns mean; nothing when no run has such rows
    (a split fleet's pools, traffic classes)."""
    if not rows:
        return ""
    return f"<h2>{heading}</h2>{_html_table(rows, table_id)}<p>{note}</p>"
