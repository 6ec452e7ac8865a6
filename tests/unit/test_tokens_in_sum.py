"""Tokens credited in sum against tokens told request by request.

When neither the policy nor any queue counts tokens, the driver credits each step's tokens to
its worker's load in one sum and settles a request's own count once, at its finish
(`SimCluster._tokens_in_sum`). The reference tells the router every request's tokens as they
are made. The loads a decision reads and every record must match, and nothing may be left in
flight at the end.
"""

from __future__ import annotations

import pytest

from router.cost_model import roofline
from router.traits import Placement
from simulator.config import SimConfig
from simulator.driver import SimCluster, SimResult
from simulator.engine import EngineConfig
from traces.generators import shared_prefix
from traces.schema import Trace

COST = roofline("llama-3-8b", "a100-80g")


class Watched(SimCluster):
    """Notes every worker's tokens in flight as each request arrives."""

    def __init__(self, trace: Trace, cost, config: SimConfig) -> None:
        super().__init__(trace, cost, config)
        self.loads: list[tuple[int, ...]] = []

    def dispatch(self, req, rerouted: bool = False) -> None:
        self.loads.append(tuple(s.tokens_in_flight for s in self.view.workers.values()))
        super().dispatch(req, rerouted)


class PerRequest(Watched):
    """The reference: every request's tokens told to the router as they are made."""

    def __init__(self, trace: Trace, cost, config: SimConfig) -> None:
        super().__init__(trace, cost, config)
        self._tokens_in_sum = False


def trace() -> Trace:
    return shared_prefix(
        num_requests=300, num_tenants=5, prefix_tokens=700, output_tokens=120, rate=40
    )


def run(kind: type[Watched], config: SimConfig) -> tuple[Watched, SimResult]:
    cluster = kind(trace(), COST, config)  # a trace of its own: a run changes its requests
    return cluster, cluster.run()


CASES = {
    "least_load": SimConfig(num_workers=8, policy="least_load"),
    "round_robin, preempting": SimConfig(
        num_workers=4, policy="round_robin", engine=EngineConfig(num_kv_blocks=200)
    ),
    "lpm, prompts in chunks": SimConfig(
        num_workers=6, policy="lpm", engine=EngineConfig(max_num_batched_tokens=512)
    ),
    "least_load, split fleet": SimConfig(
        num_workers=8, policy="least_load", prefill_workers=2, decode_workers=4
    ),
    "round_robin, queues in the router": SimConfig(
        num_workers=6, policy="round_robin", placement=Placement.ROUTER, local_policy="fcfs"
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loads_and_records_match_tokens_told_per_request(name: str) -> None:
    config = CASES[name]
    in_sum, got = run(Watched, config)
    reference, want = run(PerRequest, config)
    assert in_sum._tokens_in_sum, "the case must take the summed path"
    assert in_sum.loads == reference.loads
    assert got.records == want.records
    for cluster in (in_sum, reference):
        assert all(s.tokens_in_flight == 0 for s in cluster.view.workers.values())
        assert not cluster.router._flights


@pytest.mark.parametrize("policy", ["d2lpm", "preble"])
def test_a_policy_that_counts_tokens_hears_them_per_request(policy: str) -> None:
    cluster = Watched(trace(), COST, SimConfig(num_workers=4, policy=policy))
    assert not cluster._tokens_in_sum
