"""`fairway demo`: both workloads on small sizes, their tables, verdicts and reports."""

from __future__ import annotations

import contextlib
import io
import pickle
import re
from pathlib import Path

import pytest

from simulator.bench.demo import (
    Comparison,
    demo,
    mooncake_sample,
    shared_documents,
    verdict,
)

LOCALITY = ("lpm", "preble", "dlpm", "d2lpm")
# Six of the policies (the reports take most of the time): baselines, locality and fairness.
POLICIES = ["least_load", "round_robin", "lpm", "preble", "vtc", "dlpm"]
# The demo's documents shrunk to a second or two: 6 tenants x 8 documents of ~3k tokens, 400
# questions at 25 req/s on 2 workers, enough to load them when every request re-reads its
# document.
SMALL_DOCUMENTS = {"num_requests": 400, "num_tenants": 6, "prefixes_per_tenant": 8, "rate": 25}


def _named(policy: str, text: str) -> bool:
    """`policy` appears in `text` as a word (lpm is not named by dlpm)."""
    return re.search(rf"(?<![\w-]){re.escape(policy)}(?![\w-])", text) is not None


def _parts(sentence: str) -> tuple[str, str]:
    """A verdict's TTFT winners and its fairness clause."""
    head, fairness = sentence.split("; ", 1)
    return head.split(" TTFT (")[0], fairness.split(" tenants fairest")[0]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[list[Comparison], str, Path]:
    out = tmp_path_factory.mktemp("demo")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        done = demo(
            workers=2,
            out=out,
            workloads=[mooncake_sample(requests=200), shared_documents(**SMALL_DOCUMENTS)],
            policy_names=POLICIES,
        )
    return done, printed.getvalue(), out


def test_the_verdict_names_the_table_s_best_ttft_and_fairest(small) -> None:
    done, printed, _ = small
    assert [c.workload.key for c in done] == ["mooncake", "documents"]
    assert all(sorted(c.summaries) == sorted(POLICIES) for c in done)
    for c in done:
        fastest = min(c.rows, key=lambda r: r["TTFT mean s"])["policy"]
        fairest = min(c.rows, key=lambda r: r["gap M tok"])["policy"]
        winners, fair = _parts(c.verdict)
        assert winners.startswith(f"{c.workload.title}: ")
        assert _named(str(fastest), winners), c.verdict
        assert _named(str(fairest), fair), c.verdict
        # Each policy that the sentence names as a winner is within 5 % of the table's best.
        best = min(r["TTFT mean s"] for r in c.rows)
        for row in c.rows:
            if _named(str(row["policy"]), winners):
                assert row["TTFT mean s"] <= 1.05 * best
        assert " ".join(c.verdict.split()) in " ".join(printed.split())
        assert c.rows == sorted(c.rows, key=lambda r: r["TTFT mean s"])  # best first


def test_locality_beats_least_load_on_hit_rate_with_shared_documents(small) -> None:
    documents = small[0][1]
    hit = {r["policy"]: r["hit %"] for r in documents.rows}
    assert max(hit[p] for p in LOCALITY if p in hit) > hit["least_load"] + 5, hit
    bound = 100 * documents.summaries["lpm"]["prefix_cache"]["bound"]
    assert bound > 60 and "reuse is high" in documents.verdict


def test_each_workload_has_its_runs_and_report(small) -> None:
    done, printed, out = small
    for c in done:
        assert c.report == out / c.workload.key / "report.html" and c.report.exists()
        for name in c.summaries:
            assert (out / c.workload.key / name / "summary.json").exists()
        assert str(c.report.resolve()) in printed
    assert "the busiest tenant sends" in printed


def _summary(ttft: float, hit: float, gap: float, bound: float) -> dict:
    return {
        "ttft": {"mean": ttft},
        "prefix_cache": {"hit_rate": hit, "bound": bound},
        "fairness": {"max_service_gap": gap},
    }


def test_the_verdict_follows_the_figures() -> None:
    """The same policies, two sets of figures: the sentence's reasons change with them."""
    low = {
        "least_load": _summary(2.0, 0.05, 1e5, 0.2),
        "lpm": _summary(9.0, 0.15, 3e6, 0.2),
        "vtc": _summary(2.05, 0.05, 2e5, 0.2),
    }
    text = verdict("Chat", low)
    assert text.startswith("Chat: least_load and vtc win TTFT (2 and 2.05 s mean)")
    assert "reuse is low (20 %" in text and "spreading load matters more than locality" in text
    assert "least_load also keeps tenants fairest" in text

    high = {
        "least_load": _summary(20.0, 0.6, 8e6, 0.9),
        "lpm": _summary(0.5, 0.88, 2e6, 0.9),
        "vtc": _summary(30.0, 0.6, 1e6, 0.9),
    }
    text = verdict("Documents", high)
    assert text.startswith("Documents: lpm wins TTFT (0.5 s mean): reuse is high (90 %")
    assert "lpm hit 88 % against least_load's 60 %" in text
    assert "vtc keeps tenants fairest" in text and "but at 30 s mean TTFT" in text
    assert "of the policies within 2x the best TTFT, lpm is fairest (2M)" in text

    same = {p: _summary(t, 0.97, 1e6, 0.98) for p, t in (("least_load", 1.0), ("lpm", 3.0))}
    assert "every policy hit about as much" in verdict("Flood", same)


@pytest.mark.slow  # the whole demo, about 40 s
def test_the_full_demo_tells_its_story(tmp_path) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        mooncake, documents = demo(out=tmp_path)
    winners, _ = _parts(mooncake.verdict)
    assert _named("least_load", winners) and not any(_named(p, winners) for p in LOCALITY)
    assert "spreading load matters more than locality" in mooncake.verdict
    winners, _ = _parts(documents.verdict)
    assert any(_named(p, winners) for p in LOCALITY) and not _named("least_load", winners)
    assert "matters more than spreading load" in documents.verdict


def test_the_workloads_cross_to_a_process_whatever_its_start_method() -> None:
    """The demo runs each policy in a pool process; a spawned one (macOS, Python 3.14's
    forkserver) gets its workload pickled, builder and all."""
    for workload in (mooncake_sample(requests=50), shared_documents(**SMALL_DOCUMENTS)):
        copy = pickle.loads(pickle.dumps(workload))
        assert copy.about == workload.about
        assert copy.build().requests == workload.build().requests
