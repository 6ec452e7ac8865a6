"""What a decision sees of the engines: every run ended by its instant, whether the simulator
brings engines up to date lazily (a policy that reads no decode progress) or at every step."""

from __future__ import annotations

import random

import pytest

import policies
from router.cost_model import FittedCost
from router.policy import GlobalPolicy
from router.request import Request
from simulator.config import SimConfig
from simulator.driver import simulate
from traces.schema import Trace

# Step times in whole 4,096ths of a second and arrivals on 32nds: many runs end at the very
# instant a request arrives, some by a call made before the arrival's, some after.
EXACT = FittedCost(
    {"overhead": 2**-5, "per_token": 2**-12, "per_decode_seq": 2**-8, "per_pair": 0.0,
     "per_kv_token": 0.0, "request_overhead": 0.0},
    100_000,
    "exact",
)  # fmt: skip


def tied_trace(seed: int) -> Trace:
    rng = random.Random(seed)
    requests, at = [], 0.0
    for i in range(400):
        at += rng.choice((0, 1, 1, 2, 3)) / 32
        requests.append(Request(i, at, rng.choice((32, 64, 96, 128)), rng.randint(1, 6)))
    return Trace(requests, 16)


def replay(policy: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """The records, and what each decision saw of each worker's requests: the runs ended
    by then (finishes and admissions), not decode progress, which only eager syncing shows."""
    cls = policies.global_policies.get(policy)
    route, seen = cls.route, []

    def looking(self, request, view):  # type: ignore[no-untyped-def]
        seen.append([(w.id, w.num_waiting, w.num_running) for w in view.workers.values()])
        return route(self, request, view)

    with monkeypatch.context() as patch:
        patch.setattr(cls, "route", looking)
        records = simulate(tied_trace(seed), EXACT, SimConfig(num_workers=4, policy=policy)).records
    return sorted((r.id, r.worker, r.first_token, r.finish) for r in records), seen


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy", ["round_robin", "random"])
def test_runs_ending_at_an_arrival_are_seen_lazily_as_at_every_step(
    policy: str, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    lazily = replay(policy, seed, monkeypatch)
    # A policy that does not say what it reads has every engine brought up to date.
    monkeypatch.setattr(policies.global_policies.get(policy), "progress_read",
                        GlobalPolicy.progress_read)  # fmt: skip
    assert lazily == replay(policy, seed, monkeypatch)
