"""The Responses API's stored responses: one router's memory store (bounded, expiring, one owner
each), what a follow-up turn continues from, and the `responses` section of cluster.yaml."""

from __future__ import annotations

import asyncio

import pytest

from router.proxy.conversations import MemoryResponses, Stored, decode, encode
from router.proxy.service.config import validate_config
from router.proxy.service.serve import settings_of

RETENTION = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def message(text: str, **extra: object) -> dict:
    """An assistant message as vLLM's Responses output holds it."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed"}
    return {**item, "content": [part], **extra}


def stored(owner: str = "team-a", text: str = "hi", n: int = 0) -> Stored:
    """A response to one user turn; `n` pads its input (to size records)."""
    user = {"type": "message", "role": "user", "content": "hello" + "x" * n}
    response = {"id": f"resp_{text}", "object": "response", "output": [message(text)]}
    return Stored(owner, response, [user])


def size(s: Stored) -> int:
    return len(encode(s))


def run(coro):
    return asyncio.run(coro)


class TestMemoryResponses:
    def store(self, max_bytes: int = 1 << 20) -> tuple[MemoryResponses, Clock]:
        clock = Clock()
        return MemoryResponses(RETENTION, max_bytes, clock), clock

    def test_put_then_get(self) -> None:
        store, _ = self.store()
        run(store.put("resp_1", stored()))
        store.check_integrity()
        assert run(store.get("team-a", "resp_1")) == stored()
        assert run(store.get("team-a", "resp_2")) is None, "never stored"
        assert len(store) == 1 and store.num_bytes == size(stored())

    def test_another_owner_sees_nothing(self) -> None:
        store, _ = self.store()
        run(store.put("resp_1", stored("team-a")))
        assert run(store.get("team-b", "resp_1")) is None, "the same answer as never stored"
        assert run(store.delete("team-b", "resp_1")) is False
        assert run(store.get("team-a", "resp_1")) is not None, "not deleted by another owner"
        store.check_integrity()

    def test_a_record_is_a_copy(self) -> None:
        store, _ = self.store()
        mine = stored()
        run(store.put("resp_1", mine))
        mine.input.append({"type": "message", "role": "user", "content": "later"})
        got = run(store.get("team-a", "resp_1"))
        got.response["output"].clear()
        assert run(store.get("team-a", "resp_1")) == stored(), "neither change reached it"

    def test_expires_after_retention(self) -> None:
        store, clock = self.store()
        run(store.put("resp_1", stored(text="a")))
        clock.now += RETENTION / 2
        run(store.put("resp_2", stored(text="b")))
        clock.now += RETENTION / 2 - 0.001
        assert run(store.get("team-a", "resp_1")) is not None, "just inside its retention"
        clock.now += 0.001
        assert run(store.get("team-a", "resp_1")) is None, "expired"
        assert run(store.get("team-a", "resp_2")) is not None
        assert len(store) == 1 and store.num_bytes == size(stored(text="b")), "its bytes freed"
        clock.now += RETENTION
        assert run(store.get("team-a", "resp_2")) is None
        assert len(store) == 0 and store.num_bytes == 0
        store.check_integrity()

    def test_storing_again_restarts_retention(self) -> None:
        store, clock = self.store()
        run(store.put("resp_1", stored(text="a")))
        run(store.put("resp_2", stored(text="b")))
        clock.now += RETENTION / 2
        run(store.put("resp_1", stored(text="c")))
        store.check_integrity()
        clock.now += RETENTION / 2
        assert run(store.get("team-a", "resp_2")) is None
        assert run(store.get("team-a", "resp_1")) == stored(text="c")
        assert store.num_bytes == size(stored(text="c")), "the first record's bytes freed"

    def test_eviction_by_bytes_keeps_the_newest(self) -> None:
        one = size(stored(text="r0", n=100))
        store, _ = self.store(max_bytes=3 * one)
        for i in range(10):
            run(store.put(f"resp_{i}", stored(text=f"r{i}", n=100)))
            store.check_integrity()
            assert store.num_bytes <= 3 * one
        kept = [i for i in range(10) if run(store.get("team-a", f"resp_{i}")) is not None]
        assert kept == [7, 8, 9]

    def test_a_record_larger_than_the_store_is_not_kept(self) -> None:
        store, _ = self.store(max_bytes=size(stored(n=100)))
        run(store.put("small", stored(n=100)))
        run(store.put("huge", stored(n=10_000)))
        store.check_integrity()
        assert run(store.get("team-a", "huge")) is None
        assert run(store.get("team-a", "small")) is None, "gone to make room, as the oldest"
        assert len(store) == 0

    def test_delete(self) -> None:
        store, _ = self.store()
        run(store.put("resp_1", stored()))
        assert run(store.delete("team-a", "resp_1")) is True
        assert run(store.get("team-a", "resp_1")) is None
        assert run(store.delete("team-a", "resp_1")) is False, "nothing left to delete"
        assert len(store) == 0 and store.num_bytes == 0
        store.check_integrity()


OUTPUT_TEXT = {"type": "output_text", "text": "4"}


class TestContinued:
    USER = {"type": "message", "role": "user", "content": "What is 2+2?"}

    def continued(self, *output: dict) -> list[dict]:
        return Stored("a", {"id": "resp_1", "output": list(output)}, [self.USER]).continued()

    def test_a_message_becomes_an_assistant_turn(self) -> None:
        answer = {"type": "message", "role": "assistant", "content": [OUTPUT_TEXT]}
        assert self.continued(message("4", status="incomplete")) == [self.USER, answer], (
            "role and text only: no id, status (an incomplete one would be continued) or logprobs"
        )

    def test_a_function_call_stays_as_it_is(self) -> None:
        call = {
            "id": "fc_1",
            "type": "function_call",
            "call_id": "call_1",
            "name": "add",
            "arguments": '{"a": 2, "b": 2}',
            "status": "completed",
        }
        assert self.continued(call) == [self.USER, call]

    def test_reasoning_is_dropped(self) -> None:
        reasoning = {"id": "rs_1", "type": "reasoning", "summary": [], "content": []}
        out = self.continued(reasoning, message("4"))
        assert [item["type"] for item in out] == ["message", "message"]
        assert out[-1]["role"] == "assistant"

    def test_a_refusal_is_kept(self) -> None:
        refusal = {"type": "refusal", "refusal": "no"}
        answer = message("", content=[refusal])
        assert self.continued(answer)[-1]["content"] == [refusal]

    def test_no_output(self) -> None:
        assert self.continued() == [self.USER]

    def test_input_is_not_changed(self) -> None:
        s = Stored("a", {"output": [message("4")]}, [self.USER])
        s.continued()
        assert s.input == [self.USER]


def test_what_orjson_refuses_is_stored_too() -> None:
    """A body the proxy accepted through the standard module (a lone surrogate, a huge
    integer) comes back as it went in."""
    odd = Stored("a", {"id": "r", "output": [], "seed": 2**70}, [{"content": "\ud800"}])
    assert decode(encode(odd)) == odd


class TestConfig:
    @pytest.mark.parametrize(
        "section, field",
        [
            ({"retention": 0}, "responses.retention"),
            ({"retention": -1}, "responses.retention"),
            ({"retention": float("inf")}, "responses.retention"),
            ({"max_bytes": 0}, "responses.max_bytes"),
            ({"max_bytes": -5}, "responses.max_bytes"),
            ({"ttl": 5}, "responses.ttl"),
        ],
    )
    def test_errors_name_the_field(self, section: dict, field: str) -> None:
        with pytest.raises(ValueError, match=rf"{field}: "):
            validate_config({"responses": section})

    def test_defaults_reach_the_proxy(self) -> None:
        settings = settings_of(validate_config({}))
        assert settings.responses_retention == 3600.0
        assert settings.responses_max_bytes == 256 * 1024 * 1024

    def test_given_values_reach_the_proxy(self) -> None:
        config = validate_config({"responses": {"retention": 0.5, "max_bytes": 4096}})
        settings = settings_of(config)
        assert (settings.responses_retention, settings.responses_max_bytes) == (0.5, 4096)
