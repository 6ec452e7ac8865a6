"""The progress bar of every command that simulates: requests done (of the total, when known),
requests per second, runs done, and the simulated clock, on stderr, drawn only when stderr is a
terminal (piped or under test, nothing is written).

    compare:  40%|████      | 2400/6000 [00:03<00:04, 790.12req/s, runs 2/5, simulated 1,234 s]

A command opens one bar over all its runs (`command_bar`). A simulation in the same process feeds
it request by request (`RunProgress`, from SimCluster.run); runs in worker processes advance it
as each returns (`map_runs`). A simulation with no command bar open (`fairway simulate`) draws a
bar of its own when its config asks for one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, wait
from contextlib import contextmanager, redirect_stdout
from typing import TextIO, TypeVar

from tqdm import tqdm


class _Tqdm(tqdm):
    """tqdm without its monitor thread: a thread waking in a simulation's process for a bar
    that redraws by itself anyway."""

    monitor_interval = 0


T = TypeVar("T")

# Requests a run counts before it moves the bar: a call per request costs the run's speed, and
# tqdm redraws at most every `mininterval` seconds anyway.
EVERY = 256


class Bar:
    """One tqdm bar counting requests, with runs done (`num_runs` of them, when a command runs
    several) and the latest simulated clock beside it."""

    def __init__(
        self,
        desc: str,
        *,
        total: int | None = None,
        num_runs: int | None = None,
        counts_runs: bool = False,
        enabled: bool | None = None,
    ) -> None:
        shown = sys.stderr.isatty() if enabled is None else enabled
        # None when off: even disabled, a tqdm makes its multiprocessing lock, and that import
        # was 7 ms of every simulation's process.
        self._tqdm = (
            _Tqdm(desc=desc, total=total, unit="req", mininterval=0.5, file=sys.stderr)
            if shown
            else None
        )
        self.num_runs = num_runs
        self.counts_runs = counts_runs or num_runs is not None
        self.runs_done = 0
        self.simulated: float | None = None
        self.pid = os.getpid()  # a forked worker inherits the bar but must not draw it

    @property
    def enabled(self) -> bool:
        return self._tqdm is not None

    def advance(self, num_requests: int, simulated_seconds: float | None) -> None:
        """`num_requests` more done; the simulated clock of the run they belong to."""
        if self._tqdm is None:
            return
        if simulated_seconds is not None:
            self.simulated = simulated_seconds
        self._tqdm.set_postfix_str(self.postfix, refresh=False)
        self._tqdm.update(num_requests)

    def run_done(self, num_requests: int, simulated_seconds: float | None) -> None:
        """A run finished: its requests not yet counted, and the clock it ended at."""
        self.runs_done += 1
        self.advance(num_requests, simulated_seconds)

    @property
    def postfix(self) -> str:
        parts = []
        if self.counts_runs:
            of = "" if self.num_runs is None else f"/{self.num_runs}"
            parts.append(f"runs {self.runs_done}{of}")
        if self.simulated is not None:
            parts.append(f"simulated {self.simulated:,.0f} s")
        return ", ".join(parts)

    def clear(self) -> None:
        if self._tqdm is not None:
            self._tqdm.clear()

    def refresh(self) -> None:
        if self._tqdm is not None:
            self._tqdm.refresh()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()


_command: Bar | None = None  # the bar of the command running in this process


def current() -> Bar | None:
    """The command's bar, if one is open in this process (not in a forked worker)."""
    if _command is not None and _command.pid == os.getpid():
        return _command
    return None


class _AboveBar:
    """Standard output while a bar is drawn on the same terminal: the bar is cleared before each
    write and redrawn after each finished line, so printed lines are never torn."""

    def __init__(self, out: TextIO, bar: Bar) -> None:
        self._out = out
        self._bar = bar

    def write(self, text: str) -> int:
        self._bar.clear()
        written = self._out.write(text)
        if text.endswith("\n"):
            self._out.flush()
            self._bar.refresh()
        return written

    def __getattr__(self, name: str) -> object:
        return getattr(self._out, name)


@contextmanager
def command_bar(
    desc: str, *, num_runs: int | None = None, total: int | None = None
) -> Iterator[Bar]:
    """One bar over all of a command's runs, open while the command runs. Off when stderr is not
    a terminal; when stdout is the same terminal, what the command prints goes above the bar."""
    global _command
    bar = Bar(desc, total=total, num_runs=num_runs, counts_runs=True)
    outer, _command = _command, bar
    try:
        if bar.enabled and sys.stdout.isatty():
            with redirect_stdout(_AboveBar(sys.stdout, bar)):  # type: ignore[arg-type,type-var]
                yield bar
        else:
            yield bar
    finally:
        _command = outer
        bar.close()


class RunProgress:
    """One simulation's requests on the command's bar, or on a bar of its own (`show`: whether
    to draw that one) when no command bar is open."""

    def __init__(self, desc: str, total: int, show: bool) -> None:
        outer = current()
        self._own = outer is None
        self.bar = Bar(desc, total=total, enabled=show) if outer is None else outer
        self.enabled = self.bar.enabled
        self._pending = 0

    def request_done(self, now: float) -> None:
        """One more request done (finished or refused) at simulated time `now`."""
        self._pending += 1
        if self._pending >= EVERY:
            self.bar.advance(self._pending, now)
            self._pending = 0

    def close(self, now: float) -> None:
        """The run ended at simulated time `now`."""
        if self._own:
            self.bar.advance(self._pending, now)
            self.bar.close()
        else:
            self.bar.run_done(self._pending, now)
        self._pending = 0


def summary_counts(result: tuple[object, dict]) -> tuple[int, float]:
    """The requests and simulated seconds of a `(run, summary)` a worker returns."""
    summary = result[1]
    return int(summary["total"]), float(summary["simulated_seconds"])


def map_runs(
    pool: Executor,
    fn: Callable[..., T],
    *iterables: Iterable[object],
    counts: Callable[[T], tuple[int, float]],
) -> list[T]:
    """`pool.map(fn, *iterables)` as a list, the command's bar advanced as each run returns by
    its `counts` (requests, simulated seconds). The first failure in order is raised, as
    `pool.map` raises it."""
    futures = [pool.submit(fn, *args) for args in zip(*iterables, strict=True)]
    return wait_runs(futures, counts)


def wait_runs(futures: Sequence[Future[T]], counts: Callable[[T], tuple[int, float]]) -> list[T]:
    """The runs' results in order, the command's bar advanced as each returns by its `counts`;
    the first failure in order is raised."""
    bar = current()
    if bar is not None and bar.enabled:
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when="FIRST_COMPLETED")
            for future in done:
                if future.exception() is None:
                    bar.run_done(*counts(future.result()))
    return [future.result() for future in futures]
