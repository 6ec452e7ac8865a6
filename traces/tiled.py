"""A tiled trace's requests, each made when it is read.

Tiling a trace for a fleet 128 times larger made every copy up front: a million requests at
about 1.4 KB each (nearly all of it the copies' block hashes, each its own int object), held from
loading to the end of the run. A copy differs from its original only in id, arrival, block
hashes and session, so `TiledRequests` keeps the originals and, per request, which original and
copy it is and when it arrives (16 bytes); a request is made when read. A run that lets go of a
request once it is answered then holds only the requests in flight.

Reading one in order gives the same requests, field for field, as the copies made up front
(`traces.transform.tile` describes the tiling); the transforms that may follow a tiling (time
scaling, tenants) are kept as arrays and applied as a request is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from router.request import Request

_CHUNK = 4096


class TiledRequests(Sequence[Request]):
    """`originals` (sorted by arrival, starting at 0) `copies` times side by side, in arrival
    order; copy k of the j-th original is request k x len(originals) + j."""

    def __init__(self, originals: Sequence[Request], copies: int) -> None:
        originals = list(originals)
        n = len(originals)
        span = originals[-1].arrival - originals[0].arrival if originals else 0.0
        self._stride = 1 + max((h for r in originals for h in r.block_hashes), default=0)
        session_start: dict[str, float] = {}
        for r in originals:
            if r.session is not None:
                session_start.setdefault(r.session, r.arrival)
        # A session rotates as one: whether its turns wrap round is decided by its first.
        start = np.array([r.arrival if r.session is None else session_start[r.session]
                          for r in originals], dtype=np.float64)  # fmt: skip
        base = np.array([r.arrival for r in originals], dtype=np.float64)
        arrival = np.empty(n * copies, dtype=np.float64)
        for k in range(copies):
            shift = k * span / copies
            back = np.where(start + shift >= span, span, 0.0)
            arrival[k * n : (k + 1) * n] = base + shift - back
        # Copy-major, then stable by arrival: the order sorting the copies made up front gave.
        order = np.argsort(arrival, kind="stable")
        arrival = arrival[order]
        if len(arrival) and arrival[0] != 0:
            arrival -= arrival[0]
        self._originals = originals
        # Each original's fields in Request's order, a copy's made from them.
        names = [f.name for f in dataclasses.fields(Request) if f.init]
        self._field_at = {name: i for i, name in enumerate(names)}
        self._templates = [tuple(getattr(r, name) for name in names) for r in originals]
        self._arrival = arrival
        self._original = (order % n).astype(np.int32) if n else order.astype(np.int32)
        self._copy = (order // n).astype(np.int32) if n else order.astype(np.int32)
        self._time_factors: tuple[float, ...] = ()
        self._clients: list[str] | None = None  # in arrival order, as read

    def __len__(self) -> int:
        return len(self._arrival)

    @overload
    def __getitem__(self, i: int) -> Request: ...
    @overload
    def __getitem__(self, i: slice) -> list[Request]: ...
    def __getitem__(self, i: int | slice) -> Request | list[Request]:
        if isinstance(i, slice):
            return [self._at(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("tiled request index out of range")
        return self._at(i)

    def __iter__(self) -> Iterator[Request]:
        # A chunk's positions as Python numbers at a time: numpy's own scalars are slow to
        # index with, and the whole trace's as lists would be tens of MB.
        for at in range(0, len(self), _CHUNK):
            chunk = slice(at, at + _CHUNK)
            rows = zip(self._original[chunk].tolist(), self._copy[chunk].tolist(),
                       self._arrival[chunk].tolist(), strict=True)  # fmt: skip
            for i, (j, k, arrival) in enumerate(rows, at):
                yield self._make(i, j, k, arrival)

    def _at(self, i: int) -> Request:
        return self._make(i, int(self._original[i]), int(self._copy[i]), float(self._arrival[i]))

    def _make(self, i: int, j: int, k: int, arrival: float) -> Request:
        """The i-th request: copy k of the j-th original."""
        # The original's fields with a copy's own put in (as dataclasses.replace would, which
        # takes three times as long, a tenth of a large tiled run's time).
        r, at = self._originals[j], self._field_at
        fields = list(self._templates[j])
        fields[at["id"]] = k * len(self._originals) + j
        fields[at["arrival"]] = arrival
        offset = k * self._stride
        fields[at["block_hashes"]] = [h + offset for h in r.block_hashes]
        if r.session is not None:
            fields[at["session"]] = f"{r.session}#{k}"
        if self._clients is not None:
            fields[at["client"]] = self._clients[i]
        if self._time_factors and r.think_time is not None:
            fields[at["think_time"]] = self._think_time(r.think_time)
        return Request(*fields)

    def _think_time(self, think_time: float) -> float:
        for factor in self._time_factors:  # one multiplication per scaling, as in place
            think_time *= factor
        return think_time

    # ------------------------------------------------------- transforms, without the copies

    def column(self, name: str) -> list[Any]:
        """Every request's `name`, in order, made from the arrays and the originals alone."""
        if name == "id":
            return (self._copy.astype(np.int64) * len(self._originals) + self._original).tolist()
        if name == "arrival":
            return self._arrival.tolist()
        if name == "client" and self._clients is not None:
            return list(self._clients)
        if name == "block_hashes":
            return [r.block_hashes for r in self]
        originals, copies = self._originals, self._copy.tolist()
        values = [getattr(originals[j], name) for j in self._original.tolist()]
        if name == "session":
            return [None if s is None else f"{s}#{k}" for s, k in zip(values, copies, strict=True)]
        if name == "think_time" and self._time_factors:
            return [None if t is None else self._think_time(t) for t in values]
        return values

    def scale_time(self, factor: float) -> None:
        self._arrival *= factor
        self._time_factors += (factor,)

    def set_clients(self, clients: Sequence[str]) -> None:
        if len(clients) != len(self):
            raise ValueError(f"{len(clients)} clients for {len(self)} requests")
        self._clients = list(clients)
