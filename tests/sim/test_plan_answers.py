"""`fairway plan` on a small generated trace, its answers simulated again: the answer meets the
goal and one worker fewer does not, for a mixed fleet and a split one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from router.cli import main
from router.cost_model import roofline
from simulator.config import SimConfig
from simulator.driver import simulate
from traces.generators import shared_prefix

GEN = {"num_requests": 200, "rate": 30}
TTFT, TPOT, ATTAINMENT = 2.0, 0.015, 0.9
COST = roofline("llama-3-8b", "h100")


def plan_args(out: Path, *extra: str) -> list[str]:
    return ["plan", "--trace", "gen:shared_prefix", *(f"--gen={k}={v}" for k, v in GEN.items()),
            "--gpu", "h100", "--policies", "least_load", "--ttft", str(TTFT), "--tpot", str(TPOT),
            "--jobs", "2", "--json", str(out), *extra]  # fmt: skip


def attainment(workers: int, prefill: int = 0, decode: int = 0) -> float:
    """The share of requests within both targets, counted here from the records."""
    config = SimConfig(
        num_workers=workers, prefill_workers=prefill, decode_workers=decode, policy="least_load"
    )
    records = simulate(shared_prefix(**GEN), COST, config).records
    met = sum(1 for r in records if r.ttft <= TTFT and (r.tpot is None or r.tpot <= TPOT))
    return met / GEN["num_requests"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    argv = plan_args(out, "--attainment", str(ATTAINMENT), "--max-workers", "12", "--split")
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_the_mixed_answer_meets_the_goal_and_one_fewer_does_not(planned: dict) -> None:
    (mixed,) = [s for s in planned["searches"] if not s["split"]]
    n = mixed["workers"]
    assert n is not None and n > 1
    assert attainment(n) >= ATTAINMENT > attainment(n - 1)
    assert mixed["meets"][str(n)] and not mixed["meets"][str(n - 1)]
    assert not mixed["monotonicity_violations"]


def test_a_split_fleet_wins_under_a_tight_tpot_and_every_smaller_split_misses(
    planned: dict,
) -> None:
    n, p, d = planned["workers"], planned["prefill_workers"], planned["decode_workers"]
    assert p > 0 and d > 0 and p + d == n and planned["policy"] == "least_load"
    assert planned["attainment"] == pytest.approx(attainment(n, p, d))
    assert planned["attainment"] >= ATTAINMENT
    assert all(attainment(n - 1, q, n - 1 - q) < ATTAINMENT for q in range(1, n - 1))
    assert attainment(n - 1) < ATTAINMENT, "nor does a mixed fleet of as many"
    fleets = {(c["workers"], c["prefill_workers"]) for c in planned["candidates"]}
    assert {(n - 1, q) for q in range(1, n - 1)} <= fleets


def test_an_impossible_goal_says_how_close_it_came(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(plan_args(out, "--attainment", "1", "--max-workers", "2")) == 1
    assert "no fleet up to 2 workers meets it" in capsys.readouterr().out
    planned = json.loads(out.read_text())
    assert planned["workers"] is None and planned["best"]["attainment"] < 1
    assert {c["workers"] for c in planned["candidates"]} == {1, 2}


@pytest.mark.slow  # a Ray head of its own
def test_on_a_ray_cluster_the_candidates_and_the_answer_are_the_same(tmp_path: Path) -> None:
    import tempfile

    from tests.live_helpers import fairway_run, ray_head

    local, remote = tmp_path / "local.json", tmp_path / "ray.json"
    small = ("--attainment", str(ATTAINMENT), "--max-workers", "6")
    assert main(plan_args(local, *small)) == 0
    temp = Path(tempfile.mkdtemp(prefix="fw-ray-", dir="/tmp"))  # short: Ray's socket paths
    with ray_head(temp) as head:  # the test's own head, stopped by its pids
        done = fairway_run(plan_args(remote, *small, "--ray-address", head.address))
        assert done.returncode == 0, done.stderr[-3000:]
        assert "plan: runs as Ray tasks on the cluster at" in done.stderr
        assert list(temp.glob("session_*/logs/worker-*.out")), "no Ray worker was started"
    shutil.rmtree(temp, ignore_errors=True)
    assert json.loads(remote.read_text()) == json.loads(local.read_text())
