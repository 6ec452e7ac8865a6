"""A worker's router-side dispatch queue: fairness in front of a server that only does FCFS.

The local discipline (fcfs, lpm, vtc, dlpm, Preble's groups) orders the requests routed to the
worker, and at most `window` of them are in flight there at a time; the rest wait in the router,
where the discipline can still reorder them. A stock vLLM admits whatever it is sent in arrival
order, so the window is the lever: small keeps the discipline in charge, large hands the order to
the server. The live proxy keeps one per worker; the simulator's `--placement router` models the
same arrangement in front of FCFS engines.
"""

from __future__ import annotations

from collections.abc import Iterator

from router.policy import LocalPolicy
from router.prefix_index import PrefixIndex, WorkerId
from router.request import Request


class DispatchQueue:
    def __init__(self, worker: WorkerId, discipline: LocalPolicy, window: int) -> None:
        if window < 1:
            raise ValueError(f"window: must be at least 1, got {window}")
        self.worker = worker
        self.discipline = discipline
        self.window = window
        self.in_flight = 0
        self.queued_tokens = 0  # prompt + output tokens of the requests waiting here

    def push(self, request: Request) -> None:
        self.discipline.push(request)
        self.queued_tokens += request.prompt_len + request.output_len

    def release(self, index: PrefixIndex, block_size: int) -> Iterator[Request]:
        """The requests to send now, in the discipline's order, while the window has room.
        Locality-aware disciplines order by what `index` says the worker holds."""
        matched: dict[int, int] = {}  # the index does not change while requests are released

        def cached_blocks(r: Request) -> int:
            if r.id not in matched:
                matched[r.id] = index.match(r.block_hashes).get(self.worker, 0)
            return matched[r.id]

        while self.in_flight < self.window:
            request = self.discipline.peek(cached_blocks)
            if request is None:
                return
            self.discipline.pop(request, cached_blocks(request) * block_size)
            self.queued_tokens -= request.prompt_len + request.output_len
            self.in_flight += 1
            yield request

    def done(self, request: Request) -> None:
        """A released request finished (answered, failed, or never sent): free its slot."""
        self.in_flight -= 1
        self.discipline.on_finish(request)

    def withdraw(self, request: Request) -> bool:
        """Take a request that was never released out of the queue; False if it is not here."""
        if request not in list(self.discipline):
            return False
        self.discipline.pop(request, 0)
        self.queued_tokens -= request.prompt_len + request.output_len
        return True

    def drop_queued(self, fresh: LocalPolicy) -> None:
        """Forget every queued request (the worker went down and their callers were told);
        requests in flight stay counted until they finish."""
        self.discipline = fresh
        self.queued_tokens = 0

    def on_token(self, request: Request, num_tokens: int) -> None:
        self.discipline.on_token(request, num_tokens)

    def __len__(self) -> int:
        return len(self.discipline)
