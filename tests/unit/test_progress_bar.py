"""The progress bar's pieces (simulator.progress): off when stderr is not a terminal; one bar per
command, which runs in this process feed request by request and runs in a pool advance as each
returns."""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from simulator import progress


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal and keeps what was drawn."""

    def isatty(self) -> bool:
        return True


def last_bar(screen: str) -> str:
    """The bar's last state (tqdm redraws its line after carriage returns)."""
    drawn = [part for part in re.split(r"[\r\n]", screen) if part.strip()]
    assert drawn, "nothing was drawn"
    return drawn[-1]


@contextmanager
def on_a_terminal() -> Iterator[_Terminal]:
    """stderr as a terminal, inside the test (pytest sets its own capture back between a
    fixture's setup and the test)."""
    screen, saved = _Terminal(), sys.stderr
    sys.stderr = screen
    try:
        yield screen
    finally:
        sys.stderr = saved


class TestOffWhenNotATerminal:
    def test_a_command_bar_draws_nothing_on_a_pipe(self, capsys) -> None:
        assert not sys.stderr.isatty()  # pytest captures it
        with progress.command_bar("compare", num_runs=2) as bar:
            assert not bar.enabled
            run = progress.RunProgress("lpm", 1000, show=False)
            for t in range(1000):
                run.request_done(float(t))
            run.close(1000.0)
            bar.run_done(1000, 5.0)
        assert capsys.readouterr().err == ""

    def test_a_run_alone_draws_only_when_asked(self) -> None:
        with on_a_terminal() as terminal:
            run = progress.RunProgress("lpm", 10, show=False)
            assert not run.enabled
            run.close(1.0)
        assert terminal.getvalue() == ""


class TestOneBarOverACommandsRuns:
    def test_runs_in_this_process_feed_the_command_bar(self) -> None:
        with on_a_terminal() as terminal, progress.command_bar("demo", num_runs=2):
            for _ in range(2):
                run = progress.RunProgress("lpm", 300, show=False)  # its own would be off
                assert run.enabled, "a run inside a command draws on the command's bar"
                for t in range(300):
                    run.request_done(float(t))
                run.close(1234.5)
        bar = last_bar(terminal.getvalue())
        assert bar.startswith("demo:"), bar
        assert "600req" in bar and "runs 2/2" in bar and "simulated 1,234 s" in bar, bar
        assert progress.current() is None, "the command's bar closes with the command"

    def test_a_run_alone_has_its_own_bar_without_runs(self) -> None:
        with on_a_terminal() as terminal:
            run = progress.RunProgress("lpm", 600, show=True)
            for t in range(600):
                run.request_done(float(t))
            run.close(600.0)
        bar = last_bar(terminal.getvalue())
        assert bar.startswith("lpm:") and "600/600" in bar and "simulated 600 s" in bar, bar
        assert "runs" not in bar, bar

    def test_runs_returning_from_a_pool_advance_it(self) -> None:
        def run(name: str, total: int) -> tuple[str, dict]:
            return name, {"total": total, "simulated_seconds": 7.0}

        with (
            on_a_terminal() as terminal,
            progress.command_bar("compare", num_runs=3),
            ThreadPoolExecutor(2) as pool,
        ):
            got = progress.map_runs(
                pool, run, ["a", "b", "c"], [1, 2, 3], counts=progress.summary_counts
            )
        assert [name for name, _ in got] == ["a", "b", "c"], "results in the order given"
        bar = last_bar(terminal.getvalue())
        assert "6req" in bar and "runs 3/3" in bar and "simulated 7 s" in bar, bar

    def test_a_failed_run_is_raised_as_pool_map_raises_it(self) -> None:
        def run(n: int) -> tuple[int, dict]:
            if n == 2:
                raise ValueError("run 2 failed")
            return n, {"total": 1, "simulated_seconds": 1.0}

        with (
            on_a_terminal(),
            progress.command_bar("plan"),
            ThreadPoolExecutor(2) as pool,
            pytest.raises(ValueError, match="run 2"),
        ):
            progress.map_runs(pool, run, [1, 2, 3], counts=progress.summary_counts)

    def test_printed_lines_go_above_the_bar(self) -> None:
        shown, saved = _Terminal(), sys.stdout
        sys.stdout = shown
        try:
            with on_a_terminal() as terminal, progress.command_bar("demo") as bar:
                bar.run_done(10, 1.0)
                print("a table row")
        finally:
            sys.stdout = saved
        assert shown.getvalue() == "a table row\n", "what is printed is unchanged"
        assert "10req" in last_bar(terminal.getvalue()), "the bar is drawn again after the row"
