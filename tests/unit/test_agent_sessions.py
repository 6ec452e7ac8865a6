"""Agent sessions: the generator, and the client API a request came through, in a trace line
and a record."""

from __future__ import annotations

import csv
import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from router.records import RecordWriter, RequestRecord
from router.request import APIS, Request
from traces.generators import GENERATORS, agent_sessions
from traces.loaders import load_trace
from traces.schema import TraceError, write_native

SMALL = {"num_sessions": 40, "rate": 2.0, "mean_turns": 8}


def by_session(requests: list[Request]) -> dict[str, list[Request]]:
    sessions: dict[str, list[Request]] = defaultdict(list)
    for r in requests:
        assert r.session is not None
        sessions[r.session].append(r)
    return sessions


class TestAgentSessions:
    def test_registered(self) -> None:
        assert GENERATORS["agent_sessions"] is agent_sessions

    def test_each_turn_extends_the_previous_prompt_and_answer(self) -> None:
        trace = agent_sessions(**SMALL)
        block = trace.block_size
        for turns in by_session(trace.requests).values():
            assert turns[0].think_time is None
            for prev, cur in zip(turns, turns[1:], strict=False):
                # the answer and a tool result of at least tool_tokens_min (200) tokens
                assert cur.prompt_len >= prev.prompt_len + prev.output_len + 200
                assert cur.block_hashes[: len(prev.block_hashes)] == prev.block_hashes
                assert len(cur.block_hashes) == cur.prompt_len // block
                assert cur.think_time is not None and cur.think_time >= 0

    def test_contexts_reach_tens_of_thousands_of_tokens(self) -> None:
        trace = agent_sessions(**SMALL)
        last = sorted(turns[-1].prompt_len for turns in by_session(trace.requests).values())
        assert last[len(last) // 2] > 10_000
        assert max(last) > 20_000

    def test_a_tenant_shares_its_preamble_and_no_other_does(self) -> None:
        trace = agent_sessions(**SMALL, preamble_tokens=4000)
        preamble_blocks = 3000 // trace.block_size  # well inside the shortest preamble
        firsts: dict[str, set[tuple[int, ...]]] = defaultdict(set)
        for r in trace.requests:
            firsts[r.client].add(tuple(r.block_hashes[:preamble_blocks]))
        assert all(len(prefixes) == 1 for prefixes in firsts.values())
        assert len({p for prefixes in firsts.values() for p in prefixes}) == len(firsts)

    def test_tenants_unequal(self) -> None:
        trace = agent_sessions(num_sessions=200, mean_turns=4, num_tenants=4, tenant_skew=1.0)
        sessions = Counter(turns[0].client for turns in by_session(trace.requests).values())
        assert sessions["tenant-0"] > 1.5 * sessions["tenant-3"]
        flat = agent_sessions(num_sessions=200, mean_turns=4, num_tenants=4, tenant_skew=0.0)
        even = Counter(turns[0].client for turns in by_session(flat.requests).values())
        assert max(even.values()) < 2 * min(even.values())

    def test_seeds_reproducible(self) -> None:
        a, b = agent_sessions(**SMALL, seed=3), agent_sessions(**SMALL, seed=3)
        assert a.requests == b.requests
        assert a.requests != agent_sessions(**SMALL, seed=4).requests

    def test_api_and_session_set_one_api_per_session(self) -> None:
        trace = agent_sessions(**SMALL)
        sessions = by_session(trace.requests)
        assert all(len({r.api for r in turns}) == 1 for turns in sessions.values())
        assert {turns[0].api for turns in sessions.values()} == {"responses", "messages"}
        only = agent_sessions(**SMALL, apis="messages")
        assert {r.api for r in only.requests} == {"messages"}

    @pytest.mark.parametrize(
        "params",
        [{"apis": "grpc"}, {"apis": ""}, {"tool_tokens_min": 0}, {"tool_tokens_max": 100}],
    )
    def test_bad_parameters(self, params: dict[str, object]) -> None:
        with pytest.raises(ValueError):
            agent_sessions(**SMALL, **params)


class TestApiField:
    def test_trace_round_trip(self, tmp_path: Path) -> None:
        trace = agent_sessions(num_sessions=4, mean_turns=3)
        write_native(trace, tmp_path / "t.jsonl")
        again = load_trace(tmp_path / "t.jsonl")
        assert [(r.api, r.session) for r in again.requests] == [
            (r.api, r.session) for r in trace.requests
        ]

    def test_unknown_when_a_trace_does_not_say(self, tmp_path: Path) -> None:
        path = tmp_path / "t.jsonl"
        path.write_text('{"arrival": 0, "prompt_len": 5, "output_len": 1}\n')
        assert load_trace(path).requests[0].api is None
        write_native(load_trace(path), tmp_path / "again.jsonl")
        assert "api" not in json.loads((tmp_path / "again.jsonl").read_text().splitlines()[1])

    @pytest.mark.parametrize("api", APIS)
    def test_each_api_reads(self, tmp_path: Path, api: str) -> None:
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps({"arrival": 0, "prompt_len": 5, "output_len": 1, "api": api}))
        assert load_trace(path).requests[0].api == api

    @pytest.mark.parametrize("value", ['"grpc"', '""', "1"])
    def test_bad_value_names_file_and_line(self, tmp_path: Path, value: str) -> None:
        path = tmp_path / "t.jsonl"
        line = f'{{"arrival": 0, "prompt_len": 5, "output_len": 1, "api": {value}}}'
        path.write_text('{"fairway_trace": 1, "block_size": 16}\n' + line + "\n")
        with pytest.raises(TraceError, match="field 'api'") as err:
            load_trace(path)
        assert str(err.value).startswith(f"{path}:2:")

    def test_records_column_last_empty_when_unknown(self, tmp_path: Path) -> None:
        writer = RecordWriter(tmp_path / "requests.csv")
        base = dict(client="a", session=None, worker=0, arrival=0.0, admitted=0.0,
                    first_token=0.1, finish=0.2, prompt_tokens=5, cached_tokens=0,
                    output_tokens=2, preemptions=0)  # fmt: skip
        writer.write(RequestRecord(id=0, **base))
        writer.write(RequestRecord(id=1, **base, api="messages"))
        writer.close()
        with open(tmp_path / "requests.csv", newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0][-1] == "api" and rows[0][-5:-1] == ["queue_time", "ttft", "tpot", "e2e"]
        assert [row[-1] for row in rows[1:]] == ["", "messages"]
