"""Per-class columns in the terminal tables and the report, and the dashboard's classes row,
from summaries built by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboards import grafana
from dashboards.report import Run, summary_rows, verdict
from dashboards.tables import class_rows, goodput
from router.classes import QUEUE_TIME, RATE_LIMIT, UNMEETABLE, ClassTable, TrafficClass
from router.records import Refusal, RequestRecord
from simulator.results import class_summary, fleet_goodput

CLASSES = ClassTable(
    [TrafficClass("interactive", 0, ttft=1.0, tpot=0.1), TrafficClass("batch", 1, ttft=60.0)]
)


def record(i: int, priority: int, ttft: float, tpot: float = 0.05) -> RequestRecord:
    """Request `i` arriving at 0: its first token at `ttft`, then 11 tokens `tpot` apart."""
    return RequestRecord(i, "c", None, 0, 0.0, 0.0, ttft, ttft + 10 * tpot, 100, 0, 11, 0,
                         priority=priority)  # fmt: skip


def summary(span: float = 10.0, **extra: object) -> dict:
    """Interactive: 3 answered (one too late to first token, one too slow per token), 1
    refused; batch: 2 answered in time, 2 refused."""
    records = [
        record(0, 0, 0.5),
        record(1, 0, 2.0),
        record(2, 0, 0.5, tpot=0.2),
        record(3, 1, 30.0),
        record(4, 1, 50.0),
    ]
    refusals = [
        Refusal(5, "c", 0, QUEUE_TIME, 1.0),
        Refusal(6, "c", 1, UNMEETABLE, 1.0),
        Refusal(7, "c", 1, RATE_LIMIT, 1.0),
    ]
    by_class = class_summary(records, refusals, CLASSES)
    return {
        "classes": by_class,
        "goodput": fleet_goodput(by_class, span),
        "refusals": {QUEUE_TIME: 1, UNMEETABLE: 1, RATE_LIMIT: 1},
        **extra,
    }


class TestClassRows:
    def test_one_row_per_class_highest_band_first(self) -> None:
        rows = class_rows("lpm", summary())
        assert [(r["policy"], r["class"]) for r in rows] == [
            ("lpm", "interactive"),
            ("lpm", "batch"),
        ]
        interactive, batch = rows
        assert interactive["targets"] == "TTFT 1 s, TPOT 0.1 s"
        assert batch["targets"] == "TTFT 60 s"

    def test_refused_requests_count_as_missed(self) -> None:
        interactive, batch = class_rows("lpm", summary())
        assert interactive["requests"] == 4
        assert interactive["met %"] == pytest.approx(25.0)
        assert batch["met %"] == pytest.approx(50.0)

    def test_goodput_is_met_requests_per_second_of_the_class_span(self) -> None:
        """Each class over its own first arrival to last answer: interactive answered by
        2.5 s, batch by 50.5 s."""
        interactive, batch = class_rows("lpm", summary())
        assert interactive["goodput/s"] == pytest.approx(1 / 2.5)
        assert batch["goodput/s"] == pytest.approx(2 / 50.5)

    def test_refusals_by_reason(self) -> None:
        interactive, batch = class_rows("lpm", summary())
        assert (interactive["refused queue time"], interactive["refused unmeetable"]) == (1, 0)
        assert (batch["refused unmeetable"], batch["refused rate limit"]) == (1, 1)

    def test_none_without_classes(self) -> None:
        assert class_rows("lpm", {"ttft": {}}) == []
        assert goodput({"ttft": {}}) == (None, None)

    def test_the_run_total(self) -> None:
        attainment, total = goodput(summary(span=10.0))
        assert attainment == pytest.approx(3 / 8)
        assert total == pytest.approx(0.3)


def run(name: str, s: dict) -> Run:
    return Run(name, Path(name), [], s)


class TestReportColumns:
    def test_goodput_columns_only_when_a_run_has_classes(self) -> None:
        plain = summary_rows([run("a", {}), run("b", {})])
        assert "goodput req/s" not in plain[0]
        rows = summary_rows([run("a", {}), run("b", summary())])
        assert [r["goodput req/s"] for r in rows] == [None, pytest.approx(0.3)]
        assert [r["SLO met %"] for r in rows] == [None, pytest.approx(100 * 3 / 8)]

    def test_the_verdict_names_the_best_goodput(self) -> None:
        rows = summary_rows([run("slow", summary(span=20.0)), run("fast", summary(span=10.0))])
        assert any(line.startswith("Best goodput req/s: fast") for line in verdict(rows))


class TestDashboardRow:
    def test_the_classes_row_follows_the_panels(self) -> None:
        panels = grafana.dashboard()["panels"]
        header = len(grafana.PANELS)
        assert panels[header]["type"] == "row"
        assert panels[header]["title"] == "Traffic classes and budgets"
        below = panels[header + 1 : header + 1 + len(grafana.CLASS_PANELS)]
        assert [p["title"] for p in below] == [p.title for p in grafana.CLASS_PANELS]
        after = panels[header + 1 + len(grafana.CLASS_PANELS) :]
        assert [p["title"] for p in after] == [
            "Autoscaling",
            *(p.title for p in grafana.AUTOSCALE_PANELS),
        ], "the classes row ends at the next row's header"
        assert after[0]["type"] == "row"
        assert all(p["gridPos"]["y"] > panels[header]["gridPos"]["y"] for p in below)
        assert len({p["id"] for p in panels}) == len(panels)
        cells = [
            (p["gridPos"]["x"] // 12, p["gridPos"]["y"] + dy)
            for p in panels
            if p["type"] != "row"
            for dy in range(p["gridPos"]["h"])
        ]
        assert len(cells) == len(set(cells)), "panels overlap"

    def test_every_class_metric_is_shown(self) -> None:
        exprs = " ".join(e for p in grafana.CLASS_PANELS for e, _ in p.exprs)
        for metric in (
            "fairway_refusals_total",
            "fairway_class_requests_total",
            "fairway_ttft_predicted_seconds_total",
            "fairway_ttft_observed_seconds_total",
            "fairway_rate_limited_total",
        ):
            assert metric in exprs, metric

    def test_the_attainment_alert_watches_interactive(self) -> None:
        rules = grafana.alert_rules(attainment_target=0.95)["groups"][0]["rules"]
        rule = next(r for r in rules if r["alert"] == "FairwayInteractiveAttainmentLow")
        assert rule["expr"] == (
            'sum by (class) (rate(fairway_class_requests_total{outcome="met", '
            'class="interactive"}[5m])) / sum by (class) '
            '(rate(fairway_class_requests_total{class="interactive"}[5m])) < 0.95'
        )
