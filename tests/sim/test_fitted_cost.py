"""The fitted step-cost model: what each term prices, recovering known coefficients from
measurements, old profile files, and the engine describing decode steps apart from prefills."""

from __future__ import annotations

import dataclasses
import itertools
import json
import pickle
import random
from pathlib import Path

import pytest

from router.cost_model import FittedCost, Measurement, StepShape, roofline
from router.request import Request
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.engine import EngineConfig
from traces.generators import shared_prefix
from traces.schema import Trace

TRUTH = {"overhead": 0.002, "per_token": 5e-5, "per_decode_seq": 4e-4, "per_pair": 2e-9,
         "per_kv_token": 1e-6, "request_overhead": 0.003}  # fmt: skip


def cost(**terms: float) -> FittedCost:
    """TRUTH with `terms` changed."""
    return FittedCost({**TRUTH, **terms}, 100_000, "t")


def profile_like(truth: FittedCost, seed: int = 0) -> list[Measurement]:
    """What `fairway profile` measures, timed exactly by `truth`: whole prefill requests and
    their steps alone, cold and after a cached prefix, and decode steps of 1 to 16 sequences
    at short and long context."""
    rng = random.Random(seed)
    prefills = [StepShape.prefill(rng.randint(1, 4000), rng.choice((0, rng.randint(1, 4000))))
                for _ in range(20)]  # fmt: skip
    out = [Measurement(s, truth.step_time(s) + truth.request_overhead, True) for s in prefills]
    out += [Measurement(s, truth.step_time(s), False) for s in prefills[::2]]
    decodes = [StepShape.decode(b, b * c) for b in (1, 2, 4, 8, 16) for c in (56, 1048)]
    return out + [Measurement(s, truth.step_time(s), False) for s in decodes]


class TestTerms:
    def test_prefill_tokens_and_decoding_sequences_are_priced_apart(self) -> None:
        c = cost()
        shape = StepShape(num_tokens=100 + 8, attention_pairs=5000.0, kv_read_tokens=900,
                          num_decode_seqs=8)  # fmt: skip
        expected = 0.002 + 100 * 5e-5 + 8 * 4e-4 + 5000 * 2e-9 + 900 * 1e-6
        assert c.step_time(shape) == pytest.approx(expected, rel=1e-12)

    def test_the_router_s_estimates_use_the_right_terms(self) -> None:
        c = cost(per_pair=0.0, per_kv_token=0.0)
        assert c.prefill_time(512, 1024) == pytest.approx(0.002 + 512 * 5e-5), "no decode term"
        assert c.decode_time(8, 4000) == pytest.approx(0.002 + 8 * 4e-4), "no prefill term"
        reads_only = cost(per_decode_seq=0.0, per_pair=0.0)
        assert reads_only.decode_time(8, 4000) == pytest.approx(0.002 + 4000 * 1e-6), "KV reads"

    def test_a_run_of_decode_steps_equals_its_steps_one_by_one(self) -> None:
        c = cost()
        times = c.decode_step_times(7, 12_345, 50)
        assert times == [c.step_time(StepShape.decode(7, 12_345 + 7 * j)) for j in range(50)]
        ends = c.run_ends(2.0, 0.5, 7, 12_345, 50)
        expected = list(itertools.accumulate([0.5, *times], initial=2.0))[1:]
        assert [ends.end(i) for i in range(ends.count)] == expected
        assert (ends.last, ends.shortest) == (expected[-1], min(times))

    def test_a_shape_without_decodes_is_all_prefill(self) -> None:
        assert StepShape(16, 10.0, 20) == StepShape(16, 10.0, 20, 0)
        assert StepShape.decode(4, 400).num_prefill_tokens == 0
        assert StepShape.prefill(64, 128).num_decode_seqs == 0


class TestFit:
    def test_recovers_the_coefficients_that_made_the_measurements(self) -> None:
        for per_decode_seq in (4e-4, 1e-5):  # a decoding sequence dearer, then cheaper
            truth = cost(per_decode_seq=per_decode_seq)
            fitted = FittedCost.fit(profile_like(truth), 10_000, "fitted")
            for name, value in truth.coefficients.items():
                assert fitted.coefficients[name] == pytest.approx(value, rel=1e-6), name

    def test_weighted_for_relative_error_it_still_recovers_them(self) -> None:
        truth = cost()
        measurements = profile_like(truth, seed=1)
        scale = [m.seconds for m in measurements]
        fitted = FittedCost.fit(measurements, 10_000, "fitted", scale=scale)
        for name, value in truth.coefficients.items():
            assert fitted.coefficients[name] == pytest.approx(value, rel=1e-6), name

    def test_requests_delayed_around_their_timed_steps_leave_the_steps_alone(self) -> None:
        """A client held off the CPU makes some whole requests late by more than their steps
        take; where the server timed those steps itself, the step terms come from the steps,
        and the request overhead is what requests usually cost beyond them."""
        truth = cost()
        measurements = profile_like(truth, seed=2)
        timed = {m.shape for m in measurements if not m.request}
        around = [i for i, m in enumerate(measurements) if m.request and m.shape in timed]
        for i in around[::3]:
            late = measurements[i]
            measurements[i] = dataclasses.replace(late, seconds=late.seconds + 0.05)
        fitted = FittedCost.fit(measurements, 10_000, "fitted")
        for name, value in truth.coefficients.items():
            assert fitted.coefficients[name] == pytest.approx(value, rel=1e-6), name

    def test_a_term_the_data_does_not_support_is_zero_not_negative(self) -> None:
        # Decode steps flat in batch size: least squares alone would give tiny negative slopes.
        measurements = [
            Measurement(StepShape.decode(n, n), 0.01 + 1e-4 * (-1) ** n, bool(n % 3))
            for n in range(1, 30)
        ]
        fitted = FittedCost.fit(measurements, 1000, "flat")
        assert all(v >= 0 for v in fitted.coefficients.values())
        assert fitted.step_time(StepShape.decode(10, 10)) == pytest.approx(0.01, rel=0.05)

    def test_without_decode_steps_a_decode_costs_a_prefill_token(self) -> None:
        prefills = [m for m in profile_like(cost()) if not m.shape.num_decode_seqs]
        fitted = FittedCost.fit(prefills, 10_000, "prefills only")
        assert fitted.coefficients["per_decode_seq"] == fitted.coefficients["per_token"]
        assert fitted.coefficients["per_token"] == pytest.approx(5e-5, rel=1e-6)

    def test_too_few_measurements_are_refused(self) -> None:
        with pytest.raises(ValueError, match="3 measurements cannot fit 6 terms"):
            FittedCost.fit(profile_like(cost())[-3:], 10_000, "few")


