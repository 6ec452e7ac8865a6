"""Stopping: requests in flight get the grace, then an answer.

aiohttp's own stop waits `shutdown_timeout` for handlers, then as long again, then cancels them
and drops their connections: a non-streamed request still running loses its connection with
no answer. Instead each forwarded request runs under a deadline that the stop sets to `grace`
from then. At it the handler is interrupted while its connection is still open, and answers:
503 `shutting_down` if the client has seen nothing, else (a stream) an error event and
`[DONE]` (forward.py).

    serving ──────── SIGTERM ── on_shutdown: every deadline = now + grace
                                   │ finished in time: answered as usual
                                   └ at the deadline: TimeoutError in the handler -> 503
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from router.proxy.errors import APIError


class Drain:
    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._deadlines: set[asyncio.Timeout] = set()
        self._at: float | None = None  # loop time the grace ends; None while serving

    @property
    def is_stopping(self) -> bool:
        return self._at is not None

    @contextlib.asynccontextmanager
    async def deadline(self) -> AsyncIterator[None]:
        """Run a request's trip under the stop's deadline: TimeoutError once the grace is up."""
        async with asyncio.timeout_at(self._at) as timeout:
            self._deadlines.add(timeout)
            try:
                yield
            finally:
                self._deadlines.discard(timeout)

    def begin(self) -> None:
        """The proxy stops: every request in flight, and any still to start, has `grace` s."""
        if self._at is None:
            self._at = asyncio.get_running_loop().time() + self.grace
            for timeout in self._deadlines:
                timeout.reschedule(self._at)


DRAIN = web.AppKey("drain", Drain)


def install(app: web.Application, grace: float) -> None:
    """Give `app` a Drain (app[DRAIN]) that its shutdown begins."""
    app[DRAIN] = Drain(grace)

    async def begin(app: web.Application) -> None:
        app[DRAIN].begin()

    app.on_shutdown.append(begin)


def stopping() -> APIError:
    error = APIError(
        503,
        "the router is shutting down; retry the request",
        "service_unavailable",
        code="shutting_down",
    )
    error.close = True
    return error
