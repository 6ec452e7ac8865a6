"""Least-load routing from load floors against bringing every engine up to date per arrival.

With floors (simulator.load_floors) an arrival brings up to date only the engine it routes to;
the reference (`load_floors=False`) applies every engine's ended steps before each decision, as
the policy's view would be read live. Every record must match, request by request, and the
floors must have spared most of the work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from policies.baselines import least_tokens
from router.cost_model import roofline
from simulator import driver
from simulator.config import SimConfig
from simulator.driver import SimCluster, SimResult
from simulator.engine import EngineConfig
from traces.generators import chat_sessions, shared_prefix
from traces.schema import Trace

COST = roofline("llama-3-8b", "a100-80g")


@pytest.fixture(autouse=True)
def floors_on_small_fleets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Floors on the small fleets below (by default only from LOAD_FLOORS_MIN_WORKERS)."""
    monkeypatch.setattr(driver, "LOAD_FLOORS_MIN_WORKERS", 1)


class Counted(SimCluster):
    """Counts the times an engine applied decode steps mid-run, on a read."""

    mid_run = 0

    def on_progress(self, engine, num_tokens: int, kv_used_blocks: int, next_step_end: float):
        self.mid_run += 1
        super().on_progress(engine, num_tokens, kv_used_blocks, next_step_end)


def run(kind: type[Counted], trace: Trace, config: SimConfig) -> tuple[SimResult, int]:
    """The records of a run, and how many times an engine applied steps mid-run on a read."""
    copy = Trace([dataclasses.replace(r) for r in trace.requests], trace.block_size)
    cluster = kind(copy, COST, config)
    return cluster.run(), cluster.mid_run


def many_short() -> Trace:
    return shared_prefix(
        num_requests=400, num_tenants=6, prefix_tokens=600, output_tokens=150, rate=60
    )


def long_prompts() -> Trace:
    """About 3,000 tokens a prompt: in chunks of 512, each run's first steps prefill."""
    return shared_prefix(
        num_requests=120, num_tenants=4, prefix_tokens=400, question_tokens=2500,
        output_tokens=60, rate=8,
    )  # fmt: skip


CASES = [
    ("least_load, 16 workers", many_short, {"num_workers": 16, "policy": "least_load"}, {}),
    (
        "prompts in chunks",
        long_prompts,
        {"num_workers": 6, "policy": "least_load"},
        {"max_num_batched_tokens": 512},
    ),
    ("vtc counts tokens in each engine", many_short, {"num_workers": 12, "policy": "vtc"}, {}),
    (
        "preemptions: small KV",
        many_short,
        {"num_workers": 6, "policy": "least_load"},
        {"num_kv_blocks": 160},
    ),
    (
        "router queues",
        many_short,
        {"num_workers": 8, "policy": "least_load", "placement": "router", "window": 3},
        {},
    ),
    (
        "a worker down and back",
        many_short,
        {"num_workers": 8, "policy": "least_load", "outages": ((2.0, 4.0, 3), (1.0, 5.5, 0))},
        {},
    ),
    (
        "closed-loop sessions",
        lambda: chat_sessions(num_sessions=40, mean_turns=4, think_time=2.0, rate=8.0, seed=3),
        {"num_workers": 10, "policy": "least_load", "closed_loop": True},
        {},
    ),
]


@pytest.mark.parametrize(
    ("trace", "sim", "engine"),
    [pytest.param(t, s, e, id=name) for name, t, s, e in CASES],
)
def test_floors_route_as_reading_every_engine(trace, sim, engine) -> None:
    workload = trace()
    config = SimConfig(engine=EngineConfig(check_invariants=True, **engine), **sim)
    floors, spared = run(Counted, workload, config)
    reference, synced = run(Counted, workload, dataclasses.replace(config, load_floors=False))
    assert len(floors.records) == len(reference.records) == len(workload)
    expected = {r.id: r for r in reference.records}
    for record in floors.records:
        assert record == expected[record.id], f"request {record.id}"
    assert [w.steps for w in floors.workers] == [w.steps for w in reference.workers]
    assert floors.summary["decisions"] == reference.summary["decisions"]
    assert spared < synced, "floors brought no fewer engines up to date"


def test_floors_are_used_only_where_they_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Floors route one router over one pool of mixed workers; anything else reads every
    engine with a step ended, as a fleet smaller than LOAD_FLOORS_MIN_WORKERS does."""
    workload = many_short()
    assert SimCluster(workload, COST, SimConfig(num_workers=4))._floors is not None
    off = SimCluster(workload, COST, SimConfig(num_workers=4, load_floors=False))
    assert off._floors is None and not off._lazy
    monkeypatch.setattr(driver, "LOAD_FLOORS_MIN_WORKERS", 5)
    small = SimCluster(workload, COST, SimConfig(num_workers=4))
    assert small._floors is None and not small._lazy
    for config in (
        SimConfig(num_workers=4, prefill_workers=2, decode_workers=2),
        SimConfig(num_workers=4, routers=2),
        SimConfig(num_workers=4, policy="round_robin"),
        SimConfig(num_workers=4, index="precise"),
    ):
        assert SimCluster(workload, COST, config)._floors is None, config


@pytest.mark.parametrize(
    ("level", "workload", "engine"),
    [
        pytest.param({}, many_short, {}, id="default level"),
        pytest.param(
            {"headroom": 0.0, "min_headroom": 0.0}, many_short, {}, id="level at the least key"
        ),
        pytest.param(
            {"lower_by": 1.0, "crowd": 0}, many_short, {}, id="level reset at every decision"
        ),
        pytest.param(
            {"headroom": 1e9, "min_headroom": 1e9}, many_short, {}, id="level above every worker"
        ),
        # Runs that begin with a prompt's chunks: those that sample only decoding sequences'
        # tokens count as decode steps.
        pytest.param({}, long_prompts, {"max_num_batched_tokens": 512}, id="prompts in chunks"),
    ],
)
def test_every_floor_is_below_the_load_it_bounds(
    level: dict[str, float], workload: Callable[[], Trace], engine: dict[str, int]
) -> None:
    """At every arrival, each routable worker's floor is at most its tokens in flight as they
    would be with every step ended applied (the floors may only ever read too many workers),
    and the worker found is the one whose exact key is least, wherever the level is."""
    checked = 0

    class Audited(Counted):
        def dispatch(self, req, rerouted: bool = False) -> None:
            nonlocal checked
            floors = self._floors
            assert floors is not None
            for name, value in level.items():
                setattr(floors, name, value)
            now = self.env.now
            self._sync(now)
            exact_keys = []
            for wid, state in self.view.workers.items():
                if state.healthy:
                    credit = self.engines[wid].decode_credit(now)
                    exact = state.tokens_in_flight - credit
                    assert floors.floor(wid, now) <= exact, (wid, now)
                    key = least_tokens(self.view, state)
                    exact_keys.append((key[0] - credit, *key[1:]))
                    checked += 1
            assert floors.least(now) == min(exact_keys)[-1], now
            super().dispatch(req, rerouted)

    config = SimConfig(
        num_workers=12,
        policy="least_load",
        outages=((1.0, 3.0, 5),),
        engine=EngineConfig(**engine),  # type: ignore[arg-type]
    )
    trace = workload()
    result, _ = run(Audited, trace, config)
    assert len(result.records) == len(trace) and checked > 10 * len(trace)
