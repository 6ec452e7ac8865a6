"""Whose trouble a failed check is: the dependency's, or this process's own.

A watcher asks a dependency whether it is alive (a worker's /health, Ray's GCS, the replicas'
store, a KV-event feed). When the asking fails, either the dependency failed it, or this
process never really asked:

    the dependency's ... refused, reset, unreachable, or silent past the check's timeout:
                         a miss, which may count towards calling it down
    this process's ..... it could not even try: out of descriptors (EMFILE, ENFILE) or memory
                         (ENOMEM, ENOBUFS), its executor full, its event loop stalled for
                         most of the check's time: never a miss; logged and waited out

Counting the second kind as the first is how a flood of connections (a stranger's, at that)
once made the proxy declare Ray gone and stop itself for good. `own_trouble` tells the two
apart; `TroubleLog` says the second at most once per interval, with a count; `StallClock`
tells whether a timeout was the loop's own lateness.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

DESCRIPTORS, MEMORY, EXECUTOR, LOOP_STALL = "descriptors", "memory", "executor", "loop_stall"
CAUSES = (DESCRIPTORS, MEMORY, EXECUTOR, LOOP_STALL)

OWN_ERRNOS = {
    errno.EMFILE: DESCRIPTORS,  # this process's open-files limit
    errno.ENFILE: DESCRIPTORS,  # the system's
    errno.ENOMEM: MEMORY,
    errno.ENOBUFS: MEMORY,  # the kernel's socket buffers
}
REPORT_EVERY = 10.0  # seconds between a watcher's lines about its own trouble


def own_errno(code: int | None) -> str | None:
    """The cause, if `code` (an errno) says this process could not even try; else None."""
    return OWN_ERRNOS.get(code) if code is not None else None


def own_trouble(exc: BaseException | None) -> str | None:
    """Why this process could not even try, if `exc` (or an exception it was raised from or
    while handling: libraries wrap the OSError) says so: DESCRIPTORS, MEMORY or EXECUTOR.
    None when the failure is the dependency's, or not a failure to try at all."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and (cause := own_errno(exc.errno)) is not None:
            return cause
        if isinstance(exc, MemoryError):
            return MEMORY
        if isinstance(exc, (asyncio.QueueFull, queue.Full)):
            return EXECUTOR
        if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
            return EXECUTOR
        exc = exc.__cause__ or exc.__context__
    return None


class TroubleLog:
    """One watcher's checks that this process could not make. The first after a quiet spell
    is logged at once; the rest at most once per `every` seconds, with their count; and once
    the watcher can try again, what was not yet said. Nothing here counts as the dependency's
    failure. Safe from any thread (the GCS watch has its own)."""

    def __init__(
        self,
        watcher: str,
        logger: logging.Logger,
        every: float = REPORT_EVERY,
        counted: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.watcher, self.log, self.every, self.clock = watcher, logger, every, clock
        self.counted = counted or (lambda cause: None)  # a metric, per check not made
        self.total = 0  # every check not made, ever
        self.pending = 0  # since the last line
        self.last_cause, self.last_detail = "", ""
        self._said: float | None = None  # when the last line was written, while in trouble
        self._lock = threading.Lock()

    @property
    def in_trouble(self) -> bool:
        return self._said is not None

    def add(self, cause: str, detail: str) -> None:
        """A check this process could not make, because of `cause`; `detail` says how."""
        self.counted(cause)
        with self._lock:
            self.total += 1
            self.pending += 1
            self.last_cause, self.last_detail = cause, detail
            now = self.clock()
            if self._said is not None and now - self._said < self.every:
                return
            first = self._said is None
            n, self.pending, self._said = self.pending, 0, now
        if first:
            self.log.warning(
                "%s: could not even try (%s: %s); this process's trouble, not counted against "
                "what it watches",
                self.watcher,
                cause,
                detail,
            )
        else:
            self._report(n, cause, detail)

    def clear(self) -> None:
        """The watcher could try again: say what was not said yet, and that it is over."""
        with self._lock:
            if self._said is None:
                return
            n, cause, detail = self.pending, self.last_cause, self.last_detail
            self.pending, self._said = 0, None
        if n:
            self._report(n, cause, detail)
        self.log.warning("%s: checking again", self.watcher)

    def _report(self, n: int, cause: str, detail: str) -> None:
        self.log.warning(
            "%s: %d more checks not made (%s: %s), %d in all; none counted against what it watches",
            self.watcher,
            n,
            cause,
            detail,
            self.total,
        )


class StallClock:
    """How late an event loop has run lately, from a sampler that sleeps a short period again
    and again and reports how late each wake-up came (`observe`). A check that timed out while
    the loop itself was late for most of its time was not the dependency's silence."""

    def __init__(
        self,
        horizon: float = 30.0,
        least: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.horizon = horizon  # seconds of wake-ups kept: longer than any check's timeout
        self.least = least  # lateness below this is noise, and not kept
        self._late: deque[tuple[float, float]] = deque()  # (when the wake-up came, how late)

    def observe(self, lateness: float) -> None:
        now = self.clock()
        if lateness >= self.least:
            self._late.append((now, lateness))
        while self._late and self._late[0][0] < now - self.horizon:
            self._late.popleft()

    def late_since(self, start: float) -> float:
        """Seconds the loop ran late in wake-ups that came after `start` (this clock's)."""
        return sum(late for when, late in self._late if when > start)

    def explains(self, start: float, timeout: float) -> bool:
        """Whether a check begun at `start` that timed out after `timeout` seconds spent at
        least half of them waiting on this loop rather than on the dependency."""
        return self.late_since(start) >= timeout / 2