class TestProfileFiles:
    def test_saved_and_loaded_it_predicts_the_same(self, tmp_path: Path) -> None:
        c, measurements = cost(), profile_like(cost())
        c.save(tmp_path / "p.json", measurements)
        loaded = FittedCost.load(tmp_path / "p.json")
        assert loaded.coefficients == c.coefficients
        saved = json.loads((tmp_path / "p.json").read_text())["measurements"]
        assert saved[-1]["num_decode_seqs"] == 16

    def test_a_profile_from_before_decode_was_priced_apart_loads_unchanged(
        self, tmp_path: Path
    ) -> None:
        # As `fairway profile` wrote them: one per-token term for prefill and decode tokens.
        old = {"overhead": 0.00332, "per_token": 0.000165, "per_pair": 0.0,
               "per_kv_token": 5.56e-07, "request_overhead": 0.019}  # fmt: skip
        path = tmp_path / "old.json"
        measurement = {"num_tokens": 4, "attention_pairs": 2700, "kv_read_tokens": 2700,
                       "seconds": 0.004, "request": False}  # fmt: skip
        path.write_text(json.dumps({"fairway_profile": 1, "name": "fitted:tiny",
                                    "kv_capacity_tokens": 5000, "coefficients": old,
                                    "measurements": [measurement]}))  # fmt: skip
        loaded = FittedCost.load(path)
        assert loaded.coefficients["per_decode_seq"] == old["per_token"]
        decode = 0.00332 + 4 * 0.000165 + 2700 * 5.56e-07  # what the old model said
        assert loaded.decode_time(4, 2700) == pytest.approx(decode, rel=1e-12)
        assert loaded.request_overhead == 0.019

    def test_bad_profiles_are_named(self, tmp_path: Path) -> None:
        path = tmp_path / "p.json"
        path.write_text(json.dumps({"name": "x", "kv_capacity_tokens": 10, "coefficients": {}}))
        with pytest.raises(ValueError, match=r"p.json: not a Fairway profile.*missing"):
            FittedCost.load(path)


def test_both_cost_models_cross_to_another_process_unchanged() -> None:
    """Pickled (a candidate fleet sent to `fairway plan`'s worker processes or Ray tasks), a
    cost model, compiled or not, comes back pricing every step as it did."""
    shapes = [StepShape.prefill(3000, 500), StepShape.decode(16, 16 * 900)]
    for model in (cost(), roofline("llama-3-70b", "h100", tp=8)):
        back = pickle.loads(pickle.dumps(model))
        assert (back.name, back.kv_capacity_tokens) == (model.name, model.kv_capacity_tokens)
        assert [back.step_time(s) for s in shapes] == [model.step_time(s) for s in shapes]
        assert back.decode_step_times(4, 4000, 3) == model.decode_step_times(4, 4000, 3)


class TestEngineShapes:
    """The engine tells a step's decoding sequences from its prefill tokens."""

    def test_decode_steps_cost_per_decoding_sequence(self) -> None:
        c = cost(overhead=0.01, per_token=1e-3, per_decode_seq=0.02, per_pair=0.0,
                 per_kv_token=0.0, request_overhead=0.0)  # fmt: skip
        trace = Trace([Request(0, 0.0, 100, 6), Request(1, 0.0, 100, 6)], 16)
        for fast_forward in (True, False):  # step by step, each step is the engine's _shape
            config = SimConfig(num_workers=1, engine=EngineConfig(fast_forward=fast_forward))
            t = Trace([dataclasses.replace(r) for r in trace.requests], 16)
            records = simulate(t, c, config).records
            # One step prefills both prompts and samples their first tokens, then decode steps
            # of 2 sequences: overhead + 2 x per_decode_seq, no per-token charge.
            assert [r.ttft for r in records] == pytest.approx([0.01 + 200e-3] * 2)
            assert [r.tpot for r in records] == pytest.approx([0.01 + 2 * 0.02] * 2)

    def test_fast_forward_and_step_by_step_agree(self) -> None:
        trace = shared_prefix(num_requests=60, rate=20.0, prefix_tokens=600, output_tokens=40)
        records = []
        for fast_forward in (True, False):
            t = Trace([dataclasses.replace(r) for r in trace.requests], trace.block_size)
            config = SimConfig(num_workers=2, engine=EngineConfig(fast_forward=fast_forward))
            records.append(simulate(t, cost(), config).records)
        assert records[0] == records[1]
