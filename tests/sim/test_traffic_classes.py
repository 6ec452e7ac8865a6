"""Traffic classes in the simulator: strict bands with VTC's bound kept inside each (both
placements), vLLM's priority preemption, admission control that loses nothing, and a TTFT
prediction that tracks the engine on a steady workload."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.classes import QUEUE_TIME, UNMEETABLE, TrafficClass
from router.records import RequestRecord
from router.request import Request
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.engine import EngineConfig
from simulator.fairness import max_service_gap, service_curves
from tests.helpers import COST
from traces.generators import priority_mix
from traces.schema import Trace

HIGH, LOW = 0, 5
CLASSES = (TrafficClass("interactive", HIGH), TrafficClass("batch", LOW))


def two_band_trace(seed: int, clients_per_band: int, max_in: int, max_out: int) -> Trace:
    """Every client of both bands backlogged from the start, the high band arriving a little
    later in bursts (so it finds low-band work queued ahead of it)."""
    rng = random.Random(seed)
    reqs = []
    for band, start in ((LOW, 0.0), (HIGH, 0.2)):
        for c in range(clients_per_band):
            t = start
            for _ in range(rng.randint(6, 12)):
                t += rng.uniform(0.0, 0.05)
                prompt, out = rng.randint(1, max_in), rng.randint(1, max_out)
                reqs.append(Request(0, t, prompt, out, client=f"b{band}c{c}", priority=band))
    reqs.sort(key=lambda r: r.arrival)
    for i, r in enumerate(reqs):
        r.id = i
    return Trace(reqs, 16)


def placement_config(placement: str, policy: str = "vtc") -> SimConfig:
    """One request at a time, so the order a discipline picks is the order served."""
    return SimConfig(
        num_workers=1,
        policy=policy,
        classes=CLASSES,
        placement=placement,
        window=1,
        engine=EngineConfig(max_num_seqs=1),
    )


def overtaken(records: list[RequestRecord]) -> list[tuple[int, int]]:
    """(low, high) pairs where a lower-band request was admitted while a higher-band one
    on the same worker had been waiting: what strict bands forbid."""
    out = []
    for low in records:
        for high in records:
            if (
                high.priority < low.priority
                and high.worker == low.worker
                and high.arrival < low.admitted < high.admitted
            ):
                out.append((low.id, high.id))
    return out


class TestBands:
    @pytest.mark.parametrize("placement", ["engine", "router"])
    @settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        seed=st.integers(0, 10_000),
        clients=st.integers(2, 4),
        max_in=st.integers(50, 2000),
        max_out=st.integers(5, 300),
    )
    def test_strict_and_vtc_bounded_inside_each_band(
        self, placement: str, seed: int, clients: int, max_in: int, max_out: int
    ) -> None:
        trace = two_band_trace(seed, clients, max_in, max_out)
        records = simulate(trace, COST, placement_config(placement)).records
        assert len(records) == len(trace)
        assert overtaken(records) == []
        for band in (HIGH, LOW):
            mine = [r for r in records if r.priority == band]
            bound = 2 * (
                max(r.prompt_tokens for r in mine) + 2 * max(r.output_tokens for r in mine)
            )
            assert max_service_gap(service_curves(mine, step=0.01)) <= bound

    def test_without_bands_the_high_band_waits_behind_the_low(self) -> None:
        """The property is not vacuous: without classes (one priority) the same trace
        serves the later interactive bursts behind queued batch work."""
        trace = two_band_trace(1, 3, 1500, 200)
        flat = Trace(
            [
                Request(r.id, r.arrival, r.prompt_len, r.output_len, client=r.client)
                for r in trace.requests
            ],
            16,
        )
        config = placement_config("engine")
        flat_records = simulate(flat, COST, SimConfig(**{**config.__dict__, "classes": ()}))
        priority_of = {r.id: r.priority for r in trace.requests}
        for r in flat_records.records:
            r.priority = priority_of[r.id]
        assert overtaken(flat_records.records)
        banded = simulate(trace, COST, config).records
        high_wait = [r.queue_time for r in banded if r.priority == HIGH]
        flat_wait = [r.queue_time for r in flat_records.records if r.priority == HIGH]
        assert sum(high_wait) < sum(flat_wait) * 0.75


class TestPriorityPreemption:
    def test_memory_short_preempts_the_lowest_priority_as_vllm(self) -> None:
        """Tight KV: running requests of both bands grow until one must go. vLLM's priority
        scheduler preempts the lowest-priority running request; its FCFS one the newest."""
        reqs = [Request(i, 0.0, 400, 600, client=f"low{i}", priority=LOW) for i in range(4)]
        reqs += [Request(4 + i, 0.05, 400, 600, client=f"hi{i}", priority=HIGH) for i in range(4)]
        trace = Trace(reqs, 16)
        engine = EngineConfig(num_kv_blocks=200, max_num_seqs=8, check_invariants=True)
        preempted = {}
        for by_priority in (True, False):
            config = SimConfig(
                num_workers=1,
                policy="least_load",
                classes=CLASSES,
                engine=engine,
                priority_scheduling=by_priority,
            )
            records = simulate(trace, COST, config).records
            assert len(records) == len(reqs)
            preempted[by_priority] = {
                band: sum(r.preemptions for r in records if r.priority == band)
                for band in (HIGH, LOW)
            }
        # Once only the high band runs it preempts its own latest, as vLLM would.
        assert preempted[True][LOW] > preempted[True][HIGH]
        assert preempted[False][HIGH] > preempted[True][HIGH]  # FCFS takes the newest


def overloaded(duration: float = 40.0, batch_rate: float = 30.0) -> Trace:
    return priority_mix(duration=duration, interactive_rate=3, batch_rate=batch_rate, seed=3)


LIMITED = (
    TrafficClass("interactive", 0, ttft=0.5, tpot=0.2, max_queue_time=3.0),
    TrafficClass("batch", 1, max_queue_time=5.0),
)


class TestAdmission:
    @pytest.mark.parametrize("placement", ["engine", "router"])
    def test_refuses_only_what_never_started_and_loses_nothing(self, placement: str) -> None:
        trace = overloaded()
        config = SimConfig(
            num_workers=2, policy="lpm", classes=LIMITED, admission=True, placement=placement
        )
        result = simulate(trace, COST, config)
        s = result.summary
        refused = s["refusals"]
        assert refused[QUEUE_TIME] > 0  # the batch backlog is cut
        assert s["completed"] + sum(refused.values()) == len(trace)
        done = {r.id for r in result.records}
        assert len(done) == s["completed"]  # no request both answered and refused
        by_class = s["classes"]
        assert by_class["batch"]["refused"][QUEUE_TIME] > 0
        # What was served waited at most its class's limit before starting (the check runs
        # at the limit, so a start at that very moment counts as in time).
        for r in result.records:
            limit = 3.0 if r.priority == 0 else 5.0
            assert r.queue_time <= limit + 1e-6

    def test_early_refusal_when_no_worker_can_meet_the_target(self) -> None:
        trace = priority_mix(duration=10, interactive_rate=100, batch_rate=0, seed=5)
        config = SimConfig(num_workers=1, policy="lpm", classes=LIMITED, admission=True)
        s = simulate(trace, COST, config).summary
        assert s["refusals"][UNMEETABLE] > 0
        assert s["classes"]["interactive"]["attainment"] > 0

    def test_without_admission_control_nothing_is_refused(self) -> None:
        config = SimConfig(num_workers=2, policy="lpm", classes=LIMITED)
        s = simulate(overloaded(duration=20), COST, config).summary
        assert sum(s["refusals"].values()) == 0 and s["completed"] == s["total"]


class TestPrediction:
    def test_predicted_ttft_tracks_the_engine_on_a_steady_workload(self) -> None:
        """Interactive and batch traffic well under capacity: the router's prediction from
        the step-cost model is within 10 ms of the engine's TTFT for most requests, and
        within 30 % of it at the median."""
        trace = priority_mix(duration=60, interactive_rate=4, batch_rate=2, seed=1)
        classes = (TrafficClass("interactive", 0, ttft=1.0), TrafficClass("batch", 1))
        s = simulate(trace, COST, SimConfig(num_workers=2, policy="lpm", classes=classes))
        prediction = s.summary["ttft_prediction"]
        assert prediction["requests"] == len(trace)
        assert abs(prediction["error"]["p50"]) < 0.01
        assert prediction["relative_error"]["p50"] < 0.3

    def test_summary_has_goodput_per_class(self) -> None:
        trace = priority_mix(duration=30, interactive_rate=4, batch_rate=2, seed=2)
        classes = (TrafficClass("interactive", 0, ttft=1.0, tpot=0.1), TrafficClass("batch", 1))
        s = simulate(trace, COST, SimConfig(num_workers=2, policy="lpm", classes=classes)).summary
        interactive = s["classes"]["interactive"]
        assert interactive["requests"] == sum(1 for r in trace.requests if r.priority == 0)
        assert interactive["met_targets"] <= interactive["completed"]
        assert interactive["attainment"] == pytest.approx(
            interactive["met_targets"] / interactive["requests"]
        )
        assert interactive["goodput"] > 0


class TestTenantBudgets:
    def test_a_tenant_gets_its_burst_and_then_its_rate(self) -> None:
        """A flooding tenant limited to 2 requests/s with a burst of 4 has about 4 + 2 x the
        run's length admitted; the calm tenants, unlimited, lose nothing."""
        from router.budgets import RateLimit
        from traces.generators import flood

        trace = flood(duration=20, flood_rate=20, seed=1)
        limits = {"flood": RateLimit(requests_per_s=2, burst=4)}
        config = SimConfig(num_workers=2, policy="least_load", rate_limits=limits)
        s = simulate(trace, COST, config).summary
        flood_sent = sum(1 for r in trace.requests if r.client == "flood")
        flood_done = s["per_client"]["flood"]["requests"]
        first = min(r.arrival for r in trace.requests if r.client == "flood")
        last = max(r.arrival for r in trace.requests if r.client == "flood")
        assert 4 + 2 * (last - first) - 2 <= flood_done <= 4 + 2 * (last - first) + 1
        assert s["refusals"]["rate_limit"] == flood_sent - flood_done
        calm = sum(1 for r in trace.requests if r.client != "flood")
        assert s["completed"] == flood_done + calm
