"""Vidur's side of `fairway bench-vidur`, run by .venv-vidur's Python (it imports no Fairway).

    python -P simulator/bench/vidur_side.py generate OUT.csv -- VIDUR_ARGS...
    python -P simulator/bench/vidur_side.py run PREDICTIONS_DIR -- VIDUR_ARGS...

`generate` writes the requests Vidur's own request generator makes (arrival, prompt and output
tokens) as a trace-replay table (Time, PromptTokenCount, CompletionTokenCount), the format its
`trace_replay` generator reads back. `run` simulates with Vidur's CLI arguments and prints one
JSON line: requests, the simulation loop's CPU seconds (Simulator.run without writing metrics)
and the setup's. Vidur downloads its execution-time predictions from a hub at start; `run` hands
it the tables under PREDICTIONS_DIR (compute/ and network/, one `OP.csv.xz` each) instead, so
that no network is needed and both simulators price a step with the same hardware model.
(-P: this folder holds vidur.py, which must not shadow the package.)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

TRACE_DATE = "2023-08-21"  # trace_replay keeps one day's rows; every exported row carries it


def _config(args: list[str]):
    from vidur.config import SimulationConfig

    sys.argv = ["vidur", *args]
    return SimulationConfig.create_from_cli_args()


def generate(out: Path, args: list[str]) -> None:
    from vidur.request_generator import RequestGeneratorRegistry

    config = _config(args).request_generator_config
    requests = RequestGeneratorRegistry.get(config.get_type(), config).generate()
    with out.open("w") as f:
        f.write("Date,Time,PromptTokenCount,CompletionTokenCount\n")
        for r in requests:
            f.write(f"{TRACE_DATE},{r.arrived_at!r},{r.num_prefill_tokens},{r.num_decode_tokens}\n")


def run(predictions: Path, args: list[str]) -> None:
    from vidur.execution_time_predictor import sklearn_execution_time_predictor as predictor
    from vidur.simulator import Simulator

    def local_tables(repo_id: str, repo_type: str, cache_dir: str) -> str:
        return str(predictions / ("network" if "/network/" in cache_dir else "compute"))

    predictor.snapshot_download = local_tables
    started = time.process_time()
    simulator = Simulator(_config(args))
    setup = time.process_time() - started
    arrivals = len(simulator._event_queue)  # one arrival event per request, before the run
    write_output, written = simulator._write_output, [0.0]

    def timed_write() -> None:
        began = time.process_time()
        write_output()
        written[0] = time.process_time() - began

    simulator._write_output = timed_write
    started = time.process_time()
    simulator.run()
    loop = time.process_time() - started - written[0]
    print(json.dumps({"requests": arrivals, "loop_cpu": loop, "setup_cpu": setup,
                      "output_cpu": written[0], "simulated_s": simulator._time}))  # fmt: skip


if __name__ == "__main__":
    mode, target, rest = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    rest = rest[1:] if rest[:1] == ["--"] else rest
    (generate if mode == "generate" else run)(target, rest)
