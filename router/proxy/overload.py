"""What a client gets when the proxy is full (its connection cap) or out of file descriptors,
and how that is logged: a 503 in the OpenAI shape, and one counted line a second.

    past the cap ......... Refusal: 503 once the request begins, then closed
    accept() fails ....... AcceptErrors: the listener's queue answered 503, one connection at a
                           time, on a spare descriptor (/dev/null, held for this)

Without this a proxy at its open-files limit left /health hanging in the listen queue, and
asyncio logged a traceback for every failed accept(): 44,076 of them, 19 MB, in 17 s.

The cap keeps accept() from failing in the first place (uvloop drops a connection it cannot
accept unanswered). `DescriptorBudget` sizes it from the open-files limit as it is at each
accept, so a limit lowered at run time (`prlimit`) holds from the next connection on:

    soft limit ─┬─ reserve: the process's own (listeners, logs, the loop, threads, Ray, the
                │  store) and each worker's (health checks, its KV-event feed)
                └─ 2 per client connection (its own, and one to a worker): the room
                   public listener: the room less ADMIN_RESERVE, kept for the admin listener
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
from collections.abc import Callable

from router.proxy.errors import APIError

log = logging.getLogger(__name__)

# The process's own descriptors: listeners, logs, the loop, threads, Ray's driver, the store.
# Measured: 43 with Ray's driver, idle, and 2 more per worker (its kept-alive health checks).
RESERVED_FDS = 64  # at least this: OWN_FDS and FDS_PER_WORKER for up to 4 workers
OWN_FDS = 48
FDS_PER_WORKER = 4  # its health checks and scrapes, its KV-event feed
ADMIN_RESERVE = 16  # client connections the public listener leaves to the admin listener
MAX_REFUSING = 64  # refused connections answered politely at once; past it, closed at once
REFUSAL_LINGER = 2.0  # seconds a refused connection may take to send its request and go
DRAIN_AT_ONCE = 128  # waiting connections answered per failed accept (asyncio's backlog)


def too_many_connections() -> APIError:
    error = APIError(
        503,
        "the proxy has too many open connections; retry shortly",
        "service_unavailable",
        code="too_many_connections",
    )
    error.headers["Retry-After"] = "1"
    return error


BUSY = too_many_connections().raw()


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one (workers and replicas started after
    inherit it) and log both. Returns (soft, hard) as they are now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:  # an unlimited hard limit some kernels refuse
            log.warning("open files: cannot raise the soft limit %d to %d: %s", soft, hard, e)
    now, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    log.info("open files: soft limit %d (was %d), hard limit %d", now, soft, hard)
    return now, hard


def fd_reserve(num_workers: int = 0) -> int:
    """Descriptors kept for the process itself and its workers, out of the open-files limit."""
    return max(RESERVED_FDS, OWN_FDS + FDS_PER_WORKER * num_workers)


def fd_room(default: int, num_workers: int = 0) -> int:
    """Client connections the open-files limit leaves room for now: each may hold a descriptor
    to a worker besides its own, after `fd_reserve` for the rest of the process; `default`
    where there is no limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return default
    return max(1, (soft - fd_reserve(num_workers)) // 2)


class DescriptorBudget:
    """The client connections one proxy process may hold, across its listeners, read from the
    open-files limit at each accept (a system call: about a microsecond). The public listener
    stops ADMIN_RESERVE short of the room, so that /health and /metrics always answer on the
    admin listener."""

    def __init__(self, num_workers: Callable[[], int] = lambda: 0) -> None:
        self.num_workers = num_workers
        self.num_open = 0  # client connections held by every listener sharing this budget

    def room(self, admin: bool) -> int:
        """What a listener may hold: the admin listener the whole room, the public one the room
        less ADMIN_RESERVE (of at least 1)."""
        room = fd_room(1 << 30, self.num_workers())
        return room if admin else max(1, room - ADMIN_RESERVE)

    def has_room(self, admin: bool) -> bool:
        return self.num_open < self.room(admin)


class Tally:
    """Counts an event that can come thousands of times a second, and logs it at most once a
    second, with the count."""

    def __init__(self, report: Callable[[int], None]) -> None:
        self.report = report
        self.count = 0  # since the last report
        self._due: asyncio.TimerHandle | None = None

    def add(self) -> None:
        self.count += 1
        if self._due is None:
            self._due = asyncio.get_running_loop().call_later(1.0, self.flush)

    def flush(self) -> None:
        if self._due is not None:
            self._due.cancel()
            self._due = None
        if self.count:
            self.report(self.count)
            self.count = 0


class Refusal(asyncio.Protocol):
    """A connection past the cap: a 503 once its request begins (a client may drop an answer
    that comes before its request), our end shut, then closed when the client goes or
    REFUSAL_LINGER is up. With MAX_REFUSING of them already lingering, answered and closed at
    once. `refusing` holds the lingering ones, for the listener to close when it stops."""

    def __init__(self, refusing: set[Refusal]) -> None:
        self.refusing = refusing
        self.transport: asyncio.Transport | None = None
        self.answered = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.refusing) >= MAX_REFUSING:
            self._answer()
            self.close()
            return
        self.refusing.add(self)
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER, self._linger_over)

    def data_received(self, data: bytes) -> None:
        if not self.answered:
            self._answer()

    def eof_received(self) -> bool:
        self.close()
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.refusing.discard(self)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _answer(self) -> None:
        self.answered = True
        assert self.transport is not None, "answered once connected"
        self.transport.write(BUSY)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # what the client still sends is read and dropped

    def _linger_over(self) -> None:
        if not self.answered:
            self._answer()
        self.close()


