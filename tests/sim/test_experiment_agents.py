"""`fairway experiment agents` in its smallest configuration, and agent sessions' client API
carried from the trace into a simulated run's records and back out of requests.csv."""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboards.report import load_run
from router.cli import build_parser
from router.cost_model import roofline
from router.records import RequestRecord
from simulator.bench import agents
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.results import write_results
from traces.generators import agent_sessions


@pytest.fixture(scope="module")
def sections() -> list[tuple[str, list[dict[str, object]]]]:
    return agents.run(seed=0, quick=True, jobs=2)


def by_policy(sections) -> dict[str, dict[str, object]]:
    (_, rows), _ = sections
    return {str(r["policy"]): r for r in rows}


def test_a_table_of_every_policy_then_the_verdict(sections) -> None:
    (title, rows), (verdict_title, verdicts) = sections
    fleet = agents.QUICK_FLEETS[0]
    assert title.startswith(f"{fleet.workers} {agents.GPU} workers")
    assert [r["policy"] for r in rows] == list(agents.POLICIES)
    for r in rows:
        assert 0 < r["hit %"] <= r["bound %"] + 1e-9  # nothing beats one unbounded cache
        assert r["first TTFT s"] > 0 and r["later TTFT s"] > 0
        assert r["first p90 s"] >= 0 and r["later p90 s"] >= 0
    assert verdict_title == "Verdict" and len(verdicts) == 1
    text = str(verdicts[0]["verdict"])
    assert text.startswith(f"{fleet.workers} workers: ") and "infinite-cache bound" in text


def test_locality_pays_on_later_turns(sections) -> None:
    """A later turn extends the previous one: sent where that ran, it re-reads only its new
    tokens. LPM must hit more than round robin, and its later turns must start sooner."""
    rows = by_policy(sections)
    lpm, rr = rows["lpm"], rows["round_robin"]
    assert lpm["hit %"] > rr["hit %"] + 10
    assert lpm["later TTFT s"] < rr["later TTFT s"]
    text = agents.verdict(agents.QUICK_FLEETS[0].workers, list(rows.values()))
    best = min(rows, key=lambda p: rows[p]["later TTFT s"])  # type: ignore[arg-type,return-value]
    assert text.split(": ")[1].startswith(best)  # the verdict's winner is the table's


def test_first_turn_is_a_sessions_earliest() -> None:
    def rec(i: int, session: str | None, arrival: float, ttft: float) -> RequestRecord:
        return RequestRecord(i, "a", session, 0, arrival, arrival, arrival + ttft, 9.0, 10, 0, 1, 0)

    records = [rec(0, "s1", 5.0, 0.3), rec(1, "s1", 1.0, 0.1), rec(2, None, 2.0, 0.2)]
    first, later = agents.turn_ttfts(records)
    assert sorted(first) == pytest.approx([0.1, 0.2]) and later == pytest.approx([0.3])


def test_records_carry_the_trace_api_into_requests_csv(tmp_path: Path) -> None:
    trace = agent_sessions(num_sessions=6, mean_turns=3)
    apis = {r.id: r.api for r in trace.requests}
    config = SimConfig(num_workers=2, policy="lpm", closed_loop=True)
    result = simulate(trace, roofline("llama-3-8b", "h100"), config)
    assert len(result.records) == len(apis)
    assert all(rec.api == apis[rec.id] for rec in result.records)
    write_results(tmp_path, result.summary, result.records)
    again = {r.id: r.api for r in load_run(tmp_path).records}
    assert again == apis and set(again.values()) <= {"responses", "messages"}


def test_the_command_runs(capsys) -> None:
    args = build_parser().parse_args(["experiment", "agents", "--quick"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "later TTFT s" in out and "## agents: Verdict" in out
