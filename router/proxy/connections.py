"""The proxy's client connections: how many it keeps open, how long a request's head may take,
and the parser's errors in the OpenAI shape.

aiohttp's server has none of these: no header timeout (200 connections sending a header line a
second were all still open after 40 s), no cap but the open-files limit, and its parser's
errors in text/plain with a traceback logged each. `ProxySite` serves an app as `web.TCPSite`
does, with this in front:

    accept() ─┬─ past `max_connections` ... overload.Refusal: 503, closed
              ├─ past the descriptors' room  overload.Refusal: 503, closed
              ├─ fails (no descriptor) .... overload.AcceptErrors: 503 on a spare descriptor
              └─ ProxyProtocol: the head within `header_timeout`, else 408; at most
                 MAX_HEAD_BYTES of it, else 431; then aiohttp's own request handling

The cap keeps the proxy inside its open-files limit (`fairway serve` first raises the soft
limit to the hard one, overload.raise_fd_limit): unset, it is DEFAULT_MAX_CONNECTIONS or what
the limit leaves room for, whichever is less, the limit read again at each accept
(overload.DescriptorBudget, shared by the listeners of a process: the public one leaves the
admin one a reserve). `max_connections` counts per listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
import socket
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler

from router.proxy.errors import APIError
from router.proxy.forward import CLUSTER
from router.proxy.openai_request import PARSER_LIMIT
from router.proxy.overload import (
    ADMIN_RESERVE,
    AcceptErrors,
    DescriptorBudget,
    Refusal,
    Tally,
    fd_room,
)
from router.proxy.settings import ProxySettings

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 4096  # `limits.max_connections` unset, if the fd limit allows it
# One request's head: above the parser's 64 KiB line, so a single long line still gets the
# parser's own answer (431), but 128 lines of 64 KiB (the parser's limits) cannot pile up.
MAX_HEAD_BYTES = 128 * 1024


def connection_cap(max_connections: int | None) -> int:
    """A listener's cap: `limits.max_connections` as given, or when unset the default or what
    the open-files limit leaves room for, whichever is less."""
    if max_connections is not None:
        return max_connections
    return min(DEFAULT_MAX_CONNECTIONS, fd_room(DEFAULT_MAX_CONNECTIONS))


def run_app(
    app: web.Application,
    settings: ProxySettings,
    *,
    host: str,
    port: int,
    sock: socket.socket | None = None,
    **runner_options: object,
) -> None:
    """`web.run_app` for the proxy: `app` on host:port (and on `sock`, if given) through
    `ProxySite`s until SIGTERM or SIGINT, then stopped as aiohttp stops (`runner_options`
    hold its `shutdown_timeout`)."""
    listeners: list[dict[str, object]] = [{"host": host, "port": port}]
    if sock is not None:
        listeners.append({"sock": sock})

    async def serve() -> None:
        async with serving(app, settings, listeners, **runner_options) as stop:
            await stop.wait()

    run_on_loop(serve(), settings.event_loop)


EVENT_LOOPS = ("uvloop", "asyncio")


def run_on_loop(main: Coroutine[object, object, None], kind: str) -> None:
    """`asyncio.run(main)` on the event loop `kind` names: "uvloop" (libuv; the proxy serves
    about 10 % more streams per core on it) where it is installed, else asyncio's own."""
    if kind not in EVENT_LOOPS:
        raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}, not {kind!r}")
    factory = None
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed: serving on asyncio's own event loop")
        else:
            factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


@contextlib.asynccontextmanager
async def serving(
    app: web.Application,
    settings: ProxySettings,
    listeners: Sequence[Mapping[str, object]],
    **runner_options: object,
) -> AsyncIterator[asyncio.Event]:
    """`app` served on each listener (`ProxySite` keyword arguments) while the block runs;
    yields the event SIGTERM and SIGINT set. The handlers are in place before the first
    listener opens, so a stop never meets the default handler; leaving the block stops the
    runner as aiohttp does."""
    runner = web.AppRunner(app, access_log=None, **runner_options)  # type: ignore[arg-type]
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    cluster = app.get(CLUSTER)
    budget = DescriptorBudget(lambda: len(cluster.workers) if cluster is not None else 0)
    try:
        for listener in listeners:
            site = ProxySite(runner, settings, budget=budget, **listener)  # type: ignore[arg-type]
            await site.start()
        yield stop
    finally:
        await runner.cleanup()


