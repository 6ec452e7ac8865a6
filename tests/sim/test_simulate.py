"""The `fairway simulate` interface, determinism, and the whole Mooncake replay (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from router.classes import TrafficClass
from router.cli import main
from router.core import Router
from router.cost_model import roofline
from router.prefix_index import PrefixIndex
from simulator.config import SimConfig
from simulator.driver import SimCluster, SimResult, simulate
from simulator.engine import EngineConfig
from traces.generators import shared_prefix
from traces.loaders import load_trace

SAMPLE = Path(__file__).resolve().parents[2] / "traces/samples/mooncake_conversation_head1000.jsonl"
COST = roofline("llama-3-8b", "a100-80g")
SUMMARY_KEYS = {
    "completed",
    "total",
    "ttft",
    "tpot",
    "e2e",
    "throughput",
    "prefix_cache",
    "per_client",
    "fairness",
    "wall_seconds",
    "cpu_seconds",
    "simulated_seconds",
}


class TestSimulateCommand:
    def test_writes_summary_and_per_request_rows(self, tmp_path: Path, capsys) -> None:
        code = main(
            [
                "simulate",
                "--trace",
                str(SAMPLE),
                "--policy",
                "round_robin",
                "--workers",
                "4",
                "--model",
                "mistral-7b",
                "--gpu",
                "h100",
                "--limit",
                "200",
                "--rate-scale",
                "2",
                "--tenants",
                "3",
                "--out",
                str(tmp_path),
            ]
        )
        assert code == 0
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary.keys() >= SUMMARY_KEYS
        assert summary["completed"] == summary["total"] == 200
        for metric in ("ttft", "tpot", "e2e"):
            assert {"mean", "p50", "p90", "p99"} <= summary[metric].keys()
        assert summary["throughput"]["requests_per_s"] > 0
        assert summary["prefix_cache"]["hit_rate"] <= summary["prefix_cache"]["bound"]
        assert set(summary["per_client"]) == {"tenant-0", "tenant-1", "tenant-2"}
        for client in summary["per_client"].values():
            # Service per time window adds up to the client's whole service.
            assert sum(client["service_by_window"]) == pytest.approx(client["service"])
            assert all(0 <= b <= 1 for b in client["backlogged_by_window"])
        assert 0 < summary["fairness"]["jain"] <= 1
        rows = (tmp_path / "requests.csv").read_text().splitlines()
        assert len(rows) == 201 and rows[0].startswith("id,client")
        assert "round_robin" in capsys.readouterr().out

    def test_load_floors_leave_every_row_as_it_was(self, tmp_path: Path, capsys) -> None:
        """On a fleet large enough for load floors, bringing every engine up to date before
        each decision instead (--no-load-floors) writes the very same rows."""
        rows = []
        for flags in ([], ["--no-load-floors"]):
            out = tmp_path / ("every-engine" if flags else "floors")
            fleet = ["--window", "0:20", "--tile", "32", "--workers", "256"]
            argv = ["simulate", "--trace", str(SAMPLE), "--policy", "least_load", *fleet]
            argv += ["--out", str(out), *flags]
            assert main(argv) == 0
            rows.append((out / "requests.csv").read_text())
        assert rows[0] == rows[1] and rows[0].count("\n") > 1000

    def test_generator_as_trace(self, capsys) -> None:
        assert (
            main(
                [
                    "simulate",
                    "--trace",
                    "gen:few_shot",
                    "--gen",
                    "num_requests=100",
                    "--workers",
                    "2",
                ]
            )
            == 0
        )
        assert "100/100" in capsys.readouterr().out

    @pytest.mark.parametrize(
        "argv, message",
        [
            (["--trace", "/nonexistent.jsonl"], "no such file"),
            (["--trace", str(SAMPLE), "--workers", "0"], "workers: must be positive"),
            (["--trace", str(SAMPLE), "--param", "bogus=1"], "takes no parameter"),
            (
                ["--trace", str(SAMPLE), "--policy", "lpm", "--param", "cache_threshold=high"],
                "parameter 'cache_threshold'='high': Input should be a valid number",
            ),
            (
                ["--trace", str(SAMPLE), "--local-policy", "dlpm", "--local-param", "quantum=-1"],
                "quantum: must be positive",
            ),
        ],
    )
    def test_bad_input_is_a_clear_error(self, argv: list[str], message: str, capsys) -> None:
        assert main(["simulate", *argv]) == 2
        assert message in capsys.readouterr().err

    def test_bad_generator_parameter_names_it(self) -> None:
        with pytest.raises(SystemExit, match="parameter 'num_tenants'='many'"):
            main(["simulate", "--trace", "gen:shared_prefix", "--gen", "num_tenants=many"])

    @pytest.mark.slow  # runs the installed command as a process
    def test_console_script_lists(self) -> None:
        out = subprocess.run(
            [sys.executable, "-m", "router.cli", "policies"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for name in ("round_robin", "random", "least_load", "power_of_two"):
            assert name in out
        models = subprocess.run(
            [sys.executable, "-m", "router.cli", "models"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for name in ("llama-3-8b", "llama-2-13b", "mistral-7b", "llama-3-70b", "h200", "l40s"):
            assert name in models

    @pytest.mark.slow  # the command as a process: it freezes its heap before exiting
    def test_the_command_writes_everything_before_it_exits(self, tmp_path: Path) -> None:
        """`fairway simulate` leaves its fleet to the OS at exit (router.cli.run): its output
        files are complete, what it prints is flushed, and an error keeps its exit status."""
        out = tmp_path / "out"
        argv = [sys.executable, "-m", "router.cli", "simulate", "--trace", str(SAMPLE)]
        done = subprocess.run(
            [*argv, "--limit", "300", "--workers", "4", "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert "300/300" in done.stdout
        rows = (out / "requests.csv").read_text().splitlines()
        assert len(rows) == 301  # the header and every request
        assert json.loads((out / "summary.json").read_text())["completed"] == 300
        failed = subprocess.run(
            [*argv, "--workers", "0"], capture_output=True, text=True, timeout=300
        )
        assert failed.returncode == 2
        assert failed.stderr.startswith("fairway: error:")

    @pytest.mark.slow  # a process of its own: BLAS starts its threads when numpy is imported
    def test_the_command_starts_no_blas_threads(self) -> None:
        """OpenBLAS's idle threads spin for a tenth of a second of CPU after numpy is imported;
        the command's numpy work is vector arithmetic, so its processes start none."""
        code = "import router.cli, numpy, os; print(len(os.listdir('/proc/self/task')))"
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        assert out.split() == ["1"]  # the main thread alone


