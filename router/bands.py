"""Strict priority bands over any queue discipline.

Each priority (a lower value is served first, as in vLLM) has its own instance of the configured
discipline. The next request is always from the highest band with one waiting; inside a band the
discipline orders exactly as it would alone, with its own counters, so VTC's or DLPM's fairness
bound holds among a band's tenants whatever the other bands do.

vLLM's priority scheduling orders its waiting queue by (priority, arrival) the same way; it does
not interrupt running requests to admit a waiting one, and neither do bands.

The papers leave open how fairness counters meet across bands. Here each band keeps its own:
service a tenant received in a higher band does not count against it in a lower one, since the
operator chose to serve that band first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from router.policy import LocalPolicy
from router.request import Request


class Banded(LocalPolicy):
    """`make_band()` builds one band's discipline; bands for `priorities` exist from the start
    (a replica shares their counters), others are made when their first request comes."""

    name = "banded"

    def __init__(
        self, make_band: Callable[[], LocalPolicy], priorities: Iterable[int] = ()
    ) -> None:
        self._make_band = make_band
        self.bands: dict[int, LocalPolicy] = {}
        self._order: list[int] = []  # the bands' priorities, highest band (lowest value) first
        for priority in priorities or (0,):
            self._band(priority)
        inner = self.bands[self._order[0]]
        self.traits = inner.traits  # type: ignore[misc]  # bands reorder as their discipline
        self.name = inner.name

    def _band(self, priority: int) -> LocalPolicy:
        band = self.bands.get(priority)
        if band is None:
            band = self.bands[priority] = self._make_band()
            self._order = sorted(self.bands)
        return band

    def push(self, request: Request) -> None:
        self._band(request.priority).push(request)

    def push_front(self, request: Request) -> None:
        self._band(request.priority).push_front(request)

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        bands = self.bands
        for priority in self._order:
            band = bands[priority]
            if len(band):
                return band.peek(cached_blocks)  # strict: a lower band waits behind this one
        return None

    def pop(self, request: Request, num_cached_tokens: int) -> None:
        self.bands[request.priority].pop(request, num_cached_tokens)

    def remove(self, request: Request) -> None:
        band = self.bands.get(request.priority)
        if band is not None:
            band.remove(request)

    def on_token(self, request: Request, num_tokens: int) -> None:
        band = self.bands.get(request.priority)
        if band is not None:
            band.on_token(request, num_tokens)

    def on_tokens(self, requests: Sequence[Request], num_tokens: int) -> None:
        if len(self.bands) == 1:
            next(iter(self.bands.values())).on_tokens(requests, num_tokens)
            return
        by_band: dict[int, list[Request]] = {}
        for request in requests:
            by_band.setdefault(request.priority, []).append(request)
        for priority, batch in by_band.items():
            band = self.bands.get(priority)
            if band is not None:
                band.on_tokens(batch, num_tokens)

    def on_finish(self, request: Request) -> None:
        band = self.bands.get(request.priority)
        if band is not None:
            band.on_finish(request)

    def __len__(self) -> int:
        return sum(len(band) for band in self.bands.values())

    def __iter__(self) -> Iterator[Request]:
        for priority in self._order:
            yield from self.bands[priority]
