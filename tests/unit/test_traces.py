"""Trace loaders (each format, bad lines named by file and line), generators, transforms."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.request import hash_token_blocks
from simulator.hit_bound import InfiniteCache
from traces import transform
from traces.generators import GENERATORS, _Shared, agent_loops, chat_sessions, shared_prefix
from traces.loaders import detect_format, load_trace
from traces.schema import TraceError, write_native


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


class TestMooncake:
    def test_reads_ms_timestamps_and_keeps_full_blocks_only(self, tmp_path: Path) -> None:
        lines = [
            {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
            {"timestamp": 1500, "input_length": 600, "output_length": 9, "hash_ids": [0, 3]},
        ]
        p = write(tmp_path / "m.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
        trace = load_trace(p)
        assert detect_format(p) == "mooncake"
        assert trace.block_size == 512
        assert [r.arrival for r in trace.requests] == [0.0, 1.5]
        assert trace.requests[0].block_hashes == [0, 1]  # 1100 tokens: 2 full blocks
        assert trace.requests[1].block_hashes == [0]

    @pytest.mark.parametrize(
        "line, message",
        [
            (
                '{"timestamp": 0, "input_length": 10, "output_length": 5}',
                "missing field 'hash_ids'",
            ),
            ('{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}', "positive"),
            (
                '{"timestamp": -4, "input_length": 9, "output_length": 5, "hash_ids": []}',
                "timestamp",
            ),
            (
                '{"timestamp": 0, "input_length": 9, "output_length": 5, "hash_ids": ["a"]}',
                "hash_ids",
            ),
            (
                '{"timestamp": 0, "input_length": 9, "output_length": 5, "hash_ids": ['
                f"{1 << 64}]}}",
                "64-bit",
            ),
            ('{"timestamp": 0, "input_length": 9,', "not valid JSON"),
        ],
    )
    def test_bad_line_names_file_and_line(self, tmp_path: Path, line: str, message: str) -> None:
        good = '{"timestamp": 0, "input_length": 9, "output_length": 5, "hash_ids": [1]}\n'
        p = write(tmp_path / "bad.jsonl", good + "\n" + line + "\n")
        with pytest.raises(TraceError, match=message) as err:
            load_trace(p, "mooncake")
        assert str(err.value).startswith(f"{p}:3:")

    def test_whole_public_trace(self, mooncake_path: Path) -> None:
        trace = load_trace(mooncake_path)
        assert len(trace) == 12031
        bound = InfiniteCache(trace.block_size)
        for r in trace.requests:
            bound.observe(r)
        # The shared README measures 37.4 % of prompt tokens in blocks seen before; counting
        # only full blocks and keeping one token to compute, a little less.
        assert 0.36 < bound.hit_rate < 0.375


class TestAzure:
    def test_reads_timestamps_with_seven_fraction_digits(self, tmp_path: Path) -> None:
        p = write(
            tmp_path / "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:48.1805900,396,109\n",
        )
        trace = load_trace(p)
        assert detect_format(p) == "azure"
        assert [(r.arrival, r.prompt_len, r.output_len) for r in trace.requests] == [
            (0.0, 374, 44),
            (1.5, 396, 109),
        ]
        assert all(not r.block_hashes for r in trace.requests), "no content, nothing to cache"

    def test_bad_row(self, tmp_path: Path) -> None:
        p = write(
            tmp_path / "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.00,lots,44\n",
        )
        with pytest.raises(TraceError, match=r"a\.csv:3: cannot read row"):
            load_trace(p)

    def test_public_files(self) -> None:
        folder = Path(__file__).resolve().parents[3] / "shared/traces/azure2023"
        if not folder.exists():
            pytest.skip("../shared/traces is not beside the checkout")
        assert len(load_trace(folder / "AzureLLMInferenceTrace_conv.csv")) == 19366
        assert len(load_trace(folder / "AzureLLMInferenceTrace_code.csv")) == 8819


class TestServeGen:
    @staticmethod
    def client(folder: Path, n: int, rate: float, family: str = "Gamma", data: bool = True):
        rows = [f"0,{rate},1.2,{family},0.7,0.04", f"600,{rate},1.0,,0,0"]
        (folder / f"chunk-{n}-trace.csv").write_text("\n".join(rows) + "\n")
        if data:
            window = {"input_tokens": "{100: 0.5, 300: 0.5}", "output_tokens": "{20: 1.0}"}
            (folder / f"chunk-{n}-dataset.json").write_text(json.dumps({"0": window}))

    def test_clients_become_tenants_with_their_rates(self, tmp_path: Path) -> None:
        self.client(tmp_path, 0, rate=2.0)
        self.client(tmp_path, 1, rate=8.0, family="Weibull")
        self.client(tmp_path, 2, rate=5.0, data=False)
        trace = load_trace(tmp_path, seed=1, start=0.0, duration=1200.0)
        assert detect_format(tmp_path) == "servegen"
        per = {c: sum(r.client == c for r in trace.requests) for c in trace.clients}
        assert set(per) == {"chunk-0", "chunk-1"}
        assert trace.meta["skipped_clients"] == ["chunk-2"]
        assert 2000 < per["chunk-0"] < 2800  # 2 req/s over 1200 s
        assert 8500 < per["chunk-1"] < 10700
        assert {r.prompt_len for r in trace.requests} == {100, 300}
        assert load_trace(tmp_path, seed=1, start=0.0, duration=1200.0).requests == trace.requests

    def test_bad_rows_name_file_and_line(self, tmp_path: Path) -> None:
        (tmp_path / "chunk-0-trace.csv").write_text("0,1.0,1.0,Gamma,0.5,0.1\n600,fast,1,,0,0\n")
        with pytest.raises(TraceError, match=r"chunk-0-trace\.csv:2: cannot read row"):
            load_trace(tmp_path)
        (tmp_path / "chunk-0-trace.csv").write_text("0,1.0,1.0,Gamma,0.5,0.1\n")
        (tmp_path / "chunk-0-dataset.json").write_text('{"0": {"input_tokens": "{1: "}}')
        with pytest.raises(TraceError, match=r"chunk-0-dataset\.json: window 0"):
            load_trace(tmp_path, start=0.0)

    def test_public_folder(self) -> None:
        folder = Path(__file__).resolve().parents[3] / "shared/traces/servegen/language/m-small"
        if not folder.exists():
            pytest.skip("../shared/traces is not beside the checkout")
        trace = load_trace(folder, seed=0)
        assert len(trace) > 100 and len(trace.clients) > 1
        assert len(trace.meta["skipped_clients"]) == 5


class TestNative:
    def test_round_trip(self, tmp_path: Path) -> None:
        trace = chat_sessions(num_sessions=5, seed=3)
        write_native(trace, tmp_path / "t.jsonl")
        again = load_trace(tmp_path / "t.jsonl")
        assert detect_format(tmp_path / "t.jsonl") == "native"
        assert again.block_size == trace.block_size
        assert [(r.arrival, r.block_hashes, r.session, r.think_time) for r in again.requests] == [
            (round(r.arrival, 6), r.block_hashes, r.session, r.think_time) for r in trace.requests
        ]

    @pytest.mark.parametrize(
        "line, message",
        [
            ('{"arrival": 0, "prompt_len": 5}', "field 'output_len'"),
            ('{"arrival": 0, "prompt_len": 5, "output_len": 1, "colour": 1}', "field 'colour'"),
            ('{"arrival": -1, "prompt_len": 5, "output_len": 1}', "field 'arrival'"),
            ("[1, 2]", "expected a JSON object"),
            (
                '{"arrival": 0, "prompt_len": 5, "output_len": 1, "block_hashes": ['
                f"{-(2**63) - 1}]}}",
                "field 'block_hashes.0'",
            ),
        ],
    )
    def test_bad_line(self, tmp_path: Path, line: str, message: str) -> None:
        p = write(tmp_path / "n.jsonl", '{"fairway_trace": 1, "block_size": 16}\n' + line + "\n")
        with pytest.raises(TraceError, match=message) as err:
            load_trace(p)
        assert str(err.value).startswith(f"{p}:2:")


class TestGenerators:
    @pytest.mark.parametrize("name", sorted(GENERATORS))
    def test_deterministic_under_a_seed(self, name: str) -> None:
        a, b, c = GENERATORS[name](seed=5), GENERATORS[name](seed=5), GENERATORS[name](seed=6)
        assert a.requests == b.requests
        assert a.requests != c.requests

    def test_shared_prefix_shares_within_tenant(self) -> None:
        trace = shared_prefix(num_requests=200, num_tenants=2, prefixes_per_tenant=1)
        firsts = {r.client: r.block_hashes[0] for r in trace.requests}
        assert len(set(firsts.values())) == 2
        assert all(r.block_hashes[0] == firsts[r.client] for r in trace.requests)

    @pytest.mark.parametrize("gen", [chat_sessions, agent_loops])
    def test_each_turn_extends_the_previous(self, gen) -> None:
        trace = gen(num_sessions=10)
        by_session: dict[str, list] = {}
        for r in trace.requests:
            by_session.setdefault(r.session, []).append(r)
        for turns in by_session.values():
            for prev, cur in zip(turns, turns[1:], strict=False):
                assert cur.prompt_len > prev.prompt_len + prev.output_len
                assert cur.block_hashes[: len(prev.block_hashes)] == prev.block_hashes
                assert cur.think_time is not None


class TestTransforms:
    def test_rate_scale_window_limit_tenants(self) -> None:
        trace = shared_prefix(num_requests=400, rate=10.0)
        span = trace.duration
        transform.scale_rate(trace, 2.0)
        assert trace.duration == pytest.approx(span / 2)
        transform.window(trace, 1.0, 5.0)
        assert trace.requests[0].arrival == 0.0 and trace.duration < 4.0
        transform.limit(trace, 10)
        assert len(trace) == 10
        transform.assign_tenants(trace, 3, seed=1)
        assert set(trace.clients) <= {"tenant-0", "tenant-1", "tenant-2"}

    def test_tile_multiplies_the_rate_keeping_each_copy_its_own(self) -> None:
        trace = chat_sessions(num_sessions=30, rate=2.0)
        n, span = len(trace), trace.duration
        turns = {
            s: [r.block_hashes for r in trace.requests if r.session == s]
            for s in {r.session for r in trace.requests}
        }
        tiled = transform.tile(trace, 4)
        assert len(tiled) == 4 * n
        starts: dict[str, float] = {}
        for r in tiled.requests:
            starts.setdefault(r.session, r.arrival)
        assert max(starts.values()) <= span, "sessions start within the original span"
        assert sorted(r.id for r in tiled.requests) == list(range(4 * n))
        by_copy: dict[str, set[int]] = {}
        for r in tiled.requests:
            by_copy.setdefault(r.session.split("#")[1], set()).update(r.block_hashes)
        copies = list(by_copy.values())
        assert len(copies) == 4
        assert all(a.isdisjoint(b) for i, a in enumerate(copies) for b in copies[i + 1 :])
        # Each session's turns come in their order, prompts as in the original but offset.
        for s, prompts in turns.items():
            for k in range(4):
                got = [r.block_hashes for r in tiled.requests if r.session == f"{s}#{k}"]
                offset = got[0][0] - prompts[0][0]
                assert got == [[h + offset for h in p] for p in prompts]

    def test_tile_needs_a_copy(self) -> None:
        with pytest.raises(ValueError, match="at least 1"):
            transform.tile(shared_prefix(num_requests=5), 0)

    def test_sessions_keep_one_tenant(self) -> None:
        trace = transform.assign_tenants(chat_sessions(num_sessions=30), 5, seed=2)
        tenants: dict[str, set[str]] = {}
        for r in trace.requests:
            tenants.setdefault(r.session, set()).add(r.client)
        assert all(len(t) == 1 for t in tenants.values())


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.integers(1, 8),
    prefix_len=st.integers(0, 40),
    rest_len=st.integers(0, 40),
    root=st.one_of(st.none(), st.integers(0, (1 << 64) - 1)),
)
def test_a_shared_prefix_hashed_once_gives_every_prompt_its_own_hashes(
    block_size: int, prefix_len: int, rest_len: int, root: int | None
) -> None:
    """Generators hash a document or template once and each prompt's tail after it: the
    chain must be the whole prompt's, wherever the prefix ends in a block."""
    rng = np.random.default_rng(prefix_len * 64 + rest_len)
    prefix = rng.integers(0, 4000, size=prefix_len, dtype=np.uint32)
    shared = _Shared(prefix, block_size)
    for _ in range(2):  # the second prompt reuses the prefix's hashes
        prompt = np.concatenate([prefix, rng.integers(0, 4000, size=rest_len, dtype=np.uint32)])
        assert shared.hash_prompt(prompt, root) == hash_token_blocks(prompt, block_size, root)
