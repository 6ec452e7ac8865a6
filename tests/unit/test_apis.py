"""Each generation API's prompt, usage and stream accounting (router/proxy/apis.py, sse.py),
on the tiny model's tokenizer and on streams as vLLM 0.32 words them."""

from __future__ import annotations

import pytest

from router.proxy.apis import CHAT, MESSAGES, RESPONSES, anthropic_messages, responses_messages
from router.proxy.errors import ANTHROPIC_EVENTS, RESPONSES_EVENTS, APIError
from router.proxy.prompts import PromptEncoder, PromptError
from router.proxy.sse import MessagesAccount, ResponsesAccount
from tests.live_helpers import BLOCK, tokenizer_dir

CALL = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"d": "."}'}}


@pytest.fixture(scope="module")
def encoder() -> PromptEncoder:
    return PromptEncoder(tokenizer_dir(), BLOCK)


def test_a_conversation_is_the_same_chat_messages_in_every_api() -> None:
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "Looking.", "tool_calls": [CALL]},
        {"role": "tool", "content": "a.py b.py", "tool_call_id": "c1"},
    ]
    responses = responses_messages(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
                {"type": "message", "role": "assistant", "content": "Looking."},
                {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": '{"d": "."}'},
                {"type": "function_call_output", "call_id": "c1", "output": "a.py b.py"},
            ],
        }
    )
    messages = anthropic_messages(
        {
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=f00d"},
                {"type": "text", "text": "Be brief."},
            ],
            "messages": [
                {"role": "user", "content": "List the files."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Looking."},
                        {"type": "tool_use", "id": "c1", "name": "ls", "input": {"d": "."}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "c1", "content": "a.py b.py"}
                    ],
                },
            ],
        }
    )
    assert responses == chat
    assert messages == chat  # the billing header, a per-request hash, is dropped as vLLM does


def test_every_api_tokenizes_a_conversation_as_chat_does(encoder: PromptEncoder) -> None:
    text = "hello there"
    chat = CHAT.prompts(encoder, {"messages": [{"role": "user", "content": text}]}, 4096)[0]
    messages = MESSAGES.prompts(encoder, {"messages": [{"role": "user", "content": text}]}, 4096)
    responses = RESPONSES.prompts(encoder, {"input": text}, 4096)[0]
    assert len(chat) == 20 and messages[0] == chat  # vLLM's count for both (measured)
    # vLLM adds the tokenizer's special tokens to a rendered Responses prompt: a second BOS.
    assert responses == [chat[0], *chat]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": 5}, "input"),
        ({"input": ""}, "input"),
        ({"input": [{"type": "mystery"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "x"}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": "x", "instructions": 3}, "instructions"),
    ],
)
def test_responses_input_that_cannot_be_a_prompt_names_its_field(body: dict, param: str) -> None:
    with pytest.raises(PromptError) as e:
        responses_messages(body)
    assert e.value.param == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages"),
        ({"system": 5, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ],
)
def test_messages_that_cannot_be_a_prompt_name_their_field(body: dict, param: str) -> None:
    with pytest.raises(PromptError) as e:
        anthropic_messages(body)
    assert e.value.param == param


RESPONSES_STREAM = (
    b'event: response.created\ndata: {"response":{"id":"resp_1","previous_response_id":null,'
    b'"usage":null},"sequence_number":0,"type":"response.created"}\n\n'
    b'event: response.output_text.delta\ndata: {"delta":" tar","type":"response.output_text'
    b'.delta"}\n\n'
    b'event: response.output_text.delta\ndata: {"delta":"info","type":"response.output_text'
    b'.delta"}\n\n'
    b'event: response.completed\ndata: {"response":{"id":"resp_1","previous_response_id":null,'
    b'"output":[],"usage":{"input_tokens":21,"input_tokens_details":{"cached_tokens":16},'
    b'"output_tokens":3}},"type":"response.completed"}\n\n'
)
MESSAGES_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":17,'
    b'"output_tokens":0}}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"ON"}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":" a"}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","usage":{"input_tokens":17,'
    b'"output_tokens":3,"cache_read_input_tokens":0}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


@pytest.mark.parametrize("cut", [1, 7, 50, 111, 300, len(RESPONSES_STREAM)])
def test_a_responses_stream_is_counted_whole_however_it_is_cut(cut: int) -> None:
    account = ResponsesAccount()
    account.continues = "resp_0"
    out, tokens = b"", 0
    for chunk in (RESPONSES_STREAM[:cut], RESPONSES_STREAM[cut:]):
        events, n = account.feed(chunk)
        out, tokens = out + events, tokens + n
    assert tokens == 2 and account.ends(out)  # two delta events: the running estimate
    assert account.usage is not None and account.usage.completion_tokens == 3  # the exact count
    assert account.usage.cached_tokens == 16 and account.final["id"] == "resp_1"
    # The client is told the response its turn continued, in every event that says.
    assert out.count(b'"previous_response_id":"resp_0"') == 2
    assert b'"previous_response_id":null' not in out


def test_a_messages_stream_is_counted_and_ends_at_message_stop() -> None:
    account = MessagesAccount()
    events, tokens = account.feed(MESSAGES_STREAM)
    assert events == MESSAGES_STREAM and tokens == 2 and account.ends(events)
    assert account.usage is not None and account.usage.completion_tokens == 3
    assert not account.ends(MESSAGES_STREAM[:-40])


def test_errors_take_each_apis_shape() -> None:
    error = APIError(429, "slow down", "rate_limit_error", code="rate_limited")
    assert error.anthropic_body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    assert error.sse(ANTHROPIC_EVENTS).startswith(b'event: error\ndata: {"type": "error"')
    assert b'"code": "rate_limited"' in error.sse(RESPONSES_EVENTS)
    assert error.sse().endswith(b"data: [DONE]\n\n")
    assert APIError(503, "busy").anthropic_body["error"]["type"] == "overloaded_error"