class AcceptErrors:
    """The event loop's handler for a listener's accept() failing for want of a descriptor
    (EMFILE and kin). asyncio then pauses that listener for a second and logs a traceback (on
    Python 3.11, up to its backlog of them per loop turn); this counts them instead, logged
    once a second, and answers what waits in the listener's queue with a 503 on the spare
    descriptor, rather than leave /health and the rest hanging there. Other errors go to the
    handler there was before."""

    MESSAGE = "socket.accept() out of system resource"  # asyncio's (selector_events.py)
    ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
    spare: int | None = None  # one per process, whatever its loops

    def __init__(self, previous: Callable | None) -> None:
        self.previous = previous
        self.answered = 0  # since the last report
        self.failures = Tally(self._report)
        self.last_error = ""

    @classmethod
    def install(cls, loop: asyncio.AbstractEventLoop) -> None:
        if cls.spare is None:
            cls.spare = _open_spare()
        current = loop.get_exception_handler()
        if not isinstance(getattr(current, "__self__", None), cls):
            loop.set_exception_handler(cls(current).handle)

    def handle(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if (
            context.get("message") != self.MESSAGE
            or not isinstance(exc, OSError)
            or exc.errno not in self.ERRNOS
        ):
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.last_error = os.strerror(exc.errno)
        self.failures.add()
        listener = context.get("socket")
        if listener is not None:
            self.answered += self._answer_waiting(listener.fileno())

    def _answer_waiting(self, fd: int) -> int:
        cls = type(self)
        if cls.spare is None:
            cls.spare = _open_spare()
            if cls.spare is None:
                return 0
        os.close(cls.spare)
        cls.spare = None
        listener = socket.socket(fileno=fd)  # the listener itself: a dup would need a descriptor
        n = 0
        try:
            listener.setblocking(False)
            while n < DRAIN_AT_ONCE:
                try:
                    conn, _ = listener.accept()
                except OSError:  # none waiting, or no descriptor after all
                    break
                with conn:
                    _answer_busy(conn)
                n += 1
        finally:
            listener.detach()
            cls.spare = _open_spare()
        return n

    def _report(self, n: int) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        log.warning(
            "accept failed %d times in the last second: %s (open files limit %d); %d waiting "
            "connections answered 503",
            n,
            self.last_error,
            soft,
            self.answered,
        )
        self.answered = 0


def _open_spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY)
    except OSError:
        return None


def _answer_busy(conn: socket.socket) -> None:
    """A 503 on a connection taken from the queue. Its request, if it came, is read first, so
    the close sends FIN rather than RST (which can cost the client the answer)."""
    conn.setblocking(False)
    with contextlib.suppress(OSError):
        conn.recv(65536)
    with contextlib.suppress(OSError):
        conn.send(BUSY)
