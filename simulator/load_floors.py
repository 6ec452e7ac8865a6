"""Which worker has the least load now, without bringing every engine up to date first.

A policy routing to the least loaded worker (`router.policy.LeastLoaded`) reads each worker's
tokens in flight, which a decoding engine lowers at every step. Applying every engine's ended
steps before each arrival makes an arrival cost a pass over the fleet in Python: at 1,024 workers
about a hundred engines have a step ended between two arrivals.

Between its changes of state an engine's load falls only by its run's decode steps, each taking
the batch size off, and no step of a run is shorter than its shortest. So each worker's tokens in
flight now are bounded from below by its count at its last change less the batch size for every
step that could have ended since: one vector expression over the fleet. The view's least worker
(keys as of each worker's last update) and every worker with steps ended whose bound does not
exceed that worker's exact count are worked out exactly from their runs (no step applied), and
only the least of those is brought up to date. The view the policy reads then ranks it first:
every other worker's key there is its key as of its last update, never below its exact key now.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from router.view import ClusterView, OrderKey
from simulator.engine import Engine

# Step ends are sums of durations, rounded: a bound that shortens each step by this fraction
# still holds after thousands of steps.
SLACK = 1e-9


class LoadFloors:
    def __init__(self, engines: Sequence[Engine], view: ClusterView, key: OrderKey) -> None:
        self._engines, self._view, self._key = engines, view, key
        n = len(engines)  # workers 0 .. n-1, engine i serving worker i
        # Each worker as of its last change: tokens in flight (inf: not routable), and its
        # run's decode steps still to come: when the one before the first ended (so that the
        # time since, in shortest steps, counts them), the shortest step, how many, tokens each.
        self._tokens = np.full(n, np.inf)
        self._before_first = np.full(n, np.inf)
        self._shortest = np.ones(n)
        self._left = np.zeros(n)
        self._batch = np.zeros(n)
        self._bound = np.empty(n)  # scratch: the bound at the time asked

    def changed(self, wid: int) -> None:
        """The worker's state moved (its engine applied steps or took a request, or its
        health changed)."""
        state = self._view.workers.get(wid)
        if state is None or not state.healthy:
            self._tokens[wid] = np.inf
            return
        first, shortest, left, batch = self._engines[wid].decode_bound()
        self._tokens[wid] = state.tokens_in_flight
        self._before_first[wid] = first - shortest
        self._shortest[wid] = shortest * (1 - SLACK)
        self._left[wid] = left
        self._batch[wid] = batch

    def least(self, now: float) -> int | None:
        """The healthy worker whose exact key is least at `now` (None: no healthy worker).
        Every engine's steps that move more than its decode progress must have been applied."""
        # The view's least: keys as of each worker's last update. Only a worker with decode
        # steps ended since can beat it, its key being lower now than the view's.
        try:
            best = self._exact(self._view.least(self._key).id, now)
        except RuntimeError:  # no healthy worker
            return None
        bound = self._bound
        # Steps ended by now, at most: one per shortest step since the one before the first.
        np.subtract(now, self._before_first, out=bound)
        np.divide(bound, self._shortest, out=bound)
        np.floor(bound, out=bound)
        np.minimum(bound, self._left, out=bound)
        np.maximum(bound, 0, out=bound)
        bound *= self._batch
        np.subtract(self._tokens, bound, out=bound)
        maybe = np.flatnonzero((bound <= best[0]) & (bound < self._tokens))
        if len(maybe):
            # Lowest bound first: the first exact keys found usually rule out the rest.
            order = maybe[np.argsort(bound[maybe], kind="stable")]
            for wid, floor in zip(order.tolist(), bound[order].tolist(), strict=True):
                if floor > best[0]:
                    break
                exact = self._exact(wid, now)
                if exact < best:
                    best = exact
        return best[-1]

    def _exact(self, wid: int, now: float) -> tuple:
        key = self._key(self._view, self._view.workers[wid])
        credit = self._engines[wid].decode_credit(now)
        return (key[0] - credit, *key[1:]) if credit else key
