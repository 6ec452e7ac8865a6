"""`fairway plan`'s search on stub evaluators (a function from worker count to attainment),
its bad-input checks, and the attainment it counts."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from router.cli import build_parser, main
from router.records import Refusal, RequestRecord
from simulator.plan import (
    Fleet,
    Goal,
    Outcome,
    all_splits,
    goal_goodput,
    search_mixed,
    search_split,
    smallest_meeting,
    splits,
)

GOAL = Goal(ttft=2.0, tpot=0.1, attainment=0.99)


def stub(attainment: Callable[[int], float], goal: float = 0.99):
    """`meets` over counts, recording every count asked and each batch's size."""
    asked: list[int] = []
    batches: list[int] = []

    def meets(counts: list[int]) -> dict[int, bool]:
        asked.extend(counts)
        batches.append(len(counts))
        return {n: attainment(n) >= goal for n in counts}

    return meets, asked, batches


def rising(needed: int) -> Callable[[int], float]:
    """Attainment that grows with the count and reaches 1 at `needed`."""
    return lambda n: min(1.0, n / needed)


@pytest.mark.parametrize("needed", [1, 2, 3, 7, 8, 9, 33, 64])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_the_smallest_count_meeting_the_goal_is_found(needed: int, batch: int) -> None:
    meets, asked, batches = stub(rising(needed))
    search = smallest_meeting(meets, 1, 64, batch)
    assert search.answer == needed
    assert search.meets[needed] and (needed == 1 or not search.meets[needed - 1])
    assert not search.violations
    assert len(asked) == len(set(asked)), "each count is simulated once"
    assert max(batches) <= batch


