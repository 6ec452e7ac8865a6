"""Fleets of model groups and LoRA adapters in the simulator: native traces that name a model,
an adapter and a cache salt; groups on different GPUs; the engine's adapter slots."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from router.cost_model import roofline
from router.request import Request, cache_root, hash_token_blocks, rekey_blocks
from simulator.config import SimConfig
from simulator.driver import SimCluster, simulate
from simulator.engine import Engine, EngineConfig
from simulator.fleet import ModelGroup, load_fleet
from traces.generators import lora_tenants
from traces.schema import Trace, TraceError, load_native, write_native

BS = 16
COST = roofline("llama-3-8b", "a100-80g")
FLEET_YAML = """
groups:
  - {name: small, workers: 2, model: llama-3-8b, gpu: a100-80g, adapter_slots: 2,
     adapter_load_time: 0.1}
  - {name: big, workers: 2, model: llama-3-70b, gpu: h100, tp: 4}
"""


def write_lines(path: Path, header: dict | None, lines: list[dict]) -> Path:
    with open(path, "w") as f:
        for obj in ([header] if header else []) + lines:
            f.write(json.dumps(obj) + "\n")
    return path


def mixed_lines(n: int = 60) -> list[dict]:
    """Requests for both groups: four shared prompts (by hash id), two adapters on `small`,
    a salt on some of `big`'s."""
    lines = []
    for i in range(n):
        line = {
            "arrival": 0.1 * i,
            "prompt_len": 40 * BS + 3,
            "output_len": 16,
            "block_hashes": [1000 * (i % 4) + k for k in range(40)],
            "client": f"t{i % 3}",
            "model": "small" if i % 2 else "big",
        }
        if i % 2:
            line["adapter"] = f"lora-{i % 3}"
        elif i % 4 == 0:
            line["cache_salt"] = "s1"
        lines.append(line)
    return lines


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[ModelGroup, ...]:
    (tmp_path / "fleet.yaml").write_text(FLEET_YAML)
    return load_fleet(tmp_path / "fleet.yaml").groups


class TestNativeTraceIdentity:
    def test_plain_hashes_are_keyed_under_each_requests_identity(self, tmp_path: Path) -> None:
        lines = [
            {"arrival": 0.0, "prompt_len": 64, "output_len": 2, "block_hashes": [1, 2, 3]},
            {"arrival": 0.1, "prompt_len": 64, "output_len": 2, "block_hashes": [1, 2, 3],
             "adapter": "A"},
            {"arrival": 0.2, "prompt_len": 64, "output_len": 2, "block_hashes": [1, 2, 3],
             "model": "m", "adapter": "A", "cache_salt": "s"},
        ]  # fmt: skip
        trace = load_native(write_lines(tmp_path / "t.jsonl", None, lines))
        base, adapter, all_three = (r.block_hashes for r in trace.requests)
        assert base == [1, 2, 3], "a trace without identities loads unchanged"
        assert adapter == rekey_blocks([1, 2, 3], cache_root(adapter="A"))
        assert all_three == rekey_blocks([1, 2, 3], cache_root("m", "A", "s"))
        assert len({*base, *adapter, *all_three}) == 9
        assert (trace.requests[2].model, trace.requests[2].cache_salt) == ("m", "s")

    def test_written_traces_are_keyed_and_read_back_unchanged(self, tmp_path: Path) -> None:
        tokens = list(range(5 * BS))
        reqs = [
            Request(
                0,
                0.0,
                len(tokens),
                3,
                hash_token_blocks(tokens, BS, cache_root(adapter="A")),
                model="m",
                adapter="A",
                cache_salt="s",
            )  # fmt: skip
        ]
        write_native(Trace(reqs, BS), tmp_path / "t.jsonl")
        header = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
        assert header["keyed"] is True
        back = load_native(tmp_path / "t.jsonl").requests[0]
        assert back == reqs[0]

    @pytest.mark.parametrize(
        ("field", "value", "says"),
        [("adapter", 7, "'adapter'"), ("cache_salt", "", "'cache_salt'"), ("model", [], "'model'")],
    )
    def test_a_bad_field_is_named_with_file_and_line(self, tmp_path, field, value, says) -> None:
        good = {"arrival": 0.0, "prompt_len": 64, "output_len": 2}
        path = write_lines(
            tmp_path / "t.jsonl", {"fairway_trace": 1}, [good, {**good, field: value}]
        )
        with pytest.raises(TraceError, match=rf"t.jsonl:3: field {says}"):
            load_native(path)


class TestFleetConfig:
    def test_an_unknown_gpu_is_named_by_its_field(self, tmp_path: Path) -> None:
        (tmp_path / "f.yaml").write_text(FLEET_YAML.replace("h100", "h900"))
        with pytest.raises(ValueError, match=r"groups\.1\.gpu: unknown 'h900'; choose one of"):
            load_fleet(tmp_path / "f.yaml")

    def test_a_model_that_does_not_fit_names_its_group(self, tmp_path: Path) -> None:
        (tmp_path / "f.yaml").write_text(FLEET_YAML.replace("tp: 4", "tp: 1"))
        with pytest.raises(ValueError, match=r"groups\.1: llama-3-70b does not fit"):
            load_fleet(tmp_path / "f.yaml")

    def test_group_names_must_differ(self, tmp_path: Path) -> None:
        (tmp_path / "f.yaml").write_text(FLEET_YAML.replace("name: big", "name: small"))
        with pytest.raises(ValueError, match=r"groups: group names must differ: 'small'"):
            load_fleet(tmp_path / "f.yaml")


