"""A worker's router-side dispatch queue: fairness in front of a server that only does FCFS.

The local discipline (fcfs, lpm, vtc, dlpm, Preble's groups) orders the requests routed to the
worker, and at most `window` of them are in flight there at a time; the rest wait in the router,
where the discipline can still reorder them. A stock vLLM admits whatever it is sent in arrival
order, so the window is the lever: small keeps the discipline in charge, large hands the order to
the server. `window=None` sends everything at once (the simulator's engine placement, where the
engine's scheduler runs the discipline itself).

With priority bands (router.bands) a request counts against the window only with those of its
own band and higher ones: lower bands' requests in flight never hold a higher band back, so a
worker may have up to a window per band in flight. Without that, a window full of batch work
would make an interactive request wait for a batch request to finish.
"""

from __future__ import annotations

from router.bands import Banded
from router.ledger import Ledger, ledgers_of
from router.policy import LocalPolicy, overridden_hook
from router.prefix_index import PrefixIndex, WorkerId
from router.request import Request


class DispatchQueue:
    def __init__(
        self, worker: WorkerId, discipline: LocalPolicy, window: int | None, banded: bool = False
    ) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window: must be at least 1, got {window}")
        self.worker = worker
        self.discipline = discipline
        self._on_finish = overridden_hook(discipline, "on_finish")  # None: a no-op
        self.counts_tokens = discipline.traits.counts_tokens
        self.window = window
        self.in_flight = 0
        # Banded: in flight by priority, for each band's own window.
        self._in_flight_by: dict[int, int] | None = {} if banded and window is not None else None
        self.queued_tokens = 0  # prompt + output tokens of the requests waiting here
        # How many wait here, counted as they come and go: the discipline's own __len__ is
        # interpreted (users write disciplines), and the load is counted at every change.
        self._waiting = 0

    def push(self, request: Request) -> None:
        self.discipline.push(request)
        self.queued_tokens += request.prompt_len + request.output_len
        self._waiting += 1

    def release(self, held: PrefixIndex, block_size: int) -> list[Request]:
        """The requests to send now, in the discipline's order, while the window has room.
        Locality-aware disciplines order by what `held` says the worker has computed. A list,
        not a generator: compiled, a generator's frame and each value it yields cost more than
        what most calls release (one request)."""
        if not self._waiting:  # as at most finishes: no lookup table or closure made
            return []
        matched: dict[int, int] = {}  # the index does not change while requests are released

        def cached_blocks(r: Request) -> int:
            if r.id not in matched:
                matched[r.id] = held.match_of(r.block_hashes, self.worker)
            return matched[r.id]

        released: list[Request] = []
        window, by = self.window, self._in_flight_by
        # Nothing left waiting: the discipline is not asked (an interpreted call finding none).
        while self._waiting and (window is None or by is not None or self.in_flight < window):
            request = self.discipline.peek(cached_blocks)
            if request is None:
                break
            if by is not None and window is not None:
                p = request.priority
                if sum(n for q, n in by.items() if q <= p) >= window:
                    break  # lower bands come after this one: they would wait too
                by[p] = by.get(p, 0) + 1
            self.discipline.pop(request, cached_blocks(request) * block_size)
            self.queued_tokens -= request.prompt_len + request.output_len
            self._waiting -= 1
            self.in_flight += 1
            released.append(request)
        return released

    def done(self, request: Request) -> None:
        """A released request finished (answered, failed, or never sent): free its slot."""
        self.in_flight -= 1
        if self._in_flight_by is not None:
            self._in_flight_by[request.priority] -= 1
        if self._on_finish is not None:
            self._on_finish(request)

    def handed_off(self, request: Request) -> None:
        """A split request's prompt is computed here and it decodes elsewhere: its slot frees
        now. A discipline counting tokens keeps its account open, charged the output as it is
        decoded (`on_token`), until `done_elsewhere`: service as VTC and DLPM define it spans
        both stages. Any other is done with it (LPM's prompts being computed, say)."""
        self.in_flight -= 1
        if self._in_flight_by is not None:
            self._in_flight_by[request.priority] -= 1
        if not self.counts_tokens and self._on_finish is not None:
            self._on_finish(request)

    def done_elsewhere(self, request: Request) -> None:
        if self.counts_tokens and self._on_finish is not None:
            self._on_finish(request)

    def withdraw(self, request: Request) -> None:
        """Take a request that was never released out of the queue, charging nothing."""
        self.queued_tokens -= request.prompt_len + request.output_len
        self._waiting -= 1
        self.discipline.remove(request)

    def on_token(self, request: Request, num_tokens: int) -> None:
        self.discipline.on_token(request, num_tokens)

    def ledgers(self) -> dict[tuple[object, ...], Ledger]:
        """Its discipline's shareable counters (each band's own), keyed so that router
        replicas' keys for the same thing match."""
        discipline = self.discipline
        if isinstance(discipline, Banded):
            return {
                ("queue", self.worker, priority, name): ledger
                for priority, band in discipline.bands.items()
                for name, ledger in ledgers_of(band).items()
            }
        return {
            ("queue", self.worker, name): ledger for name, ledger in ledgers_of(discipline).items()
        }

    def __len__(self) -> int:
        return self._waiting