def test_cpu_seconds_are_the_event_loops_alone() -> None:
    """`cpu_seconds` times the event loop, as `fairway bench-vidur` compares it with Vidur's: the
    summary made after it is not in it, so it is under the CPU time of the whole call."""
    trace = shared_prefix(num_requests=400, seed=1)
    started = time.process_time()
    summary = simulate(trace, COST, SimConfig(num_workers=4, policy="lpm")).summary
    whole = time.process_time() - started
    assert 0 < summary["cpu_seconds"] < whole  # type: ignore[operator]


class TestDeterminism:
    @pytest.mark.parametrize("policy", ["random", "power_of_two", "least_load"])
    def test_same_seed_same_result(self, policy: str) -> None:
        def once(seed: int):
            trace = shared_prefix(num_requests=300, seed=1)
            cfg = SimConfig(num_workers=4, policy=policy, seed=seed)
            return simulate(trace, roofline("llama-3-8b", "h100"), cfg).records

        assert once(7) == once(7)
        if policy != "least_load":
            assert [r.worker for r in once(7)] != [r.worker for r in once(8)]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["round_robin", "random", "least_load", "power_of_two"])
def test_whole_mooncake_conversation_replays(mooncake_path: Path, policy: str) -> None:
    trace = load_trace(mooncake_path)
    result = simulate(
        trace, roofline("llama-3-8b", "a100-80g"), SimConfig(num_workers=8, policy=policy)
    )
    s = result.summary
    assert s["completed"] == s["total"] == 12031
    assert all(w.peak_kv_blocks <= w.kv_blocks for w in result.workers)
    assert s["prefix_cache"]["hit_rate"] <= s["prefix_cache"]["bound"]
    assert all(
        r.output_tokens == q.output_len for r, q in zip(result.records, trace.requests, strict=True)
    )