class ProxySite(web.BaseSite):
    """`web.TCPSite` (or a listening `sock`) serving the runner's app through `ProxyProtocol`,
    at most `cap` connections at a time, and while the process's descriptors have room
    (`budget`, which the listeners of a process share); past either, `Refusal`."""

    def __init__(
        self,
        runner: web.BaseRunner,
        settings: ProxySettings,
        host: str | None = None,
        port: int = 0,
        *,
        sock: socket.socket | None = None,
        reuse_port: bool = False,
        backlog: int = 128,
        budget: DescriptorBudget | None = None,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._sock, self._reuse_port = host, port, sock, reuse_port
        # Unset, the cap is the default and the descriptors' room, read at each accept.
        self.configured = settings.max_connections
        self.cap = self.configured or DEFAULT_MAX_CONNECTIONS
        self.budget = budget or DescriptorBudget()
        self.within_budget = True  # False: accept() may fail, and AcceptErrors answers it
        self.admin_port = settings.admin_port
        self.is_admin = False  # this is the admin listener (known once started)
        self.header_timeout = settings.header_timeout
        self.num_open = 0
        self.refusing: set[Refusal] = set()
        self.refused = Tally(self._report_refused)
        self.late_heads = Tally(self._report_late)
        self.bad_heads = Tally(self._report_bad)

    @property
    def name(self) -> str:
        sockets = getattr(self._server, "sockets", None)  # once started
        if sockets:
            host, port = sockets[0].getsockname()[:2]
            return f"http://{host}:{port}"
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._fit_cap_to_descriptors(loop)
        if self._sock is not None:
            self._server = await loop.create_server(
                self._connection, sock=self._sock, backlog=self._backlog
            )
        else:
            self._server = await loop.create_server(
                self._connection,
                self._host,
                self._port,
                backlog=self._backlog,
                reuse_port=self._reuse_port or None,
            )
        bound = self._server.sockets[0].getsockname()[1] if self._server.sockets else None
        self.is_admin = self.admin_port is not None and bound == self.admin_port
        public = self.within_budget and not self.is_admin
        log.info(
            "%s: at most %d connections%s, request heads within %g s",
            self.name,
            min(self.cap, self.budget.room(admin=True)) if self.within_budget else self.cap,
            f" ({ADMIN_RESERVE} of them kept for the admin listener)" if public else "",
            self.header_timeout,
        )

    def _fit_cap_to_descriptors(self, loop: asyncio.AbstractEventLoop) -> None:
        """A cap above what the open-files limit leaves room for: on asyncio's own loop, an
        accept() that then fails is answered 503 on a spare descriptor (AcceptErrors); uvloop
        (libuv) drops such a connection unanswered, so there the cap comes down to the room."""
        answers_accept_errors = isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop)
        if answers_accept_errors:
            AcceptErrors.install(loop)
        room = self.budget.room(admin=True)
        if self.configured is None or self.cap <= room:
            return
        self.within_budget = not answers_accept_errors
        then = (
            "past that, connections are answered 503 on a spare descriptor"
            if answers_accept_errors
            else f"capped at {room} (this event loop cannot answer a connection it has no "
            "descriptor for)"
        )
        log.warning(
            "limits.max_connections %d is more than the open-files limit leaves room for (%d): %s",
            self.cap,
            room,
            then,
        )

    async def stop(self) -> None:
        for refusal in list(self.refusing):
            refusal.close()
        for tally in (self.refused, self.late_heads, self.bad_heads):
            tally.flush()
        await super().stop()

    def _connection(self) -> asyncio.Protocol:
        """The protocol factory: once per accepted connection, before it is made."""
        if self.num_open >= self.cap or (
            self.within_budget and not self.budget.has_room(self.is_admin)
        ):
            self.refused.add()
            return Refusal(self.refusing)
        self.num_open += 1
        self.budget.num_open += 1
        server = self._runner.server
        assert server is not None, "the runner is set up before its sites start"
        # What `web.Server.__call__` passes to aiohttp's own protocol: the app's handler_args
        # (the parser's limits) and the runner's options.
        return ProxyProtocol(self, server, loop=asyncio.get_running_loop(), **server._kwargs)

    def closed(self) -> None:
        self.num_open -= 1
        self.budget.num_open -= 1
        assert self.num_open >= 0, "a connection closed twice"

    def _report_refused(self, n: int) -> None:
        if not self.within_budget:
            why = f"the cap {self.cap} (limits.max_connections)"
        else:
            room = self.budget.room(self.is_admin)
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            why = (
                f"{self.budget.num_open} in all; the cap {min(self.cap, room)} "
                f"(limits.max_connections {self.cap}, room for {room} at the open-files limit "
                f"{soft})"
            )
        log.warning(
            "%s: refused %d connections in the last second (503): %d open, %s",
            self.name,
            n,
            self.num_open,
            why,
        )

    def _report_late(self, n: int) -> None:
        log.warning(
            "%s: closed %d connections in the last second: request head over %g s (408)",
            self.name,
            n,
            self.header_timeout,
        )

    def _report_bad(self, n: int) -> None:
        log.info("%s: answered %d malformed request heads in the last second", self.name, n)