def test_doubling_then_bisection_asks_few_counts() -> None:
    meets, asked, _ = stub(rising(37))
    assert smallest_meeting(meets, 1, 64, 1).answer == 37
    assert asked[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert len(asked) <= 7 + 6  # log2(64) more at most


def test_an_impossible_goal_has_no_answer_and_simulates_the_limit() -> None:
    meets, asked, _ = stub(lambda n: 0.5 + n / 1000)
    search = smallest_meeting(meets, 1, 50, 2)
    assert search.answer is None
    assert 50 in asked and set(search.meets.values()) == {False}


def test_a_non_monotone_evaluator_is_caught() -> None:
    """Meets at 5, misses at 6, meets from 7: bisecting (4 fails, 8 meets) three at a time
    asks 5, 6 and 7 at once; the answer is 5 (4 fails), and 6 failing is reported."""
    meets, _, _ = stub(lambda n: 1.0 if n == 5 or n >= 7 else 0.5)
    search = smallest_meeting(meets, 1, 8, 3)
    assert search.answer == 5 and not search.meets[4]
    assert search.violations == [(5, 6)]


def test_a_larger_count_missing_in_the_doubling_is_caught() -> None:
    """Doubling two at a time asks 4 and 8 together: 4 meets, 8 misses."""
    meets, _, _ = stub(lambda n: 1.0 if n == 4 or n >= 10 else 0.5)
    search = smallest_meeting(meets, 1, 64, 2)
    assert search.answer == 4 and not search.meets[3]
    assert search.violations == [(4, 8)]


def test_the_limit_must_reach_the_first_count() -> None:
    meets, _, _ = stub(rising(1))
    with pytest.raises(ValueError, match="max_workers"):
        smallest_meeting(meets, 2, 1)


def test_splits_cover_every_split_up_to_eight_then_the_eighths() -> None:
    for total in range(2, 9):
        assert splits(total) == all_splits(total)
    assert [f.prefill for f in splits(64)] == [8, 16, 24, 32, 40, 48, 56]
    assert all(f.prefill + f.decode == 20 and f.prefill >= 1 for f in splits(20))


def stub_evaluate(attainment: Callable[[Fleet], float]):
    """An evaluator of fleets (as simulator.plan.Evaluator) from a formula, and what it ran."""
    ran: list[Fleet] = []

    def evaluate(policy: str, fleets: Iterable[Fleet]) -> list[Outcome]:
        fleets = list(fleets)
        ran.extend(fleets)
        return [Outcome(policy, f, attainment(f), 0.0, 0.0) for f in fleets]

    return evaluate, ran


def test_a_mixed_search_answers_its_fleet() -> None:
    evaluate, _ = stub_evaluate(lambda f: min(1.0, f.workers / 5))
    answer = search_mixed(evaluate, "lpm", GOAL, 16, 2)
    assert answer.outcome is not None and answer.outcome.fleet == Fleet(5)
    meets = answer.search.meets
    assert not answer.split and meets == {1: False, 2: False, 4: False, 5: True, 7: True, 8: True}


def test_a_split_search_finds_the_smallest_total_checking_every_split_below() -> None:
    """Prefill-bound: the goal needs 3 prefill and 2 decode workers."""
    evaluate, ran = stub_evaluate(lambda f: 1.0 if f.prefill >= 3 and f.decode >= 2 else 0.9)
    answer = search_split(evaluate, "lpm", GOAL, 32, 2)
    assert answer.split and answer.outcome is not None
    assert answer.outcome.fleet == Fleet(5, 3, 2)
    assert set(all_splits(4)) <= set(ran), "every split of one worker fewer was simulated"
    assert not answer.search.violations


def test_a_split_search_goes_below_where_the_eighths_missed() -> None:
    """Only 1:12 meets at 13 workers (decode-bound); the eighths of 16 find 2:14, then every
    split of 15, 14, 13 and 12 is tried, and 13 is the answer."""
    evaluate, ran = stub_evaluate(lambda f: 1.0 if f.decode >= 12 else 0.0)
    answer = search_split(evaluate, "lpm", GOAL, 64, 1)
    assert answer.outcome is not None and answer.outcome.fleet == Fleet(13, 1, 12)
    assert set(all_splits(12)) <= set(ran) and answer.search.meets[12] is False


def record(i: int, ttft: float, tpot: float | None, priority: int = 0) -> RequestRecord:
    output = 1 if tpot is None else 11
    finish = ttft + (tpot or 0) * (output - 1)
    return RequestRecord(id=i, client="a", session=None, worker=0, arrival=0.0, admitted=0.0,
                         first_token=ttft, finish=finish, prompt_tokens=10, cached_tokens=0,
                         output_tokens=output, preemptions=0, priority=priority)  # fmt: skip


def test_attainment_is_the_class_definition_with_refusals_missing() -> None:
    records = [
        record(0, 1.0, 0.05),  # meets both
        record(1, 3.0, 0.05),  # TTFT misses
        record(2, 1.0, 0.2, priority=1),  # TPOT misses, in another band
        record(3, 1.9, None),  # one token: no TPOT to meet
    ]
    refused = [Refusal(4, "a", 0, "queue_time", 1.0)]
    goodput = goal_goodput(records, refused, GOAL)
    assert goodput["attainment"] == pytest.approx(2 / 5)


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--attainment", "0"], "--attainment"),
        (["--attainment", "1.5"], "--attainment"),
        (["--ttft", "0"], "--ttft"),
        (["--tpot", "-0.1"], "--tpot"),
        (["--max-workers", "0"], "--max-workers"),
        (["--policies", "lpm,fastest"], "--policies"),
        (["--policy", "fastest"], "--policy"),
        (["--ttft", "soon"], "--ttft"),
        (["--jobs", "0"], "--jobs"),
    ],
)
def test_bad_input_is_refused_naming_the_field(flags: list[str], field: str, capsys) -> None:
    argv = ["plan", "--trace", "gen:shared_prefix", "--ttft", "2", "--tpot", "0.1", *flags]
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(argv)
    assert stopped.value.code == 2
    assert f"argument {field}: " in capsys.readouterr().err


def test_a_ttft_below_a_lone_prefill_is_refused_before_anything_runs(capsys) -> None:
    argv = ["plan", "--trace", "gen:shared_prefix", "--gen", "num_requests=4", "--gpu", "h100",
            "--ttft", "0.001", "--tpot", "0.1", "--jobs", "1"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "ttft: 0.001 s is below the " in err and "a lone request's prefill takes on h100" in err


def test_a_tpot_below_a_lone_decode_step_is_refused(capsys) -> None:
    argv = ["plan", "--trace", "gen:shared_prefix", "--gen", "num_requests=4",
            "--ttft", "10", "--tpot", "0.00001", "--jobs", "1"]  # fmt: skip
    assert main(argv) == 2
    assert "tpot: 1e-05 s is below the " in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--workers=4", "--prefill-workers=1", "--decode-workers=2"])
def test_a_fixed_fleet_is_refused_since_plan_chooses_it(flag: str, capsys) -> None:
    argv = ["plan", "--trace", "gen:shared_prefix", "--ttft", "2", "--tpot", "0.1", flag]
    assert main(argv) == 2
    assert f"{flag.split('=')[0]}: plan searches the fleet" in capsys.readouterr().err
