"""A run's records kept as columns: the same records, rows and summary as the records kept
one by one."""

from __future__ import annotations

import gc
import random
from pathlib import Path

from router.cost_model import roofline
from router.records import RecordWriter, RequestRecord
from router.request import Request
from simulator.columns import RecordColumns, RecordLog
from simulator.config import SimConfig
from simulator.driver import SimCluster
from simulator.results import summarize, write_results
from traces.generators import shared_prefix
from traces.transform import tile


def random_record(rng: random.Random, id: int) -> RequestRecord:
    arrival = rng.uniform(0, 100)
    admitted = arrival + rng.expovariate(2.0)
    first = admitted + rng.expovariate(10.0)
    split = rng.random() < 0.3
    return RequestRecord(
        id=id,
        client=f"c{rng.randrange(5)}",
        session=rng.choice([None, f"s{rng.randrange(50)}#3"]),
        worker=rng.randrange(16),
        arrival=arrival,
        admitted=admitted,
        first_token=first,
        finish=first + rng.expovariate(0.5),
        prompt_tokens=rng.randrange(1, 50_000),
        cached_tokens=rng.randrange(0, 512) * 16,
        output_tokens=rng.randrange(1, 900),
        preemptions=rng.randrange(3),
        weight=rng.choice([1.0, 0.5, 3.0]),
        priority=rng.randrange(3),
        predicted_ttft=rng.choice([None, rng.uniform(0, 2)]),
        prefill_worker=rng.randrange(4) if split else None,
        kv_transfer=rng.uniform(0, 0.1) if split else None,
        api=rng.choice([None, "chat", "responses", "messages"]),
    )


def test_a_log_gives_back_its_records_by_id_across_chunks() -> None:
    rng = random.Random(7)
    records = [random_record(rng, id) for id in range(10_000)]  # more than two chunks
    shuffled = records[:]
    rng.shuffle(shuffled)  # completion order
    log = RecordLog()
    for r in shuffled:
        log.add(tuple(getattr(r, name) for name in RequestRecord.__dataclass_fields__))
    assert len(log) == len(records)
    cols = log.columns()
    assert cols.records() == records
    assert RecordColumns(records).records() == records
    assert RecordLog().columns().records() == []


def test_rows_write_the_csv_the_records_write(tmp_path: Path) -> None:
    rng = random.Random(3)
    records = [random_record(rng, id) for id in range(5_000)]
    writer = RecordWriter(tmp_path / "one-by-one.csv")
    for r in records:
        writer.write(r)
    writer.close()
    write_results(tmp_path / "cols", {}, RecordColumns(records))
    assert (tmp_path / "cols" / "requests.csv").read_bytes() == (
        tmp_path / "one-by-one.csv"
    ).read_bytes()


def test_a_summary_reads_the_same_from_either() -> None:
    rng = random.Random(5)
    records = [random_record(rng, id) for id in range(3_000)]
    kwargs = dict(total=3_000, cache_bound=0.5, simulated_seconds=100.0, wall_seconds=1.0,
                  config={})  # fmt: skip
    assert summarize(records, [], **kwargs) == summarize(RecordColumns(records), [], **kwargs)  # type: ignore[arg-type]


def test_a_run_over_a_tiled_trace_holds_only_the_requests_in_flight() -> None:
    """What keeps a million-request replay in memory: neither the tiled trace nor the run
    holds a request before it arrives or after its answer."""

    def live_requests() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is Request)

    class Sampled(SimCluster):
        arrived, finished, beyond = 0, 0, 0  # beyond: the most live requests not in flight

        def dispatch(self, req, rerouted=False):  # type: ignore[no-untyped-def]
            self.arrived += not rerouted
            super().dispatch(req, rerouted)

        def on_finish(self, seq, now):  # type: ignore[no-untyped-def]
            super().on_finish(seq, now)
            self.finished += 1
            if self.finished % 100 == 0:
                in_flight = self.arrived - self.finished
                self.beyond = max(self.beyond, live_requests() - in_flight)

    # Arrivals spread over the run (8 workers keep up), so a run that held what it read would
    # hold most of the trace at each sample.
    trace = tile(shared_prefix(num_requests=100, rate=1.0), 20)
    originals = live_requests()  # (the run freezes them: then they are not counted)
    cluster = Sampled(trace, roofline("llama-3-8b", "h100"), SimConfig(num_workers=8))
    result = cluster.run()
    assert len(result.columns) == len(trace) == 2_000 and cluster.finished == 2_000
    # A few more are in hand (the one arriving, the last read by a compiled loop's frame).
    assert cluster.beyond <= originals + 8, "the originals, those in flight, a few in hand"
    assert live_requests() <= originals
