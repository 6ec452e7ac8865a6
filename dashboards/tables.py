"""Plain-text tables for the terminal (the summaries' shared look)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"  # not known for this run
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, object]]) -> str:
    if not rows:
        return "(no rows)"
    columns = list(rows[0])
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    first_left = [True] + [False] * (len(columns) - 1)

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.ljust(w) if left else v.rjust(w)
            for v, w, left in zip(values, widths, first_left, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(columns), rule, *(line(r) for r in cells)])


def summary_row(label: str, summary: Mapping[str, object]) -> dict[str, object]:
    """The columns a policy comparison shows, from a summary.json dict."""
    ttft, e2e, tpot = summary["ttft"], summary["e2e"], summary["tpot"]
    cache, thr = summary["prefix_cache"], summary["throughput"]
    return {
        "policy": label,
        "done": f"{summary['completed']}/{summary['total']}",
        "TTFT mean s": ttft["mean"],  # type: ignore[index]
        "TTFT p99 s": ttft["p99"],  # type: ignore[index]
        "TPOT ms": (tpot["mean"] or 0) * 1000,  # type: ignore[index]
        "e2e mean s": e2e["mean"],  # type: ignore[index]
        "e2e p99 s": e2e["p99"],  # type: ignore[index]
        "out tok/s": thr["output_tokens_per_s"],  # type: ignore[index]
        "hit %": 100 * cache["hit_rate"],  # type: ignore[index]
        "bound %": 100 * cache["bound"],  # type: ignore[index]
        "preempt": summary["preemptions"],
        "imbalance": summary["load_imbalance"],
        "jain": summary["fairness"]["jain"],  # type: ignore[index]
    }


def _targets(figures: Mapping[str, object]) -> str:
    named = (("TTFT", figures.get("ttft_target")), ("TPOT", figures.get("tpot_target")))
    return ", ".join(f"{what} {value:g} s" for what, value in named if value is not None) or "-"


def class_rows(label: str, summary: Mapping[str, object]) -> list[dict[str, object]]:
    """Per traffic class of a run (none when it has no classes), highest band first: its
    targets, the share of its requests that met them (refused ones count as missed), goodput
    (requests that met them per second of the run) and refusals by reason."""
    rows = []
    for name, c in (summary.get("classes") or {}).items():  # type: ignore[attr-defined]
        attainment, tpot = c["attainment"], c["tpot"]["p99"]
        rows.append(
            {
                "policy": label,
                "class": name,
                "targets": _targets(c),
                "requests": c["requests"],
                "met %": None if attainment is None else 100 * attainment,
                "goodput/s": c["goodput"],
                "TTFT p99 s": c["ttft"]["p99"],
                "TPOT p99 ms": None if tpot is None else 1000 * tpot,
                **{f"refused {reason.replace('_', ' ')}": n for reason, n in c["refused"].items()},
            }
        )
    return rows


def pool_rows(label: str, summary: Mapping[str, object]) -> list[dict[str, object]]:
    """A split fleet's pools (none for a mixed fleet): each role's workers, the requests it
    took, the tokens it computed, its own load imbalance, and on the decode pool the KV
    transfers that reached it."""
    moved: Mapping = summary.get("kv_transfer") or {}  # type: ignore[assignment]
    rows = []
    for role, pool in (summary.get("roles") or {}).items():  # type: ignore[attr-defined]
        decode = role == "decode"
        rows.append(
            {
                "policy": label,
                "pool": role,
                "workers": pool["workers"],
                "requests": pool["requests"],
                "tokens computed": pool["tokens_processed"],
                "load imbalance": pool["load_imbalance"],
                "preemptions": pool["preemptions"],
                "KV in mean ms": _ms(moved.get("mean")) if decode else None,
                "KV in p99 ms": _ms(moved.get("p99")) if decode else None,
            }
        )
    return rows


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def goodput(summary: Mapping[str, object]) -> tuple[float | None, float | None]:
    """A run's SLO attainment over all its classes and its total goodput (requests per second
    that met their class's targets); (None, None) without classes."""
    total = summary.get("goodput")
    if not total:
        return None, None
    return total["attainment"], total["requests_per_s"]  # type: ignore[index]
