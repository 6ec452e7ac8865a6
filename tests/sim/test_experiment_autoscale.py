"""`fairway experiment autoscale` in its smallest configuration: what must hold whatever the
numbers (the oracle pays no more than the peak fleet, every request is answered, the peak fleet
serves at least as well as the mean one), and the reactive baseline's thresholds."""

from __future__ import annotations

import pytest

from router.cli import build_parser
from router.cost_model import roofline
from router.planner import Fleet, PlannerConfig, ReactivePlanner, Window
from simulator.bench import autoscale

pytestmark = pytest.mark.skipif(
    not autoscale.SERVEGEN.exists(), reason="../shared/traces is not beside the checkout"
)


@pytest.fixture(scope="module")
def sections() -> list[tuple[str, list[dict[str, object]]]]:
    return autoscale.run(seed=0, quick=True, jobs=2)


def rows_by_fleet(sections) -> dict[str, dict[str, object]]:
    (_, rows), _ = sections
    return {str(r["fleet"]): r for r in rows}


def test_five_fleets_then_a_verdict(sections) -> None:
    (title, rows), (verdict_title, verdict) = sections
    assert [r["fleet"] for r in rows] == [
        "static peak",
        "static mean",
        "reactive",
        "planner",
        "oracle",
    ]
    assert "ServeGen" in title and "240x faster" in title
    assert verdict_title == "Verdict" and len(verdict) == 1
    assert str(verdict[0]["verdict"]).startswith("the planner ")


def test_the_oracle_pays_no_more_than_the_peak_fleet(sections) -> None:
    by = rows_by_fleet(sections)
    assert by["oracle"]["GPU-hours"] <= by["static peak"]["GPU-hours"]


def test_every_request_is_answered(sections) -> None:
    total = len(autoscale.QUICK.load())
    assert all(r["completed"] == total for r in rows_by_fleet(sections).values())


def test_the_peak_fleet_serves_at_least_as_well_as_the_mean_one(sections) -> None:
    by = rows_by_fleet(sections)
    assert by["static peak"]["attainment"] >= by["static mean"]["attainment"]
    assert int(by["static peak"]["workers"]) >= int(by["static mean"]["workers"])


def test_the_trace_holds_only_the_chosen_clients() -> None:
    trace = autoscale.QUICK.load()
    assert {r.client for r in trace.requests} <= set(autoscale.CLIENTS)
    played = autoscale.QUICK.duration / autoscale.QUICK.speedup
    assert trace.requests[-1].arrival <= played


def window(start: float, arrivals: int) -> Window:
    return Window(start, start + 10.0, arrivals, 500 * arrivals, 50 * arrivals)


def test_the_reactive_planner_moves_only_outside_its_band() -> None:
    config = PlannerConfig(min_workers=1, max_workers=16, startup=30, interval=10, initial=4)
    planner = ReactivePlanner(config, roofline("llama-3-8b", "h100"))
    per_worker = planner.worker_rate(500, 50, 0.0)

    def at(share: float) -> int:
        """Arrivals over a window that load 4 workers to `share`."""
        return round(share * 4 * per_worker * 10)

    assert planner.decide(window(0, at(0.7)), Fleet(4)).target == 4  # in the band: holds
    up = planner.decide(window(10, at(1.2)), Fleet(4))
    assert up.reason == "up" and up.target > 4
    # Far below the low threshold: it waits a cool-down (four intervals) before it drains.
    quiet = [planner.decide(window(20 + 10 * i, at(0.1)), Fleet(up.target)) for i in range(6)]
    assert [p.reason for p in quiet[:4]] == ["hold: cooling down"] * 4
    # Then straight to the fleet the quiet load needs, as HPA scales to its desired count.
    assert quiet[4].reason == "down" and quiet[4].target == 1


def test_thresholds_must_straddle_the_headroom() -> None:
    with pytest.raises(ValueError, match="thresholds"):
        ReactivePlanner(PlannerConfig(), roofline("llama-3-8b", "h100"), high=0.7)


def test_the_command_runs(capsys) -> None:
    args = build_parser().parse_args(["experiment", "autoscale", "--quick"])
    assert args.func(args) == 0
    assert "oracle" in capsys.readouterr().out
