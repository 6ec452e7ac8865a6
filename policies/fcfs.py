"""First come, first served: vLLM's default queue discipline."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from router.policy import LocalPolicy
from router.registry import local_policies
from router.request import Request


@local_policies.register("fcfs")
class FCFS(LocalPolicy):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self, request: Request, num_cached_tokens: int) -> None:
        assert self._queue and self._queue[0] is request, "fcfs pops only its head"
        self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
