"""`fairway plan`: the smallest fleet that serves a trace within latency targets, found by
simulating candidate fleets.

A fleet meets the goal when at least `attainment` of the trace's requests finish within both
targets, counted as simulator.results counts a traffic class's attainment (refused requests
miss). More workers rarely hurt attainment, so the search grows the worker count exponentially
until a fleet meets the goal, then bisects between the largest count below that fails and the
smallest that meets. It checks rather than trusts that: the answer n meets the goal and n - 1
does not, both simulated, and every pair of simulated counts where the larger misses but the
smaller meets is reported as a violation.

A split fleet's total is searched the same way; a total meets when one of its prefill:decode
splits does (every split up to 8 workers, then the eighths of the total). Below the answer
every split is simulated, so no split of n - 1 workers meets the goal either.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field, replace

from router.classes import ClassTable, TrafficClass
from router.cost_model import CostModel
from router.records import Refusal, RequestRecord
from router.runtime.ray_tasks import RayTasks
from simulator.columns import RecordColumns, columns
from simulator.config import SimConfig
from simulator.driver import SimCluster
from simulator.progress import map_runs
from simulator.results import class_summary, fleet_goodput
from traces.schema import Trace


@dataclass(frozen=True, slots=True)
class Goal:
    """Targets in seconds every request is held to, and the share that must meet both."""

    ttft: float
    tpot: float
    attainment: float

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment: must be in (0, 1], got {self.attainment}")
        for name in ("ttft", "tpot"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True, order=True)
class Fleet:
    """`workers` in all, of which `prefill` only prefill and `decode` only decode."""

    workers: int
    prefill: int = 0
    decode: int = 0

    @property
    def split(self) -> bool:
        return self.prefill > 0

    def __str__(self) -> str:
        return f"{self.prefill} prefill + {self.decode} decode" if self.split else "mixed"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One simulated candidate: the share of requests within the targets, such requests per
    second of the run per GPU, and the GPU-hours the fleet holds over the trace's span."""

    policy: str
    fleet: Fleet
    attainment: float
    goodput_per_gpu: float
    gpu_hours: float


@dataclass
class Search:
    """What a search over counts found: `answer` (None: nothing up to the limit met the goal),
    whether each simulated count met it, and the (smaller, larger) simulated counts where the
    smaller met the goal and the larger did not."""

    answer: int | None
    meets: dict[int, bool]
    violations: list[tuple[int, int]] = field(default_factory=list)


def goal_goodput(
    records: Sequence[RequestRecord] | RecordColumns, refusals: Sequence[Refusal], goal: Goal
) -> dict[str, object]:
    """simulator.results' fleet-wide attainment and goodput with the goal's targets on every
    priority: the share of requests (refused ones included) within both targets, and such
    requests per second of the run (first arrival to last answer)."""
    cols = columns(records)
    priorities = set(cols.priority.tolist()) | {x.priority for x in refusals}
    table = ClassTable(
        TrafficClass(f"priority {p}", p, ttft=goal.ttft, tpot=goal.tpot) for p in priorities
    )
    span = float(cols.finish.max() - cols.arrival.min()) if len(cols) else 0.0
    return fleet_goodput(class_summary(cols, refusals, table), span)


def smallest_meeting(
    meets: Callable[[list[int]], dict[int, bool]], low: int, high: int, batch: int = 1
) -> Search:
    """The smallest count in [low, high] for which `meets` holds, `meets` asked `batch` counts
    at a time (they may run side by side): low, 2 low, 4 low, ... and high, then a bisection
    (into batch + 1 parts) between the largest failing count and the smallest meeting one."""
    if not 1 <= low <= high:
        raise ValueError(f"max_workers: must be at least {low}, got {high}")
    seen: dict[int, bool] = {}

    def ask(counts: Iterable[int]) -> None:
        todo = sorted(set(counts) - set(seen))
        for start in range(0, len(todo), batch):
            seen.update(meets(todo[start : start + batch]))

    doubling = [low]
    while doubling[-1] * 2 < high:
        doubling.append(doubling[-1] * 2)
    doubling.append(high)
    for start in range(0, len(doubling), batch):
        ask(doubling[start : start + batch])
        if any(seen.values()):
            break
    while True:
        met = [n for n, ok in seen.items() if ok]
        if not met:
            return Search(None, dict(sorted(seen.items())), _violations(seen))
        hi = min(met)
        lo = max((n for n in seen if n < hi), default=low - 1)
        if hi - lo <= 1:
            break
        parts = min(batch, hi - lo - 1) + 1
        ask(lo + round((hi - lo) * k / parts) for k in range(1, parts))  # all inside (lo, hi)
    return Search(hi, dict(sorted(seen.items())), _violations(seen))


def _violations(seen: dict[int, bool]) -> list[tuple[int, int]]:
    counts = sorted(seen)
    return [(a, b) for i, a in enumerate(counts) if seen[a] for b in counts[i + 1 :] if not seen[b]]


