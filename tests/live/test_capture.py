"""The proxy's recording as a replayable trace: format, rotation, replay."""

from __future__ import annotations

from pathlib import Path

from router.cost_model import roofline
from router.proxy.capture import TraceCapture
from router.request import Request, hash_token_blocks
from simulator.config import SimConfig
from simulator.driver import simulate
from traces.loaders import load_trace
from traces.recording import TRACE_FILE, recorded_parts


def request(i: int, tokens: list[int], client: str = "a") -> Request:
    return Request(i, 0.0, len(tokens), 8, hash_token_blocks(tokens, 16), client=client)


def test_recording_round_trips_and_holds_no_prompt_text(tmp_path: Path) -> None:
    capture = TraceCapture(tmp_path, block_size=16, policy="lpm")
    secret = list(range(7000, 7064))  # the prompt's token ids
    capture.write(request(3, secret, "tenant-a"), arrival=1.5, output_tokens=5, worker=1)
    capture.write(request(4, secret + [1] * 16), arrival=2.0, output_tokens=9, worker=0,
                  session="s1")  # fmt: skip
    capture.close()
    text = (tmp_path / TRACE_FILE).read_text()
    assert "7000" not in text and "7063" not in text
    trace = load_trace(tmp_path)  # the folder: every part kept
    assert [r.id for r in trace.requests] == [3, 4]
    assert trace.requests[0].arrival == 0.0 and trace.requests[1].arrival == 0.5
    assert trace.requests[1].session == "s1" and trace.requests[0].client == "tenant-a"
    assert trace.requests[1].output_len == 9 and trace.requests[1].num_blocks == 5
    assert trace.meta["served_by"] == {3: 1, 4: 0} and trace.meta["policy"] == "lpm"
    assert load_trace(tmp_path / TRACE_FILE).meta["served_by"] == {3: 1, 4: 0}


def test_rotation_bounds_the_recording(tmp_path: Path) -> None:
    capture = TraceCapture(tmp_path, block_size=16, policy="vtc", max_file_bytes=8192, keep=2)
    tokens = list(range(512))
    for i in range(200):
        capture.write(request(i, tokens), arrival=float(i), output_tokens=4, worker=i % 2)
    capture.close()
    parts = recorded_parts(tmp_path)
    assert len(parts) == 2, "only the newest `keep` rotated parts stay"
    sizes = [p.stat().st_size for p in [*parts, tmp_path / TRACE_FILE]]
    assert all(size <= 8192 for size in sizes)
    trace = load_trace(tmp_path)
    ids = [r.id for r in trace.requests]
    assert ids == sorted(ids) and ids[-1] == 199 and len(ids) < 200


def test_a_recording_replays_in_the_simulator(tmp_path: Path) -> None:
    capture = TraceCapture(tmp_path, block_size=16, policy="least_load")
    doc = list(range(1000, 1000 + 16 * 40))
    for i in range(30):
        capture.write(request(i, doc + [i] * 16, f"c{i % 3}"), 0.2 * i, 16, worker=i % 2)
    capture.close()
    result = simulate(load_trace(tmp_path), roofline("llama-3-8b", "a100-80g"),
                      SimConfig(num_workers=2, policy="least_load"))  # fmt: skip
    assert result.summary["completed"] == 30
    assert result.summary["prefix_cache"]["hit_rate"] > 0.5  # the shared document


def test_live_traffic_replays_to_the_same_decisions_and_hit_rate(tmp_path: Path) -> None:
    """Record what the proxy served (emulated workers: the simulator's engine in wall-clock
    time, 20x faster), replay the recording in the simulator under the same policy with time
    stretched back 20x: the same worker for every request, the same hit rate."""
    import csv

    from tests.live_helpers import BLOCK, client, emulated_workers, proxy, run
    from traces.transform import scale_time

    async def go() -> None:
        async with (
            emulated_workers(2, speed=20) as urls,
            proxy(urls, "lpm", record_dir=str(tmp_path)) as (base, _),
        ):
            oa = client(base)
            for i in range(24):  # one at a time: decisions hang on the index, not on timing
                doc = f"document {i % 3} " * 200
                await oa.completions.create(
                    model="tiny",
                    prompt=doc + f"question {i}",
                    max_tokens=4,
                    extra_headers={"X-Client-Id": f"team-{i % 2}", "X-Session-Id": f"s{i % 3}"},
                )

    run(go)
    trace = load_trace(tmp_path)
    assert len(trace) == 24 and trace.block_size == BLOCK
    assert {r.session for r in trace.requests} == {"s0", "s1", "s2"}
    served = trace.meta["served_by"]
    rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
    live_hit = sum(int(r["cached_tokens"]) for r in rows) / sum(
        int(r["prompt_tokens"]) for r in rows
    )

    config = SimConfig(num_workers=2, policy="lpm", placement="router", window=8)
    result = simulate(scale_time(trace, 20.0), roofline("llama-3-8b", "a100-80g"), config)
    simulated = {rec.id: rec.worker for rec in result.records}
    assert simulated == served, "the simulator routed the recording as the proxy did"
    assert abs(result.summary["prefix_cache"]["hit_rate"] - live_hit) <= 0.02
    assert live_hit > 0.5

    # What would other policies have done with this traffic? The report shows the live run too.
    from router.cli import main

    out = tmp_path / "compare"
    argv = ["compare", "--trace", str(tmp_path), "--time-scale", "20", "--workers", "2",
            "--placement", "router", "--policies", "lpm,round_robin",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = (out / "report.md").read_text()
    assert f"{tmp_path.name} (live)" in report and "round_robin" in report
