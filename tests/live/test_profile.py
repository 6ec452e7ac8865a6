"""Fitting the simulator's step costs to a worker (`fairway profile`); the fit itself is
tested in tests/sim/test_fitted_cost.py."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from router.cli import main
from router.cost_model import FittedCost, StepShape, roofline
from tests.live_helpers import emulated_workers, run
from workers.profiler import Profiler, measure


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


def test_the_emulated_server_times_a_request_s_phases_as_vllm_does() -> None:
    """vLLM's engine-side histograms, which `fairway profile` times steps by: from first
    scheduled to first token is the prompt's one step, first token to last its decode steps."""
    truth = roofline("llama-3-8b", "a100-80g")
    prompt, answer = 1024, 6
    found: dict = {}

    async def go() -> None:
        async with emulated_workers(1) as urls, aiohttp.ClientSession() as session:
            body = {"model": "tiny", "prompt": [7] * prompt, "max_tokens": answer,
                    "ignore_eos": True}  # fmt: skip
            async with session.post(f"{urls[0]}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
            profiler = Profiler(urls[0], session)
            for phase in ("queue", "prefill", "decode", "inference"):
                found[phase] = await profiler.server_seconds(f"vllm:request_{phase}_time_seconds")

    run(go, timeout=60)
    assert all(count == 1 for _, count in found.values()), found
    prefill = truth.step_time(StepShape.prefill(prompt, 0))
    decode = sum(truth.step_time(StepShape.decode(1, prompt + k)) for k in range(1, answer))
    assert found["queue"][0] == pytest.approx(0.0, abs=1e-9)
    assert found["prefill"][0] == pytest.approx(prefill, rel=1e-6)
    assert found["decode"][0] == pytest.approx(decode, rel=1e-3)
    assert found["inference"][0] == pytest.approx(prefill + found["decode"][0], rel=1e-6)


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
