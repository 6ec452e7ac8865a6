"""`fairway experiment pd` in its smallest configuration: its tables' shape, the goodput it
reports against the records, and the split runs' transfers."""

from __future__ import annotations

import pytest

from router.cli import build_parser
from router.records import RequestRecord
from simulator.bench import pd


@pytest.fixture(scope="module")
def sections() -> list[tuple[str, list[dict[str, object]]]]:
    return pd.run(seed=0, quick=True, jobs=2)


def test_one_table_per_trace_then_the_best_fleets_then_locality(sections) -> None:
    (title, rows), (best_title, best), (local_title, local) = sections
    assert title.startswith(pd.QUICK_WORKLOADS[0].name)
    assert [r["fleet"] for r in rows] == ["mixed", "4:4", "6:2"]
    for name in pd.SLOS:
        assert all(r[f"{name} /s/GPU"] > 0 for r in rows)
    assert rows[0]["KV mean ms"] is None  # a mixed fleet moves no KV
    assert all(r["KV mean ms"] > 0 and r["KV p99 ms"] >= r["KV mean ms"] / 10 for r in rows[1:])
    assert best_title.startswith("The best fleet") and len(best) == 1
    assert {best[0][f"{name}: best"] for name in pd.SLOS} <= {"mixed", "4:4", "6:2"}
    assert {(r["fleet"], r["policy"]) for r in local} == {
        (fleet, policy) for fleet in ("mixed", "4:4") for policy in ("lpm", "least_load")
    }
    assert local_title.startswith("Locality")


def test_goodput_counts_requests_meeting_both_targets_per_second_per_gpu() -> None:
    def rec(i: int, first: float, finish: float, out: int) -> RequestRecord:
        return RequestRecord(i, "a", None, 0, 0.0, 0.0, first, finish, 100, 0, out, 0)

    records = [
        rec(0, 1.0, 2.0, 11),  # TTFT 1 s, TPOT 0.1 s: meets both
        rec(1, 3.0, 4.0, 11),  # TTFT 3 s: misses
        rec(2, 1.0, 8.0, 11),  # TPOT 0.7 s: misses
        rec(3, 0.5, 0.5, 1),  # one token: no TPOT to miss
    ]
    assert pd.goodput_per_gpu(records, ttft=2.0, tpot=0.2) == pytest.approx(2 / 8.0 / pd.GPUS)


def test_the_command_runs(capsys) -> None:
    args = build_parser().parse_args(["experiment", "pd", "--quick"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "best split / mixed" in out and "Locality" in out