class ProxyProtocol(RequestHandler):
    """aiohttp's HTTP/1.1 protocol for one client connection, with what it lacks:

    - each request's head must be whole within `header_timeout`: of the connect for the first
      request, of its first byte for the next ones (an idle keep-alive connection is left to
      aiohttp's keep-alive timeout); else 408 and close.
    - at most MAX_HEAD_BYTES of head, else 431 and close.
    - the parser's errors (a line over 64 KiB, too many headers, garbage) in the OpenAI shape,
      counted rather than logged with a traceback each.
    """

    def __init__(self, site: ProxySite, manager: web.Server, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._site: ProxySite | None = site
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        waiting = self._awaiting_head()
        if waiting and self._head_timer is None:  # the first bytes of the next request
            self._arm()
        super().data_received(data)
        if not self._awaiting_head():  # the head is whole (or the connection is closing)
            self._disarm()
        elif waiting:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                message = f"the request's headers are longer than {MAX_HEAD_BYTES} bytes"
                self._give_up(APIError.of_status(431, message, code="header_too_large"))

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        if self._site is not None:
            self._site.closed()
            self._site = None
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        # aiohttp's request loop waits on `_waiter` for the next whole head, and only then: the
        # test its own keep-alive timer makes for an idle connection.
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _arm(self) -> None:
        assert self._site is not None, "armed while connected"
        self._head_bytes = 0
        self._head_timer = self._loop.call_later(self._site.header_timeout, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_bytes = 0

    def _head_late(self) -> None:
        self._head_timer = None
        if self._site is None or not self._awaiting_head():
            return
        message = f"the request's headers did not arrive within {self._site.header_timeout:g} s"
        self._give_up(APIError(408, message, "timeout_error", code="header_timeout"))

    def _give_up(self, error: APIError) -> None:
        """Answer and close; only while awaiting a head, when no answer is under way."""
        if self._site is not None:
            tally = self._site.late_heads if error.status == 408 else self._site.bad_heads
            tally.add()
        self._disarm()
        if self.transport is not None:
            self.transport.write(error.raw())
        self.force_close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to what its parser refused (and to a handler's escaped error, which
        the app's middleware leaves none of), in the OpenAI shape."""
        if request.writer.output_size > 0:  # as aiohttp: too late for another answer
            raise ConnectionError("an answer was under way; cannot send the error")
        if status >= 500:
            log.error("answering %d to %s", status, request.remote, exc_info=exc)
            error = APIError.of_status(status, "internal error in the router")
        else:
            if self._site is not None:
                self._site.bad_heads.add()
            error = _parse_error(exc)
        response = error.response()
        response.force_close()
        return response


def _parse_error(exc: BaseException | None) -> APIError:
    if isinstance(exc, LineTooLong) or "Too many headers" in str(exc):
        # Past the parser's own limits (openai_request.parser_limits); below them the app's
        # header_limits answers 431 or 414. Here a URL is not told apart from a header.
        return APIError.of_status(
            431,
            f"a header line or the URL is longer than {PARSER_LIMIT} bytes, or there are too "
            "many headers",
            code="header_too_large",
        )
    return APIError.of_status(400, f"malformed HTTP request ({type(exc).__name__})")
