"""Decode cohorts against the step-by-step engine: the same records, request by request.

A fast-forward engine advances a run's decoding sequences as one cohort (a shared step counter,
blocks counted in bulk) and applies steps in sum mid-run; the step-by-step engine
(`fast_forward=False`) schedules and applies every step for every sequence, vLLM's loop as it
is. Each workload below runs through both, with block accounting checked after every change,
and every request's record must match: any step the cohort path applies differently shows up
as a timestamp, a cached-token count or a preemption count that differs.
"""

from __future__ import annotations

import dataclasses

import pytest

from router.classes import TrafficClass
from router.cost_model import roofline
from simulator.config import SimConfig
from simulator.driver import SimResult, simulate
from simulator.engine import EngineConfig
from traces.generators import chat_sessions, priority_mix, shared_prefix
from traces.schema import Trace

COST = roofline("llama-3-8b", "a100-80g")


def both(trace: Trace, sim: dict[str, object], **engine: object) -> tuple[SimResult, SimResult]:
    """The workload through the cohort engine, then through the step-by-step one."""
    out = []
    for fast_forward in (True, False):
        copy = Trace([dataclasses.replace(r) for r in trace.requests], trace.block_size)
        cfg = EngineConfig(fast_forward=fast_forward, check_invariants=True, **engine)  # type: ignore[arg-type]
        out.append(simulate(copy, COST, SimConfig(engine=cfg, **sim)))  # type: ignore[arg-type]
    return out[0], out[1]


def assert_same_records(
    cohorts: SimResult, by_step: SimResult, *, exact_predictions: bool = True
) -> None:
    assert len(cohorts.records) == len(by_step.records), "requests served"
    slow = {r.id: r for r in by_step.records}
    for record in cohorts.records:
        expected = slow[record.id]
        if not exact_predictions:
            expected = dataclasses.replace(expected, predicted_ttft=record.predicted_ttft)
        assert record == expected, f"request {record.id}"
    assert [w.steps for w in cohorts.workers] == [w.steps for w in by_step.workers], "steps"
    assert sum(w.events for w in cohorts.workers) < sum(w.events for w in by_step.workers)


def chat() -> Trace:
    return shared_prefix(
        num_requests=160, num_tenants=4, prefix_tokens=800, output_tokens=120, rate=25
    )


def long_prompts() -> Trace:
    """Prompts of about 3,000 tokens, in chunks of a 512-token budget: a prompt's chunks lead
    the run that decodes it when nothing waits, and arrivals cut such runs between chunks."""
    return shared_prefix(
        num_requests=80, num_tenants=4, prefix_tokens=400, question_tokens=2500,
        output_tokens=60, rate=3,
    )  # fmt: skip


CHUNKS = {"max_num_batched_tokens": 512}

# (what it covers, the trace, SimConfig fields, EngineConfig fields[, predictions exact])
WORKLOADS = [
    # least_load reads every engine's load at each arrival: steps applied in sum mid-run.
    ("least_load", chat, {"num_workers": 3, "policy": "least_load"}, {}),
    # Engines synced only at run ends: whole runs applied in one pass.
    ("round_robin", chat, {"num_workers": 3, "policy": "round_robin"}, {}),
    ("lpm", chat, {"num_workers": 3, "policy": "lpm"}, {}),
    # A local discipline that counts tokens: arrivals catch the cohort up mid-run.
    ("vtc", chat, {"num_workers": 2, "policy": "vtc"}, {}),
    ("dlpm", chat, {"num_workers": 2, "policy": "dlpm"}, {}),
    ("d2lpm", chat, {"num_workers": 3, "policy": "d2lpm"}, {}),
    # Precise index: KV events at their own times, so no steps in sum.
    ("kv events", chat, {"num_workers": 2, "policy": "lpm", "index": "precise"}, {}),
    (
        "split fleet",
        chat,
        {"num_workers": 4, "prefill_workers": 2, "decode_workers": 2, "policy": "least_load"},
        {},
    ),
    (
        "adapters",
        lambda: shared_prefix(
            num_requests=120, num_tenants=5, prefix_tokens=600, output_tokens=80, adapters=True
        ),
        {"num_workers": 2, "policy": "least_load"},
        {"adapter_slots": 2, "adapter_load_time": 0.05},
    ),
    (
        "traffic classes, priority preemption",
        lambda: priority_mix(duration=20.0, interactive_rate=4.0, batch_rate=6.0),
        {
            "num_workers": 2,
            "policy": "least_load",
            "classes": (TrafficClass("interactive", 0), TrafficClass("batch", 1)),
        },
        {"num_kv_blocks": 900},
        # The router's TTFT prediction for a class reads the fleet mid-run, where steps applied
        # in sum and step by step differ in what it sees (before cohorts too): only what the
        # engines did must match here.
        False,
    ),
    (
        "preemption heavy",
        lambda: shared_prefix(
            num_requests=150, num_tenants=6, prefix_tokens=1200, output_tokens=300, rate=40
        ),
        {"num_workers": 2, "policy": "least_load"},
        {"num_kv_blocks": 500},
    ),
    (
        "chunked prefill, small budget",
        chat,
        {"num_workers": 2, "policy": "least_load"},
        {"max_num_batched_tokens": 256, "max_num_seqs": 8},
    ),
    ("chunks, least_load", long_prompts, {"num_workers": 2, "policy": "least_load"}, CHUNKS),
    ("chunks, round_robin", long_prompts, {"num_workers": 2, "policy": "round_robin"}, CHUNKS),
    ("chunks, vtc", long_prompts, {"num_workers": 2, "policy": "vtc"}, CHUNKS),
    (
        "chunks, KV events",
        long_prompts,
        {"num_workers": 2, "policy": "lpm", "index": "precise"},
        CHUNKS,
    ),
    (
        "chunks, preemption",
        long_prompts,
        {"num_workers": 2, "policy": "least_load"},
        {**CHUNKS, "num_kv_blocks": 700},
    ),
    (
        "closed loop",
        lambda: chat_sessions(num_sessions=25, rate=2.0, think_time=1.0),
        {"num_workers": 2, "policy": "least_load", "closed_loop": True},
        {},
    ),
]


@pytest.mark.parametrize(
    ("make_trace", "sim", "engine", "exact_predictions"),
    [pytest.param(*w[1:4], w[4] if len(w) > 4 else True, id=w[0]) for w in WORKLOADS],
)
def test_cohort_records_equal_step_by_step(make_trace, sim, engine, exact_predictions) -> None:
    cohorts, by_step = both(make_trace(), sim, **engine)
    assert_same_records(cohorts, by_step, exact_predictions=exact_predictions)


def test_the_preemption_workload_preempts() -> None:
    """The preemption workloads above are only worth their name if sequences get preempted."""
    for name, make_trace, sim, engine, *_ in WORKLOADS:
        if "preemption" in name:
            cfg = EngineConfig(**engine)
            result = simulate(make_trace(), COST, SimConfig(engine=cfg, **sim))
            assert sum(r.preemptions for r in result.records) > 0, name