def splits(total: int) -> list[Fleet]:
    """The prefill:decode splits of `total` workers a split search tries: all of them up to
    8, then the eighths of the total."""
    prefill = {min(max(round(total * k / 8), 1), total - 1) for k in range(1, 8)}
    return [Fleet(total, p, total - p) for p in sorted(prefill)]


def all_splits(total: int) -> list[Fleet]:
    return [Fleet(total, p, total - p) for p in range(1, total)]


@dataclass(frozen=True)
class Candidates:
    """What every candidate fleet shares: the trace, the cost model, the simulator's settings
    (their worker counts and policy replaced per candidate) and the goal."""

    trace: Trace
    cost: CostModel
    base: SimConfig
    goal: Goal
    gpus_per_worker: int = 1

    def run(self, policy: str, fleet: Fleet) -> Outcome:
        return self.run_counted(policy, fleet)[0]

    def run_counted(self, policy: str, fleet: Fleet) -> tuple[Outcome, tuple[int, float]]:
        """The candidate's outcome, and the requests and simulated seconds behind it (what a
        progress bar counts)."""
        config = replace(
            self.base,
            num_workers=fleet.workers,
            prefill_workers=fleet.prefill,
            decode_workers=fleet.decode,
            policy=policy,
            show_progress=False,
        )
        cluster = SimCluster(self.trace, self.cost, config)
        result = cluster.run()
        goodput = goal_goodput(result.columns, cluster.refusals, self.goal)
        # The next candidate runs in this process: what is left of this one's fleet (its
        # router's index, its engines), in cycles, goes now, not carried on frozen.
        cluster.release()
        del cluster
        gc.collect()
        gpus = fleet.workers * self.gpus_per_worker
        arrivals = self.trace.column("arrival")
        outcome = Outcome(
            policy=policy,
            fleet=fleet,
            attainment=float(goodput["attainment"] or 0.0),  # type: ignore[arg-type]
            goodput_per_gpu=float(goodput["requests_per_s"] or 0.0) / gpus,  # type: ignore[arg-type]
            gpu_hours=gpus * (max(arrivals) - min(arrivals)) / 3600 if arrivals else 0.0,
        )
        return outcome, (len(self.trace), float(result.summary["simulated_seconds"]))  # type: ignore[arg-type]


_shared: Candidates | None = None  # a pool process's copy, sent once when it starts


def _start(candidates: Candidates) -> None:
    global _shared
    _shared = candidates


def _run(
    candidates: Candidates | None, policy: str, fleet: Fleet
) -> tuple[Outcome, tuple[int, float]]:
    """One candidate, in a pool process (`candidates` None: the copy `_start` left there) or
    a Ray task (the candidates put in the cluster once)."""
    if candidates is None:
        assert _shared is not None, "a pool process runs candidates only after _start"
        candidates = _shared
    return candidates.run_counted(policy, fleet)


def _counts(done: tuple[Outcome, tuple[int, float]]) -> tuple[int, float]:
    return done[1]


class Evaluator:
    """Simulates candidates, `jobs` side by side (as `fairway compare` runs its policies), each
    candidate once; `outcomes` keeps every one in the order simulated. They run in local
    processes, or as tasks on a Ray cluster (`ray`)."""

    def __init__(self, candidates: Candidates, jobs: int, ray: RayTasks | None = None) -> None:
        self.candidates = candidates
        self.jobs = max(1, jobs)
        self.outcomes: dict[tuple[str, Fleet], Outcome] = {}
        self._pool: Executor | None = None
        self._shared: object = None  # what each run is passed to find the candidates
        if ray is not None:
            self._pool, self._shared = ray, ray.put(candidates)
        elif self.jobs > 1:
            self._pool = ProcessPoolExecutor(self.jobs, initializer=_start, initargs=(candidates,))

    def __call__(self, policy: str, fleets: Iterable[Fleet]) -> list[Outcome]:
        fleets = list(dict.fromkeys(fleets))
        todo = [f for f in fleets if (policy, f) not in self.outcomes]
        if self._pool is None:
            done = [self.candidates.run(policy, f) for f in todo]
        else:
            # The command's progress bar, if any, moves as each candidate returns.
            n = len(todo)
            counted = map_runs(
                self._pool, _run, [self._shared] * n, [policy] * n, todo, counts=_counts
            )
            done = [outcome for outcome, _ in counted]
        for outcome in done:
            self.outcomes[(policy, outcome.fleet)] = outcome
        return [self.outcomes[(policy, f)] for f in fleets]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# Outcomes of a policy's candidate fleets, in the order asked (an Evaluator, or a stub).
Evaluate = Callable[[str, Iterable[Fleet]], list[Outcome]]


@dataclass
class Answer:
    """One policy's search, of mixed fleets or of split ones: its fleet (None: none up to the
    limit met the goal) and the search behind it."""

    policy: str
    split: bool
    search: Search
    outcome: Outcome | None


