"""Locality-blind global policies: the baselines every other policy is measured against."""

from __future__ import annotations

import bisect
import random

from router.load import least_tokens
from router.policy import Decision, GlobalPolicy, LeastLoaded
from router.registry import global_policies
from router.request import Request
from router.traits import PolicyTraits
from router.view import ClusterView


@global_policies.register("round_robin")
class RoundRobin(GlobalPolicy):
    """Each healthy worker in turn, in id order."""

    traits = PolicyTraits(counts_tokens=False, reads_prefixes=False)

    def progress_read(self, request: Request, view: ClusterView) -> tuple[()]:
        return ()  # the turn or a draw reads no load

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, view: ClusterView) -> Decision:
        ids = view.healthy_ids()  # kept sorted until the roster changes: no pass over the fleet
        if not ids:
            raise RuntimeError("no healthy worker to route to")
        at = bisect.bisect_left(ids, self._next)
        worker = ids[at] if at < len(ids) else ids[0]
        self._next = worker + 1
        return Decision(worker, "turn")


@global_policies.register("random")
class Random(GlobalPolicy):
    """A uniformly random healthy worker."""

    traits = PolicyTraits(counts_tokens=False, reads_prefixes=False)

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def progress_read(self, request: Request, view: ClusterView) -> tuple[()]:
        return ()  # the turn or a draw reads no load

    def route(self, request: Request, view: ClusterView) -> Decision:
        return Decision(self._rng.choice(view.routable_workers()).id, "random")


_FEWEST_TOKENS = LeastLoaded(least_tokens)  # asked at every arrival: one answer, kept


@global_policies.register("least_load")
class LeastLoad(GlobalPolicy):
    """The worker with the fewest outstanding tokens (unprefilled prompt + ungenerated output)."""

    traits = PolicyTraits(counts_tokens=False, reads_prefixes=False)

    def progress_read(self, request: Request, view: ClusterView) -> LeastLoaded:
        return _FEWEST_TOKENS  # only who has the fewest tokens in flight

    def route(self, request: Request, view: ClusterView) -> Decision:
        return Decision(view.least(least_tokens).id, "least tokens in flight")


@global_policies.register("power_of_two")
class PowerOfTwo(GlobalPolicy):
    """The less loaded of two workers drawn at random (Mitzenmacher's power of two choices)."""

    traits = PolicyTraits(counts_tokens=False, reads_prefixes=False)

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, request: Request, view: ClusterView) -> Decision:
        workers = view.routable_workers()
        pair = self._rng.sample(workers, 2) if len(workers) > 1 else workers
        return Decision(min(pair, key=lambda w: least_tokens(view, w)).id, "lesser of two")
