"""Preble's queue discipline (`preble`): what E2 (policies/preble.py) runs on each worker."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from router.policy import LocalPolicy
from router.registry import local_policies
from router.request import Request
from router.traits import DisciplineTraits, ReordersOn


@local_policies.register("preble")
class HitRatioGroups(LocalPolicy):
    """Preble's local scheduler: priority groups by cache-hit ratio, served in proportion.

    A request joins group g = floor(hit ratio x num_groups) when the engine first looks at it;
    group g gets a share of admissions proportional to g + 1 (stride scheduling), so requests
    with more cached context go first more often, and zero-hit ones still progress.
    """

    # A request's group is fixed when first seen: only what is cached then can reorder.
    traits = DisciplineTraits(counts_tokens=False, reorders_on=ReordersOn.CACHE)

    def __init__(self, num_groups: int = 10) -> None:
        self.num_groups = num_groups
        self.groups: list[deque[Request]] = [deque() for _ in range(num_groups)]
        self.passes = [0.0] * num_groups  # stride scheduling: lowest pass goes next
        self._ungrouped: deque[Request] = deque()
        self._group_of: dict[int, int] = {}
        self._len = 0

    def push(self, request: Request) -> None:
        self._ungrouped.append(request)
        self._len += 1

    def push_front(self, request: Request) -> None:
        g = self._group_of.get(request.id)
        (self._ungrouped if g is None else self.groups[g]).appendleft(request)
        self._len += 1

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        while self._ungrouped:
            request = self._ungrouped.popleft()
            ratio = cached_blocks(request) / request.num_blocks if request.num_blocks else 0.0
            g = min(int(ratio * self.num_groups), self.num_groups - 1)
            self._join(g, request)
        live = [g for g in range(self.num_groups) if self.groups[g]]
        if not live:
            return None
        g = min(live, key=lambda g: (self.passes[g], -g))
        return self.groups[g][0]

    def pop(self, request: Request, num_cached_tokens: int) -> None:
        g = self._group_of[request.id]
        queue = self.groups[g]
        queue.popleft() if queue[0] is request else queue.remove(request)
        self.passes[g] += 1.0 / (g + 1)
        self._len -= 1

    def remove(self, request: Request) -> None:
        g = self._group_of.pop(request.id, None)
        # Ungrouped until the engine first peeks; a stranger is in neither queue.
        if _discard(self._ungrouped if g is None else self.groups[g], request):
            self._len -= 1

    def on_finish(self, request: Request) -> None:
        self._group_of.pop(request.id, None)

    def _join(self, g: int, request: Request) -> None:
        if not self.groups[g]:
            # A group that was empty starts level with the others: idling banks no priority.
            live = [self.passes[k] for k in range(self.num_groups) if self.groups[k]]
            self.passes[g] = max(self.passes[g], min(live, default=self.passes[g]))
        self.groups[g].append(request)
        self._group_of[request.id] = g

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        yield from self._ungrouped
        for queue in self.groups:
            yield from queue


def _discard(queue: deque[Request], request: Request) -> bool:
    """Take `request` itself (not an equal one) out of `queue`; False if it is not there."""
    for i, r in enumerate(queue):
        if r is request:
            del queue[i]
            return True
    return False
