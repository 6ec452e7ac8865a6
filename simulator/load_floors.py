"""Which worker has the least load now, without bringing every engine up to date first.

A policy routing to the least loaded worker (`router.policy.LeastLoaded`) reads each worker's
tokens in flight, which a decoding engine lowers at every step. Applying every engine's ended
steps before each arrival makes an arrival cost a pass over the fleet in Python: at 1,024 workers
about a hundred engines have a step ended between two arrivals.

Between its changes of state an engine's load falls only by its run's decode steps, each taking
the batch size off, and no step of a run is shorter than its shortest. So each worker's tokens in
flight now are bounded from below by its count at its last change less the batch size for every
step that could have ended since. The view's least worker (keys as of each worker's last update)
and every worker with steps ended whose floor does not exceed that worker's exact count are
worked out exactly from their runs (no step applied), and only the least of those is brought up
to date. The view the policy reads then ranks it first: every other worker's key there is its
key as of its last update, never below its exact key now.

Finding those workers must not cost a pass over the fleet either. A floor only falls with time,
so for a level L each worker has a time at which its floor first reaches L (never, if its run
ends first). Those times sit in a heap; a decision pops the ones passed and keeps the workers
whose floor is at L or below (`_low`). While the least exact key is at most L, every worker
that could beat it is among them. When the least key rises past L, or L has become much
higher than needed, a new level is set and the heap rebuilt: the workers read are always a
superset of those that could come first, so the answer is the same at any level, and only the
work depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from router.view import ClusterView, OrderKey, boxed_id
from simulator.engine import Engine
from simulator.time_heap import TimeHeap

# Step ends are sums of durations, rounded: a floor that shortens each step by this fraction
# still holds after thousands of steps.
SLACK = 1e-9
# A crossing time is taken this fraction of a step early: time over step length, in floating
# point, errs by far less.
EARLY = 1e-6
# The level is set this far above the least key it is set for, and reset once that key falls
# below LOWER_BY of it with at least CROWD workers at or below it. A low level keeps few workers
# in the low set each decision walks; resets, a pass over the fleet each, stay rare (tiled
# Mooncake on 1,024 workers, least_load: about 100 workers walked per decision at a headroom of
# 0.25, and 1.8 % fewer instructions in all at 0.05).
HEADROOM, MIN_HEADROOM = 0.05, 16.0
LOWER_BY, CROWD = 0.5, 64

_INF: Final = float("inf")


class _Falling:
    """One worker as of its last change: its tokens in flight (inf: not routable), and how its
    run's decode steps still to come may lower them: when the step before the first of them
    ended (so that the time since, in shortest steps, counts them), the shortest step, how
    many there are, the tokens each takes off. And when the floor reaches the level, whether
    it has (`low`), and whether the low list holds it (`listed`: it may, stale, once not low)."""

    __slots__ = (
        "wid",
        "tokens",
        "before_first",
        "shortest",
        "left",
        "batch",
        "crossing",
        "low",
        "listed",
    )

    def __init__(self, wid: int) -> None:
        self.wid = wid
        self.tokens = _INF
        self.before_first = _INF
        self.shortest = 1.0
        self.left = 0
        self.batch = 0
        self.crossing = _INF
        self.low = False
        self.listed = False

    def floor(self, now: float) -> float:
        """The tokens in flight at `now`, at the least."""
        if not self.batch or now <= self.before_first:
            return self.tokens
        steps = int((now - self.before_first) / self.shortest)  # > 0: floored
        return self.tokens - min(steps, self.left) * self.batch

    def crossing_time(self, level: float) -> float:
        """When the floor, falling a batch a step, first reaches `level` and is below the
        tokens (inf: not in this run). Taken early, never late."""
        tokens, batch = self.tokens, self.batch
        if not batch or tokens - self.left * batch > level:
            return _INF
        # Truncated, not floored: the same once at least 1.
        steps = max(1, int((tokens - level) / batch))
        return self.before_first + (steps - EARLY) * self.shortest


class LoadFloors:
    def __init__(self, engines: Sequence[Engine], view: ClusterView, key: OrderKey) -> None:
        self._engines, self._view, self._key = engines, view, key
        self._workers = [_Falling(wid) for wid in range(len(engines))]  # engine i: worker i
        # How the level follows the least key (module constants; tests push them to extremes).
        self.headroom, self.min_headroom = HEADROOM, MIN_HEADROOM
        self.lower_by, self.crowd = LOWER_BY, CROWD
        self._level = 0.0
        self._heap = TimeHeap()  # (crossing, worker), stale ones included
        # The workers whose floor reached the level, and some that did before their last change
        # (`low` is False, taken out as a decision walks past them): a list of the workers
        # themselves, not a set of ids, so that a walk makes no object and hashes nothing.
        self._low: list[_Falling] = []
        self._num_low = 0

    def changed(self, wid: int) -> None:
        """The worker's state moved (its engine applied steps or took a request, or its
        health changed)."""
        worker = self._workers[wid]
        if worker.low:
            worker.low = False
            self._num_low -= 1
        state = self._view.workers.get(boxed_id(wid))
        if state is None or not state.healthy:
            worker.tokens = worker.crossing = _INF
            worker.batch = 0
            return
        first, shortest, left, batch = self._engines[wid].decode_bound()
        worker.tokens = float(state.tokens_in_flight)
        worker.before_first = first - shortest
        worker.shortest = shortest * (1 - SLACK)
        worker.left = left
        worker.batch = batch
        at = worker.crossing = worker.crossing_time(self._level)
        if at < _INF:
            self._heap.push(at, wid)
            if len(self._heap) > 4 * len(self._workers) + 64:  # mostly stale entries
                self._rebuild_heap()

    def floor(self, wid: int, now: float) -> float:
        """The worker's tokens in flight at `now`, at the least (inf: not routable)."""
        return self._workers[wid].floor(now)

    def least(self, now: float) -> int | None:
        """The healthy worker whose exact key is least at `now` (None: no healthy worker).
        Every engine's steps that move more than its decode progress must have been applied."""
        # The view's least: keys as of each worker's last update. Only a worker with decode
        # steps ended since can beat it, its key being lower now than the view's.
        try:
            best = self._exact(self._view.least(self._key).id, now)
        except RuntimeError:  # no healthy worker
            return None
        least = float(best[0])
        low, workers = self._low, self._workers
        crowded = least < self.lower_by * self._level and self._num_low >= self.crowd
        if least > self._level or crowded:
            self._relevel(least)
        heap = self._heap
        while heap and heap.first_at() <= now:
            at = heap.first_at()
            worker = workers[heap.pop()]
            if worker.crossing == at and not worker.low:
                worker.low = True
                self._num_low += 1
                if not worker.listed:
                    worker.listed = True
                    low.append(worker)
        floors: list[float] = []
        candidates: list[_Falling] = []  # the workers, not their ids: no int boxed per entry
        kept = 0
        for worker in low:
            if not worker.low:
                worker.listed = False
                continue
            low[kept] = worker
            kept += 1
            floor = worker.floor(now)
            if floor <= least and floor < worker.tokens:
                floors.append(floor)
                candidates.append(worker)
        del low[kept:]
        # Lowest floor first: the first exact keys found usually rule out the rest, so each is
        # picked out by a pass over the floors rather than all of them sorted (the answer is
        # the least exact key whatever the order: only the work depends on it).
        while floors:
            pick = _lowest(floors)
            if floors[pick] > least:
                break
            wid = candidates[pick].wid
            floors[pick], candidates[pick] = floors[-1], candidates[-1]
            floors.pop()
            candidates.pop()
            exact = self._exact(wid, now)
            if exact < best:
                best = exact
                least = float(best[0])
        return best[-1]

    def _relevel(self, least: float) -> None:
        """A level above `least`, each worker's crossing of it anew."""
        level = self._level = least + max(self.headroom * least, self.min_headroom)
        for worker in self._low:
            worker.low = worker.listed = False
        self._low.clear()
        self._num_low = 0
        for worker in self._workers:
            worker.crossing = worker.crossing_time(level)
        self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap.rebuild(
            [
                (worker.crossing, worker.wid)
                for worker in self._workers
                if worker.crossing < _INF and not worker.low
            ]
        )

    def _exact(self, wid: int, now: float) -> tuple:
        key = self._key(self._view, self._view.workers[boxed_id(wid)])
        credit = self._engines[wid].decode_credit(now)
        return (key[0] - credit, *key[1:]) if credit else key


def _lowest(values: list[float]) -> int:
    """Where the least of `values` (not empty) is: its first place."""
    at, low = 0, values[0]
    for i in range(1, len(values)):
        if values[i] < low:
            at, low = i, values[i]
    return at
