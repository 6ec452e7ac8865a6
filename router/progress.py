"""Progress accounting: what each request in flight has left to do, as its tokens come back.

A routed request's work (router.flight.Flight.remaining) is its prompt and output on a mixed
worker, its prompt alone on a prefill worker until it is handed off, its output on a decode
worker. Work done is credited to the worker's load as it happens, so a policy balancing by
tokens in flight sees it at its next decision; and the token hooks (a fairness policy's counters,
a queue discipline's) hear each request's tokens.

`tokens_many` is a simulation's hot path: one call per engine step or run applied, for a whole
batch, so its loop is plain arithmetic and the hooks that do nothing are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.dispatch import DispatchQueue
from router.flight import Flight
from router.hooks import Hooks
from router.latency import LatencyTargets
from router.load import Load
from router.policy import GlobalPolicy, overridden_hook
from router.prefix_index import WorkerId
from router.request import Request


class Progress:
    def __init__(
        self,
        flights: dict[int, Flight],
        policy: GlobalPolicy,
        load: Load,
        latency: LatencyTargets,
        hooks: Hooks,
    ) -> None:
        self.flights = flights  # the core's requests in flight, by id: read here, never added to
        self.policy = policy
        self.load = load
        self.latency = latency
        self.hooks = hooks
        self._policy_counts_tokens = policy.traits.counts_tokens
        self._on_first_token = overridden_hook(policy, "on_first_token")
        self._queues_count_tokens = False  # any worker's queue discipline

    def queue_added(self, queue: DispatchQueue) -> None:
        """A worker joined with `queue`, whose discipline may count tokens."""
        self._queues_count_tokens |= queue.counts_tokens

    def done(self, flight: Flight, tokens: int) -> None:
        """`tokens` of `flight`'s work done (none if negative), credited to its worker."""
        tokens = max(tokens, 0)
        flight.remaining -= tokens
        self.load.credit(flight.worker, tokens)

    def first_token(self, request: Request, now: float) -> None:
        flight = self.flights.get(request.id)
        if flight is None:
            return
        if not flight.handed_off:  # its prompt is done (a decode worker had none to do)
            self.done(flight, min(request.prompt_len, flight.remaining))
        self.latency.prefilled(flight)
        if self._on_first_token is not None:
            self.hooks.run(self._on_first_token, request, flight.charged_to, now)

    def work_done_on(self, wid: WorkerId, num_tokens: int, kv_used_blocks: int | None) -> None:
        self.load.credit(wid, num_tokens, kv_used_blocks)

    def tokens_many(
        self, requests: Iterable[Request], num_tokens: int, now: float, credited: bool
    ) -> None:
        flights, counts_tokens = self.flights, self._policy_counts_tokens
        hears_tokens, hooks = counts_tokens or self._queues_count_tokens, self.hooks
        # A batch is one worker's: its load changes once. Ids, with -1 for "none yet": compiled,
        # an optional int is a boxed object, compared and boxed again per sequence.
        worker, done_there = -1, 0
        counted: list[Request] = []  # for the policy, in one call per worker as well
        counted_on: WorkerId | None = None
        for request in requests:  # per sequence per step: plain arithmetic (a min() was 5 %)
            flight = flights.get(request.id)
            if flight is None:
                continue
            remaining = flight.remaining
            done = num_tokens if num_tokens < remaining else remaining
            if done > 0:
                flight.remaining = remaining - done
                if not credited:
                    if flight.worker != worker:
                        if done_there:
                            self.load.credit(worker, done_there)
                        worker, done_there = flight.worker, 0
                    done_there += done
            if hears_tokens:
                if counts_tokens:
                    if flight.charged_to != counted_on:
                        if counted:
                            hooks.run(self.policy.on_tokens, counted, counted_on, num_tokens, now)
                        counted, counted_on = [], flight.charged_to
                    counted.append(request)
                if flight.released and flight.queue.counts_tokens:
                    hooks.run(flight.queue.on_token, request, num_tokens)
                stage = flight.prefill_queue
                if stage is not None and stage.counts_tokens:
                    hooks.run(stage.on_token, request, num_tokens)
        if counted:
            hooks.run(self.policy.on_tokens, counted, counted_on, num_tokens, now)
        if done_there:
            self.load.credit(worker, done_there)