class TestTwoGroupFleet:
    def test_each_request_runs_on_its_groups_gpus(self, tmp_path: Path, fleet) -> None:
        trace = load_native(write_lines(tmp_path / "t.jsonl", None, mixed_lines()))
        model_of = {r.id: r.model for r in trace.requests}
        result = simulate(trace, None, SimConfig(policy="lpm", groups=fleet))
        assert len(result.records) == len(trace), "every request finished"
        assert result.summary["config"]["workers"] == 4
        group_of = {w.id: w.group for w in result.workers}
        assert all(group_of[r.worker] == model_of[r.id] for r in result.records)
        groups = result.summary["model_groups"]
        assert {g: groups[g]["requests"] for g in groups} == {"small": 30, "big": 30}
        assert groups["big"]["ttft"]["p50"] != groups["small"]["ttft"]["p50"]
        small_loads = sum(w.adapter_loads for w in result.workers if w.group == "small")
        assert small_loads == result.summary["adapter_loads"] > 0, "only small has slots"
        assert result.summary["prefix_cache"]["hit_rate"] > 0

    def test_a_model_no_group_serves_is_an_error_before_the_run(self, fleet) -> None:
        trace = Trace([Request(0, 0.0, 64, 2, model="small"), Request(7, 0.1, 64, 2, model="x")])
        with pytest.raises(ValueError, match=r"request 7 names model 'x'.*: small, big"):
            simulate(trace, None, SimConfig(groups=fleet))

    def test_a_request_naming_no_model_is_an_error(self, fleet) -> None:
        trace = Trace([Request(3, 0.0, 64, 2)])
        with pytest.raises(ValueError, match="request 3 names no model"):
            simulate(trace, None, SimConfig(groups=fleet))

    def test_one_group_serves_requests_whatever_model_they_name(self, tmp_path, fleet) -> None:
        trace = load_native(write_lines(tmp_path / "t.jsonl", None, mixed_lines(20)))
        result = simulate(trace, None, SimConfig(groups=fleet[:1]))
        assert len(result.records) == 20 and result.summary["config"]["workers"] == 2


class SlotWatch(SimCluster):
    """A cluster that notes the most adapters any engine held at once (the engine tells its
    listener after every change)."""

    most_resident = 0

    def on_engine_changed(self, engine: Engine) -> None:
        self.most_resident = max(self.most_resident, len(engine.adapters))
        super().on_engine_changed(engine)


def adapter_run(slots: int, load_time: float, **engine: object) -> tuple[Trace, SlotWatch]:
    """The LoRA tenants workload on one worker: 6 adapters, fewer slots."""
    trace = lora_tenants(num_requests=80, num_tenants=6, zipf=0.5, system_tokens=400,
                         question_tokens=50, output_tokens=40, rate=8.0, seed=3)  # fmt: skip
    config = EngineConfig(
        adapter_slots=slots, adapter_load_time=load_time, check_invariants=True, **engine
    )  # type: ignore[arg-type]
    return trace, SlotWatch(trace, COST, SimConfig(num_workers=1, engine=config))


class TestEngineAdapterSlots:
    def test_loads_are_counted_and_slots_never_exceeded(self) -> None:
        trace, cluster = adapter_run(slots=2, load_time=0.05)
        result = cluster.run()
        assert len(result.records) == len(trace)
        assert cluster.most_resident == 2, "never more adapters resident than slots"
        assert result.workers[0].adapter_loads == result.summary["adapter_loads"] > 6
        assert result.workers[0].adapter_loads == cluster.engines[0].adapter_loads

    def test_a_step_with_a_load_takes_load_time_longer(self) -> None:
        tokens = list(range(4 * BS))
        hashes = hash_token_blocks(tokens, BS, cache_root(adapter="A"))
        first = Request(0, 0.0, len(tokens), 1, hashes, adapter="A")
        later = Request(1, 5.0, len(tokens), 1, hashes, adapter="A")  # resident by then
        ttft: dict[float, list[float]] = {}
        for load_time in (0.0, 0.5):
            config = EngineConfig(adapter_slots=1, adapter_load_time=load_time)
            trace = Trace([dataclasses.replace(first), dataclasses.replace(later)], BS)
            records = simulate(trace, COST, SimConfig(num_workers=1, engine=config)).records
            ttft[load_time] = [r.ttft for r in records]
        assert ttft[0.5][0] == pytest.approx(ttft[0.0][0] + 0.5), "the loading step"
        assert ttft[0.5][1] == pytest.approx(ttft[0.0][1]), "no load, no delay"

    def test_nothing_is_lost_under_preemption(self) -> None:
        trace, cluster = adapter_run(slots=2, load_time=0.02, num_kv_blocks=60)
        result = cluster.run()
        assert len(result.records) == len(trace)
        assert cluster.most_resident <= 2
        assert result.summary["preemptions"] > 0, "the small KV preempts"
        assert all(r.output_tokens == q.output_len for r, q in zip(
            result.records, sorted(trace.requests, key=lambda q: q.id), strict=True))  # fmt: skip
