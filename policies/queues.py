"""Waiting-queue building blocks shared by the queue disciplines."""

from __future__ import annotations

import heapq
import itertools
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


class ClientQueues:
    """Per-client FIFO queues over one arrival order; a client is backlogged while its queue is
    non-empty. A request put back in front (preempted) goes before every other arrival."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[Request]] = {}
        self._order: dict[int, int] = {}  # request id -> position in arrival order
        self._next_back = 0
        self._next_front = -1
        self._len = 0

    def push(self, request: Request, front: bool = False) -> None:
        queue = self.queues.setdefault(request.client, deque())
        if front:
            self._order[request.id] = self._next_front
            self._next_front -= 1
            queue.appendleft(request)
        else:
            self._order[request.id] = self._next_back
            self._next_back += 1
            queue.append(request)
        self._len += 1

    def remove(self, request: Request) -> bool:
        """Take `request` out; True when its client's queue is now empty."""
        queue = self.queues[request.client]
        if queue[0] is request:
            queue.popleft()
        else:
            queue.remove(request)
        del self._order[request.id]
        self._len -= 1
        if not queue:
            del self.queues[request.client]
            return True
        return False

    def is_backlogged(self, client: str) -> bool:
        return client in self.queues

    def head(self, client: str) -> Request:
        return self.queues[client][0]

    def heads(self) -> list[Request]:
        return [queue[0] for queue in self.queues.values()]

    def order(self, request: Request) -> int:
        """Position in arrival order (smaller is earlier)."""
        return self._order[request.id]

    def oldest(self, n: int) -> list[Request]:
        """The first `n` waiting requests in arrival order, over all clients."""
        merged = heapq.merge(*self.queues.values(), key=self.order)
        return list(itertools.islice(merged, n))

    def __contains__(self, request: Request) -> bool:
        return request in self.queues.get(request.client, ())

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for queue in self.queues.values():
            yield from queue
