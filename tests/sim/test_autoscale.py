"""The planner inside a replay: a ramp served as well as by a fleet sized for its peak, on fewer
GPU-seconds, with every request answered; and nothing changes without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from router.classes import TrafficClass
from router.cli import main
from router.cost_model import roofline
from router.planner import PlannerConfig
from simulator.config import SimConfig
from simulator.driver import SimResult, simulate
from traces.generators import shared_prefix
from traces.schema import Trace

COST = roofline("llama-2-13b", "l40s")  # about 2 requests/s a worker: a small ramp needs 8
TARGETS = (TrafficClass("default", priority=0, ttft=2.0, tpot=0.1),)
PEAK = 8  # workers the ramp's peak needs (the planner's estimate at 0.8 headroom)
SAMPLE = Path(__file__).resolve().parents[2] / "traces/samples/mooncake_conversation_head1000.jsonl"


def ramp(low: float, peak: float, duration: float, seed: int = 0) -> Trace:
    """Shared-prefix requests whose rate rises linearly from `low` to `peak` over the first
    half of `duration` and falls back over the second: a unit-rate Poisson trace with its
    arrival times mapped through the inverse of the ramp's cumulative rate."""
    grid = np.linspace(0.0, duration, 4001)
    rate = low + (peak - low) * (1 - np.abs(2 * grid / duration - 1))
    cumulative = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(grid))])
    trace = shared_prefix(
        num_requests=int(cumulative[-1]),
        rate=1.0,
        prefix_tokens=1000,
        question_tokens=100,
        output_tokens=100,
        seed=seed,
    )
    for r in trace.requests:
        r.arrival = float(np.interp(r.arrival, cumulative, grid))
    return Trace(trace.requests, trace.block_size, source="generated:ramp")


@pytest.fixture(scope="module")
def runs() -> tuple[SimResult, SimResult, int]:
    trace = ramp(1.0, 14.0, 600.0)
    planner = PlannerConfig.parse("min=2,max=8,startup=60,interval=15,step_down=2")
    config = SimConfig(num_workers=PEAK, policy="least_load", classes=TARGETS)
    static = simulate(trace, COST, config)
    scaled = simulate(trace, COST, SimConfig(policy="least_load", classes=TARGETS,
                                             autoscale=planner))  # fmt: skip
    return static, scaled, len(trace)


def attainment(result: SimResult) -> float:
    return result.summary["classes"]["default"]["attainment"]  # type: ignore[index]


def test_a_ramp_meets_the_peak_fleets_targets_on_fewer_gpu_seconds(runs) -> None:
    static, scaled, _ = runs
    assert attainment(scaled) >= attainment(static) - 0.01
    assert scaled.summary["gpu_seconds"] < 0.9 * static.summary["gpu_seconds"]


def test_every_request_is_answered_once(runs) -> None:
    _, scaled, total = runs
    ids = [r.id for r in scaled.records]
    assert len(ids) == len(set(ids)) == total == scaled.summary["completed"]


def test_workers_rise_then_fall(runs) -> None:
    _, scaled, _ = runs
    series = scaled.summary["workers_over_time"]
    serving = [active for _, active, _ in series]  # type: ignore[misc]
    top = serving.index(max(serving))
    assert serving[0] == 2 and max(serving) == PEAK
    assert serving[-1] < max(serving)
    assert all(a <= b for a, b in zip(serving[:top], serving[1 : top + 1], strict=True))
    times = [t for t, _, _ in series]  # type: ignore[misc]
    assert times == sorted(times)
    assert all(2 <= target <= PEAK for _, _, target in series)  # type: ignore[misc]


def test_a_started_worker_serves_only_after_its_start_up(runs) -> None:
    _, scaled, _ = runs
    first = {}
    for r in scaled.records:
        first.setdefault(r.worker, r.admitted)
        first[r.worker] = min(first[r.worker], r.admitted)
    # Workers 2.. were started at the earliest at the first decision (15 s), then 60 s up.
    assert all(first[w] >= 75.0 for w in first if w >= 2)
    assert {0, 1} <= set(first)


def test_a_static_run_counts_its_gpu_seconds(runs) -> None:
    static, _, _ = runs
    end = max(r.finish for r in static.records)
    assert static.summary["gpu_seconds"] == pytest.approx(PEAK * end)
    assert "workers_over_time" not in static.summary


def test_autoscale_leaves_no_room_for_a_split_fleet() -> None:
    with pytest.raises(ValueError, match="^autoscale:"):
        SimConfig(prefill_workers=1, decode_workers=1, autoscale=PlannerConfig())


@pytest.mark.parametrize(
    "spec, field", [("min=5,max=3", "min"), ("startup=-2", "startup"), ("interval=0", "interval")]
)
def test_bad_settings_stop_the_command_naming_the_field(spec: str, field: str, capsys) -> None:
    with pytest.raises(SystemExit, match=rf"--autoscale: {field}:"):
        main(["simulate", "--trace", "no-such-trace.jsonl", "--autoscale", spec])


def test_the_command_prints_gpu_hours(tmp_path: Path, capsys) -> None:
    code = main(["simulate", "--trace", str(SAMPLE), "--limit", "200", "--autoscale",
                 "min=1,max=4,startup=30,interval=10", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    assert "GPU-hours:" in capsys.readouterr().out
    assert (tmp_path / "requests.csv").read_text().count("\n") == 201


@pytest.mark.parametrize("policy", ["lpm", "vtc"])
def test_a_fleet_held_at_one_size_replays_as_a_static_one(policy: str) -> None:
    """The planner's machinery (its decisions, the engines it syncs) moves no request."""
    from traces.loaders import load_trace
    from traces.transform import limit

    trace = limit(load_trace(str(SAMPLE)), 300)
    cost = roofline("llama-3-8b", "a100-80g")
    static = simulate(trace, cost, SimConfig(num_workers=4, policy=policy))
    held = simulate(trace, cost, SimConfig(policy=policy, autoscale=PlannerConfig.parse(
        "min=4,max=4,startup=30,interval=5")))  # fmt: skip
    assert held.records == static.records
    assert held.summary["gpu_seconds"] == pytest.approx(static.summary["gpu_seconds"])
