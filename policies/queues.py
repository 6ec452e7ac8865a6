"""Waiting-queue building blocks shared by the queue disciplines."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from router.policy import LocalPolicy
from router.request import Request


class FifoQueue(LocalPolicy):
    """Arrival order with removal anywhere; the base of the locality-aware orders."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self, request: Request, num_cached_tokens: int) -> None:
        if self._queue[0] is request:
            self._queue.popleft()
        else:
            self._queue.remove(request)

    def remove(self, request: Request) -> None:
        if request in self._queue:
            self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def by_longest_prefix(
    queue: deque[Request], cached_blocks: Callable[[Request], int], max_scan: int
) -> list[Request]:
    """The first `max_scan` waiting requests, longest cached prefix first, FIFO among equals.

    Like SGLang's `lpm` schedule policy, a long queue falls back to arrival order beyond
    `max_scan`: matching every waiting prompt on every step would cost more than it saves.
    """
    head = [queue[i] for i in range(min(len(queue), max_scan))]
    matched = {id(r): cached_blocks(r) for r in head}
    return sorted(head, key=lambda r: -matched[id(r)])  # sorted() is stable: FIFO among ties