def search_mixed(
    evaluate: Evaluate, policy: str, goal: Goal, max_workers: int, batch: int
) -> Answer:
    """The fewest mixed workers, `batch` counts simulated at a time."""

    def meets(counts: list[int]) -> dict[int, bool]:
        outcomes = evaluate(policy, [Fleet(n) for n in counts])
        return {o.fleet.workers: o.attainment >= goal.attainment for o in outcomes}

    search = smallest_meeting(meets, 1, max_workers, batch)
    found = None if search.answer is None else evaluate(policy, [Fleet(search.answer)])[0]
    return Answer(policy, False, search, found)


def search_split(
    evaluate: Evaluate, policy: str, goal: Goal, max_workers: int, batch: int
) -> Answer:
    """Totals searched with `splits`; then, below the answer, every split of each smaller
    total until one has none that meets."""

    def best(fleets: list[Fleet]) -> Outcome:
        return max(evaluate(policy, fleets), key=lambda o: o.attainment)

    def meets(totals: list[int]) -> dict[int, bool]:
        evaluate(policy, [f for t in totals for f in splits(t)])  # side by side
        return {t: best(splits(t)).attainment >= goal.attainment for t in totals}

    # A total is already up to 7 candidates side by side.
    search = smallest_meeting(meets, 2, max_workers, max(1, batch // 7))
    if search.answer is None:
        return Answer(policy, True, search, None)
    searched, answer = search.answer, search.answer
    while answer > 2:
        below = best(all_splits(answer - 1))
        search.meets[answer - 1] = below.attainment >= goal.attainment
        if not search.meets[answer - 1]:
            break
        answer -= 1
    search.answer = answer
    search.meets = dict(sorted(search.meets.items()))
    search.violations = _violations(search.meets)
    tried = splits(answer) if answer == searched else all_splits(answer)
    return Answer(policy, True, search, best(tried))


@dataclass
class Plan:
    """Every policy's answers and every candidate simulated, in the order simulated."""

    goal: Goal
    max_workers: int
    answers: list[Answer]
    outcomes: list[Outcome]

    @property
    def answer(self) -> Answer | None:
        """The fewest workers over every search (a mixed fleet before a split one, then the
        policies in the order given)."""
        found = [a for a in self.answers if a.outcome is not None]
        return min(found, key=lambda a: (a.outcome.fleet.workers, a.split)) if found else None  # type: ignore[union-attr]

    @property
    def closest(self) -> Outcome:
        """The candidate with the highest attainment (the fewest workers among equals)."""
        return max(self.outcomes, key=lambda o: (o.attainment, -o.fleet.workers))

    def to_json(self) -> dict[str, object]:
        answer = self.answer
        out: dict[str, object] = {
            "goal": {
                "ttft": self.goal.ttft,
                "tpot": self.goal.tpot,
                "attainment": self.goal.attainment,
            },  # fmt: skip
            "max_workers": self.max_workers,
        }
        if answer is None or answer.outcome is None:
            fields = ("workers", "prefill_workers", "decode_workers", "policy", "attainment")
            out |= dict.fromkeys(fields) | {"best": outcome_json(self.closest)}
        else:
            out |= outcome_json(answer.outcome)
        out["searches"] = [
            {
                "policy": a.policy,
                "split": a.split,
                "workers": a.search.answer,
                "meets": {str(n): ok for n, ok in a.search.meets.items()},
                "monotonicity_violations": [list(v) for v in a.search.violations],
            }
            for a in self.answers
        ]
        out["candidates"] = [outcome_json(o) for o in self.outcomes]
        return out


def outcome_json(o: Outcome) -> dict[str, object]:
    return {
        "workers": o.fleet.workers,
        "prefill_workers": o.fleet.prefill,
        "decode_workers": o.fleet.decode,
        "policy": o.policy,
        "attainment": o.attainment,
        "goodput_per_gpu": o.goodput_per_gpu,
        "gpu_hours": o.gpu_hours,
    }


def plan(
    candidates: Candidates,
    policies: Sequence[str],
    max_workers: int,
    *,
    split: bool = False,
    jobs: int = 1,
    ray: RayTasks | None = None,
) -> Plan:
    """Search, for each policy, the fewest mixed workers (and with `split` the fewest workers
    of a split fleet) that meet the goal, at most `max_workers`: `jobs` candidates at once, on
    `ray`'s cluster if given."""
    answers: list[Answer] = []
    with Evaluator(candidates, jobs, ray) as evaluate:
        for policy in policies:
            answers.append(search_mixed(evaluate, policy, candidates.goal, max_workers, jobs))
            if split and max_workers >= 2:
                answers.append(search_split(evaluate, policy, candidates.goal, max_workers, jobs))
        outcomes = list(evaluate.outcomes.values())
    return Plan(candidates.goal, max_workers, answers, outcomes)
