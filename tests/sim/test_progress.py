"""A long simulation's progress bar: requests done beside the simulated clock; the commands
that run many simulations show one bar over them all, on a terminal only."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from router.cli import main
from router.cost_model import roofline
from simulator.config import SimConfig
from simulator.driver import simulate
from traces.loaders import load_trace
from traces.transform import limit

SAMPLE = Path(__file__).resolve().parents[2] / "traces/samples/mooncake_conversation_head1000.jsonl"
COST = roofline("llama-3-8b", "a100-80g")


def _run(show_progress: bool) -> None:
    trace = limit(load_trace(SAMPLE), 600)
    simulate(trace, COST, SimConfig(num_workers=4, policy="round_robin",
                                    show_progress=show_progress))  # fmt: skip


class TestProgressBar:
    def test_shows_requests_done_and_simulated_time(self, capsys) -> None:
        _run(show_progress=True)
        err = capsys.readouterr().err
        assert "600/600" in err, f"no final count in the bar: {err[-300:]!r}"
        assert "simulated" in err, f"no simulated clock beside the bar: {err[-300:]!r}"

    def test_silent_when_off(self, capsys) -> None:
        _run(show_progress=False)
        assert capsys.readouterr().err == ""


# A small, fast workload for the commands: short prompts and answers, 500 requests a second.
SMALL = ["--trace", "gen:shared_prefix", "--policy", "round_robin"]
for _setting in ("prefix_tokens=64", "question_tokens=16", "output_tokens=4", "rate=500"):
    SMALL += ["--gen", _setting]


def fairway_on_a_terminal(argv: list[str]) -> str:
    """`fairway argv` run here with stderr on a pseudo-terminal (120 columns): the bar's last
    state (tqdm redraws its line after carriage returns)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    shown = bytearray()

    def read() -> None:  # until every holder of the terminal has closed it (EIO)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 0.2)[0]:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            shown.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    saved = sys.stderr
    sys.stderr = terminal = open(slave, "w", buffering=1)  # noqa: SIM115 (closed below)
    try:
        assert sys.stderr.isatty()
        assert main(argv) == 0
    finally:
        sys.stderr = saved
        terminal.close()
        reader.join(timeout=10)
        os.close(master)
    drawn = [part for part in re.split(r"[\r\n]", shown.decode()) if part.strip()]
    assert drawn, "nothing was drawn on the terminal"
    return drawn[-1]


class TestCommandsOnATerminal:
    def test_simulate_shows_requests_and_the_simulated_clock(self) -> None:
        """Over 5,000 requests: `fairway simulate` draws its bar."""
        bar = fairway_on_a_terminal(["simulate", *SMALL, "--gen", "num_requests=5001"])
        assert "5001/5001" in bar, bar
        assert re.search(r"simulated [\d,]+ s", bar), bar

    def test_compare_shows_one_bar_over_its_runs(self, tmp_path) -> None:
        argv = ["compare", *SMALL, "--gen", "num_requests=300", "--workers", "2", "--out"]
        bar = fairway_on_a_terminal([*argv, str(tmp_path), "--policies", "round_robin,lpm"])
        assert bar.startswith("compare:"), bar
        assert "600req" in bar and "runs 2/2" in bar, bar
        assert re.search(r"simulated [\d,]+ s", bar), bar

    @pytest.mark.parametrize("jobs", ["1", "2"])
    def test_plan_counts_each_candidate(self, jobs: str) -> None:
        """In this process (one job) or in a pool (two): every candidate's requests (the load
        needs 4 workers: 1, 2, 4 and 3 are simulated)."""
        goal = ["--ttft", "1", "--tpot", "0.2", "--max-workers", "4", "--jobs", jobs]
        goal += ["--rate-scale", "4"]
        bar = fairway_on_a_terminal(["plan", *SMALL, "--gen", "num_requests=300", *goal])
        runs = re.search(r"runs (\d+)", bar)
        assert runs is not None and int(runs.group(1)) == 4, bar
        assert f"{300 * int(runs.group(1))}req" in bar, bar
        assert re.search(r"simulated [\d,]+ s", bar), bar


def test_compare_writes_nothing_to_stderr_on_a_pipe(tmp_path, capsys) -> None:
    argv = ["compare", *SMALL, "--gen", "num_requests=200", "--workers", "2"]
    assert main([*argv, "--policies", "round_robin,lpm", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "", f"stderr not empty: {captured.err[-300:]!r}"
    assert "round_robin" in captured.out
