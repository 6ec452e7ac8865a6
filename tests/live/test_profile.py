"""Fitting the simulator's step costs to a worker (`fairway profile`); the fit itself is
tested in tests/sim/test_fitted_cost.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main
from router.cost_model import FittedCost, StepShape, roofline
from tests.live_helpers import emulated_workers, run
from workers.profiler import measure


@pytest.mark.slow
def test_profiling_an_emulated_worker_finds_its_cost_model(tmp_path: Path) -> None:
    """The emulated worker runs the llama-3-8b/A100 roofline in real time: the fitted profile
    must predict that roofline's steps (the linear model cannot bend like max(compute, memory),
    hence the tolerance), and simulate must accept it."""
    truth = roofline("llama-3-8b", "a100-80g")

    measured: list = []

    async def go() -> None:
        async with emulated_workers(1, speed=1.0) as urls:
            measured.extend(await measure(urls[0], repeats=1))

    run(go, timeout=120)
    model, capacity, measurements = measured
    fitted = FittedCost.fit(measurements, capacity, f"fitted:{model}")
    for shape in (StepShape.prefill(1024, 0), StepShape.prefill(2048, 0), StepShape.decode(8, 800)):
        assert fitted.step_time(shape) == pytest.approx(truth.step_time(shape), rel=0.3)
    assert capacity > 0 and model == "tiny"
    profile = tmp_path / "profile.json"
    fitted.save(profile, measurements)
    out = tmp_path / "run"
    argv = ["simulate", "--trace", "gen:shared_prefix", "--gen", "num_requests=50",
            "--cost", str(profile), "--workers", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 50 and summary["config"]["cost_model"] == "fitted:tiny"


def test_request_overhead_delays_the_engine_not_its_steps() -> None:
    from router.request import Request
    from simulator.config import SimConfig
    from simulator.driver import simulate
    from traces.schema import Trace

    ttft = {}
    for overhead in (0.0, 0.5):
        terms = {"overhead": 0.01, "per_token": 1e-4, "per_pair": 0.0, "per_kv_token": 0.0,
                 "request_overhead": overhead}  # fmt: skip
        cost = FittedCost(terms, 100_000, "t")
        trace = Trace([Request(0, 1.0, 100, 5), Request(1, 9.0, 200, 5)], 16)
        records = simulate(trace, cost, SimConfig(num_workers=1)).records
        ttft[overhead] = [r.ttft for r in records]
    assert ttft[0.5] == pytest.approx([t + 0.5 for t in ttft[0.0]])
