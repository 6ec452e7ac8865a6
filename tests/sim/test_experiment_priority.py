"""`fairway experiment priority` in its smallest configuration: the tables' shape, and what
bands and admission control must show at ten times the fleet's capacity."""

from __future__ import annotations

import pytest

from router.cli import build_parser
from simulator.bench import priority


@pytest.fixture(scope="module")
def tables() -> dict[str, list[dict[str, object]]]:
    (_, classes), (_, latency) = priority.run(seed=0, quick=True, jobs=2)
    return {"classes": classes, "latency": latency}


def row(rows: list[dict[str, object]], run: str, load: int) -> dict[str, object]:
    found = [r for r in rows if r["run"] == run and r["batch x"] == load]
    assert len(found) == 1, f"expected one row {run!r} at {load}x, got {found}"
    return found[0]


class TestTables:
    def test_every_mode_at_every_load(self, tables) -> None:
        rows = tables["classes"]
        expected = {
            (f"{policy}, {mode}", load)
            for policy in priority.QUICK_POLICIES
            for mode in priority.MODES
            for load in priority.QUICK_LOADS
        }
        assert {(r["run"], r["batch x"]) for r in rows} == expected
        for r in rows:
            assert list(r) == [
                "run", "batch x",
                "I TTFT p99 s", "I TPOT p99 s", "I met %", "I goodput/s",
                "B TTFT p99 s", "B met %", "B goodput/s",
                "goodput/s", "refused",
            ]  # fmt: skip
            for key in ("I met %", "B met %"):
                assert 0 <= r[key] <= 100, (r["run"], key, r[key])

    def test_latency_routing_rows_carry_the_prediction_error(self, tables) -> None:
        rows = tables["latency"]
        assert [r["run"] for r in rows] == list(priority.LATENCY_RUNS)
        for r in rows:
            assert 0 <= r["met %"] <= 100
            assert r["rel. error p50 %"] is not None, r["run"]

    def test_only_admission_refuses(self, tables) -> None:
        for r in tables["classes"]:
            if not r["run"].endswith("admission"):
                assert r["refused"] == "0", r
        assert "unmeetable" in str(row(tables["classes"], "lpm, bands + admission", 10)["refused"])


class TestAtTenTimesCapacity:
    def test_bands_keep_interactive_within_its_targets(self, tables) -> None:
        rows = tables["classes"]
        plain, bands = row(rows, "lpm, no classes", 10), row(rows, "lpm, bands", 10)
        assert bands["I TTFT p99 s"] < priority.INTERACTIVE.ttft < plain["I TTFT p99 s"]
        assert bands["I met %"] >= 99
        assert plain["I met %"] < 50

    def test_admission_keeps_goodput_that_queues_lose(self, tables) -> None:
        rows = tables["classes"]
        at_capacity = row(rows, "lpm, bands + admission", 1)["goodput/s"]
        queued = row(rows, "lpm, bands", 10)["goodput/s"]
        admitted = row(rows, "lpm, bands + admission", 10)
        assert queued < 0.5 * at_capacity
        assert admitted["goodput/s"] >= 0.9 * at_capacity
        assert admitted["B TTFT p99 s"] <= priority.BATCH.ttft


def test_the_cli_offers_it_with_quick() -> None:
    args = build_parser().parse_args(["experiment", "priority", "--quick"])
    assert (args.name, args.quick) == ("priority", True)