class TestIndexModes:
    """The router's prefix index, approximate (updated on routing) or precise (KV events)."""

    @staticmethod
    def held_blocks(index: PrefixIndex, worker: int) -> set[int]:
        return {h for node in index.nodes() if worker in node.workers for h in node.key}

    def run(self, **kw: object) -> tuple[SimCluster, SimResult]:
        trace = shared_prefix(num_requests=300, num_tenants=6, rate=30.0, seed=3)
        # Room for a few prompts per worker only, so engines evict and the index must follow.
        engine = EngineConfig(num_kv_blocks=1500, check_invariants=True)
        cluster = SimCluster(
            trace, COST, SimConfig(num_workers=3, policy="lpm", engine=engine, **kw)
        )
        return cluster, cluster.run()

    def test_precise_index_holds_exactly_what_each_engine_caches(self) -> None:
        cluster, _ = self.run(index="precise")
        assert sum(e.blocks.num_evictions for e in cluster.engines) > 0, "no eviction tested"
        for engine in cluster.engines:
            cached = engine.blocks.cached_hashes()
            assert cached and self.held_blocks(cluster.view.index, engine.id) == cached

    def test_late_events_leave_the_router_blind(self) -> None:
        on_time = self.run(index="precise")[1].summary["prefix_cache"]
        never = self.run(index="precise", kv_event_delay=1e9)[1].summary["prefix_cache"]
        assert on_time["predicted_hit_rate"] > 0.2 and never["predicted_hit_rate"] == 0
        assert never["hit_rate"] > 0, "engines still hit their own caches"

    def test_approximate_index_promises_what_was_routed(self) -> None:
        summary = self.run()[1].summary
        assert summary["config"]["index"] == "approximate"
        assert 0 < summary["prefix_cache"]["predicted_hit_rate"] <= 1

    @pytest.mark.parametrize("policy", ["round_robin", "random", "least_load", "power_of_two"])
    def test_a_policy_reading_no_index_routes_the_same_without_one(self, policy: str) -> None:
        """A policy whose traits say it reads no prefix index routes as it would with the index
        of what was routed kept (as the proxy keeps it, for its metrics); the simulator skips
        it, and says it made no estimate."""

        class Estimating(SimCluster):
            def _new_router(self, glob, local):
                return Router(glob, local, replace(self.router_config, estimate_hits=True))

        trace = shared_prefix(num_requests=300, num_tenants=6, rate=30.0, seed=3)
        config = SimConfig(num_workers=3, policy=policy, engine=EngineConfig(num_kv_blocks=1500))
        skipped = SimCluster(trace, COST, config)
        kept = Estimating(shared_prefix(num_requests=300, num_tenants=6, rate=30.0, seed=3),
                          COST, config)  # fmt: skip
        without, with_index = skipped.run(), kept.run()
        assert without.records == with_index.records
        held = [
            sum(len(self.held_blocks(c.view.index, w)) for w in range(3)) for c in (skipped, kept)
        ]
        assert held[0] == 0 < held[1]
        assert without.summary["prefix_cache"]["predicted_hit_rate"] is None
        assert with_index.summary["prefix_cache"]["predicted_hit_rate"] > 0

    def test_classes_keep_the_index_their_predictions_read(self) -> None:
        trace = shared_prefix(num_requests=100, num_tenants=4, rate=20.0, seed=3)
        classes = (TrafficClass("interactive", 0),)
        config = SimConfig(num_workers=3, policy="least_load", classes=classes)
        summary = simulate(trace, COST, config).summary
        assert summary["prefix_cache"]["predicted_hit_rate"] > 0

    def test_bad_mode_is_named(self) -> None:
        with pytest.raises(ValueError, match="index: 'approximate' or 'precise'"):
            SimConfig(index="exact")


def test_every_experiment_run_is_a_valid_configuration() -> None:
    import policies
    from simulator.bench.experiments import EXPERIMENTS, WORKLOADS

    for _, runs in EXPERIMENTS.values():  # each run's SimConfig validated itself on import
        for run in runs:
            assert run.workload in WORKLOADS, run.label
            config = run.config
            policy = policies.global_policies.build(config.policy, config.policy_params)
            local = config.local_policy or policy.default_local
            policies.local_policies.build(local, config.local_params)


class TestRouterPlacement:
    """The local discipline in the router's per-worker queue, in front of FCFS engines."""

    def test_fcfs_with_a_wide_window_is_the_engine_placement(self) -> None:
        trace = shared_prefix(num_requests=200, num_tenants=3, rate=15.0, seed=1)
        runs = [
            simulate(trace, COST, SimConfig(num_workers=2, policy="least_load", **kw)).records
            for kw in ({}, {"placement": "router", "window": 10_000})
        ]
        assert runs[0] == runs[1]

    def test_the_window_bounds_what_an_engine_runs(self) -> None:
        trace = shared_prefix(num_requests=60, num_tenants=3, rate=15.0, seed=1)
        config = SimConfig(num_workers=1, policy="vtc", placement="router", window=2)
        result = simulate(trace, COST, config)
        assert result.summary["config"]["local_policy"] == "vtc"
        events = sorted(
            [(r.admitted, 1) for r in result.records] + [(r.finish, -1) for r in result.records]
        )
        running = peak = 0
        for _, delta in events:
            running += delta
            peak = max(peak, running)
        assert peak == 2

    def test_a_narrow_window_keeps_vtc_fair_in_front_of_fcfs(self) -> None:
        from simulator.bench.experiments import WORKLOADS

        gaps = {}
        for window in (4, 256):
            config = SimConfig(num_workers=1, policy="vtc", placement="router", window=window)
            summary = simulate(WORKLOADS["flood_1"](0), COST, config).summary
            gaps[window] = summary["fairness"]["max_service_gap"]
        assert gaps[4] * 5 < gaps[256]
