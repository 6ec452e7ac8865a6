"""A long simulation's progress bar: requests done beside the simulated clock."""

from __future__ import annotations

from pathlib import Path

from router.cost_model import roofline
from simulator.driver import SimConfig, simulate
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
