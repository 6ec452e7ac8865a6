"""Service curves and the service gap; VTC's bound as a property on random backlogged loads."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.cost_model import roofline
from router.records import RequestRecord
from router.request import Request
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.engine import EngineConfig
from simulator.fairness import jain_while_backlogged, max_service_gap, service_curves
from simulator.results import summarize
from traces.schema import Trace

COST = roofline("llama-3-8b", "a100-80g")


def record(
    i: int,
    client: str,
    arrival: float,
    admitted: float,
    first: float,
    finish: float,
    prompt: int,
    output: int,
    weight: float = 1.0,
) -> RequestRecord:
    return RequestRecord(
        i, client, None, 0, arrival, admitted, first, finish, prompt, 0, output, 0, weight
    )


class TestServiceCurves:
    def test_input_at_admission_output_over_the_decode(self) -> None:
        curves = service_curves([record(0, "a", 0.0, 1.0, 2.0, 4.0, 100, 10)], step=0.5)
        at = dict(zip(curves.times.tolist(), curves.service[0].tolist(), strict=True))
        assert at[0.5] == 0 and at[1.0] == 100 and at[3.0] == 100 + 10 and at[4.0] == 120
        # Backlogged only while waiting: from arrival until admission.
        assert curves.backlogged[0].tolist()[:4] == [True, True, False, False]

    def test_summary_service_is_divided_by_the_client_weight(self) -> None:
        # "gold" pays for twice the share: the same tokens count half against it.
        recs = [
            record(0, "gold", 0.0, 0.0, 1.0, 2.0, 100, 10, weight=2.0),
            record(1, "free", 0.0, 0.0, 1.0, 2.0, 100, 10),
        ]
        summary = summarize(
            recs, [], total=2, cache_bound=0.0, simulated_seconds=2.0, wall_seconds=0.0, config={}
        )
        gold, free = summary["per_client"]["gold"], summary["per_client"]["free"]
        assert (gold["weight"], gold["service"]) == (2.0, 60.0)
        assert (free["weight"], free["service"]) == (1.0, 120.0)
        for client in (gold, free):
            assert sum(client["service_by_window"]) == pytest.approx(client["service"])

    def test_gap_counts_only_intervals_where_both_wait(self) -> None:
        recs = [
            record(0, "a", 0.0, 1.0, 1.1, 1.2, 1000, 1),  # a served at 1...
            record(1, "a", 0.0, 5.0, 5.1, 5.2, 1000, 1),  # ...and waits until 5
            record(2, "b", 0.0, 3.0, 3.1, 3.2, 10, 1),  # b waits until 3 for almost nothing
            record(3, "c", 6.0, 6.0, 6.1, 6.2, 99999, 1),  # c never waits: not counted
        ]
        gap = max_service_gap(service_curves(recs, step=0.1))
        # While both wait ([0, 3)), a received 1002 (from 1 to 1.2) and b 0; at 3, b gets 10 and
        # stops waiting.
        assert 1001 < gap < 1003


def backlogged_trace(seed: int, num_clients: int, max_in: int, max_out: int) -> Trace:
    """Every client sends far more than one worker can serve, at different rates and sizes."""
    rng = random.Random(seed)
    reqs = []
    for c in range(num_clients):
        rate = rng.uniform(2, 20)
        t = 0.0
        for _ in range(rng.randint(20, 40)):
            t += rng.expovariate(rate)
            reqs.append(
                Request(0, t, rng.randint(1, max_in), rng.randint(1, max_out), client=f"c{c}")
            )
    reqs.sort(key=lambda r: r.arrival)
    for i, r in enumerate(reqs):
        r.id = i
    return Trace(reqs, 16)


class TestVTCBound:
    @settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        seed=st.integers(0, 10_000),
        num_clients=st.integers(2, 5),
        max_in=st.integers(50, 3000),
        max_out=st.integers(5, 400),
    )
    def test_service_gap_stays_within_two_requests(self, seed, num_clients, max_in, max_out):
        """One request runs at a time, so VTC's bound is 2 x (w_in x max in + w_out x max out)."""
        trace = backlogged_trace(seed, num_clients, max_in, max_out)
        config = SimConfig(num_workers=1, policy="vtc", engine=EngineConfig(max_num_seqs=1))
        records = simulate(trace, COST, config).records
        bound = 2 * (
            max(r.prompt_tokens for r in records) + 2 * max(r.output_tokens for r in records)
        )
        assert max_service_gap(service_curves(records, step=0.01)) <= bound

    def test_fcfs_breaks_that_bound_where_vtc_keeps_it(self) -> None:
        """The property is not vacuous: a flooding client starves another under FCFS."""
        reqs = [Request(i, 0.001 * i, 2000, 100, client="flood") for i in range(60)]
        reqs += [Request(60 + i, 0.5 + 0.01 * i, 2000, 100, client="calm") for i in range(10)]
        gaps = {}
        for policy in ("least_load", "vtc"):
            trace = Trace(
                [
                    Request(r.id, r.arrival, r.prompt_len, r.output_len, client=r.client)
                    for r in reqs
                ],
                16,
            )
            config = SimConfig(num_workers=1, policy=policy, engine=EngineConfig(max_num_seqs=1))
            records = simulate(trace, COST, config).records
            gaps[policy] = max_service_gap(service_curves(records, step=0.01))
        bound = 2 * (2000 + 2 * 100)
        assert gaps["vtc"] <= bound < gaps["least_load"]


class TestJainWhileBacklogged:
    def test_counts_only_clients_waiting_together(self) -> None:
        # a and b wait together over [0, 2) and receive 100 each: fair. c never waits.
        recs = [
            record(0, "a", 0.0, 2.0, 2.0, 2.0, 100, 0),
            record(1, "b", 0.0, 2.0, 2.0, 2.0, 100, 0),
            record(2, "c", 0.0, 0.0, 0.0, 0.0, 9999, 0),
        ]
        assert jain_while_backlogged(service_curves(recs, step=0.5)) == pytest.approx(1.0)
        # b gets nothing while both wait (admitted only after a's backlog ends): 1/2.
        recs[1] = record(1, "b", 0.0, 3.0, 3.0, 3.0, 100, 0)
        assert jain_while_backlogged(service_curves(recs, step=0.5)) == pytest.approx(0.5)

    def test_none_without_two_clients_waiting(self) -> None:
        recs = [record(0, "a", 0.0, 1.0, 1.0, 2.0, 100, 10)]
        assert jain_while_backlogged(service_curves(recs, step=0.5)) is None

    def test_vtc_is_fairer_than_fcfs_under_a_flood(self) -> None:
        from simulator.bench.experiments import WORKLOADS

        jain = {}
        for policy in ("least_load", "lpm", "vtc"):
            config = SimConfig(num_workers=1, policy=policy)
            summary = simulate(WORKLOADS["flood_1"](0), COST, config).summary
            jain[policy] = summary["fairness"]["jain"]
        assert max(jain["least_load"], jain["lpm"]) + 0.15 < jain["vtc"]
