"""The Vidur comparison's request exchange: Vidur's trace-replay table to Fairway's trace and back,
and the step-time tables Vidur reads, checked without Vidur installed."""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest

from router.cost_model import StepShape, roofline
from router.request import Request
from simulator.bench.vidur import (
    prediction_tables,
    read_vidur_requests,
    write_vidur_requests,
)
from traces.loaders import load_trace
from traces.schema import Trace, write_native

TABLE = """\
Date,Time,PromptTokenCount,CompletionTokenCount
2023-08-21,0.5,812,64
2023-08-21,0.75,95,12
2023-08-21,0.625,4096,1
"""


def test_vidur_table_becomes_a_native_trace(tmp_path: Path) -> None:
    table = tmp_path / "requests.csv"
    table.write_text(TABLE)
    trace = read_vidur_requests(table)
    # Sorted by arrival, rebased to the first, ids kept from the table's rows.
    assert [(r.id, r.arrival, r.prompt_len, r.output_len) for r in trace.requests] == [
        (0, 0.0, 812, 64),
        (2, 0.125, 4096, 1),
        (1, 0.25, 95, 12),
    ]
    assert all(r.block_hashes == [] for r in trace.requests)
    native = tmp_path / "requests.jsonl"
    write_native(trace, native)
    loaded = load_trace(native)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in loaded.requests] == [
        (0.0, 812, 64),
        (0.125, 4096, 1),
        (0.25, 95, 12),
    ]


def test_fairway_trace_round_trips_through_the_table(tmp_path: Path) -> None:
    trace = Trace([Request(0, 0.0, 100, 7), Request(1, 0.1 + 0.2, 3000, 250)])
    table = tmp_path / "requests.csv"
    write_vidur_requests(trace, table)
    back = read_vidur_requests(table)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in back.requests] == [
        (0.0, 100, 7),
        (0.1 + 0.2, 3000, 250),  # arrivals written exactly
    ]
    assert table.read_text().splitlines()[0] == "Date,Time,PromptTokenCount,CompletionTokenCount"


def _table(path: Path) -> dict[tuple[int, ...], float]:
    with lzma.open(path, "rt") as f:
        next(f)
        rows = [line.strip().split(",") for line in f]
    return {tuple(int(x) for x in row[:-1]): float(row[-1]) for row in rows}


def test_prediction_tables_add_up_to_the_roofline(tmp_path: Path) -> None:
    cost = roofline("llama-3-8b", "a100-80g")
    prediction_tables(cost, tmp_path, max_context=512)
    ops = {p.name.removesuffix(".csv.xz"): _table(p) for p in (tmp_path / "compute").iterdir()}
    layers = cost.model.num_layers
    # A decode step of 8 sequences over 256 tokens each, as Vidur composes it (ms per layer).
    per_layer = ops["mlp_up_proj"][(8,)] + ops["attn_decode"][(8, 256)] + ops["add"][(8,)]
    expected = cost.step_time(StepShape(8, 8 * 256, 8 * 256, 8))
    assert per_layer * layers / 1000 == pytest.approx(expected)
    # A 512-token chunk after 256 cached tokens.
    per_layer = ops["mlp_up_proj"][(512,)] + ops["attn_prefill"][(256, 512)]
    expected = cost.step_time(StepShape.prefill(512, 256))
    assert per_layer * layers / 1000 == pytest.approx(expected)
