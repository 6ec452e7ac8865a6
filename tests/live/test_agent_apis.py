"""The agents' APIs through the proxy, in front of emulated vLLM workers: the OpenAI Responses
API with its stored conversations, Anthropic's Messages API, and the endpoints relayed as they
are, each driven by the real client a user would point at Fairway."""

from __future__ import annotations

import asyncio
import base64
import csv
import json

import aiohttp
import anthropic
import openai
import pytest

from router.proxy.settings import Tenant, keyed
from tests.live_helpers import (
    anthropic_prompt_tokens,
    client,
    emulated_processes,
    emulated_split_workers,
    emulated_workers,
    proxy,
    run,
    split_proxy,
)
from tests.metrics_page import samples
from workers.emulated.state import CONNECTOR

TOOL = {
    "type": "function",
    "name": "read_file",
    "description": "Read a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
}


def claude(base: str, key: str = "test-key-1234") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base, api_key=key, max_retries=0)


async def events_of(response: aiohttp.ClientResponse) -> list[str]:
    text = (await response.read()).decode()
    return [line[7:] for line in text.splitlines() if line.startswith("event: ")]


class TestResponses:
    def test_plain_streamed_chained_retrieved_and_deleted(self) -> None:
        async def go() -> None:
            async with emulated_workers(2, speed=20) as urls, proxy(urls, "lpm") as (base, _):
                oa = client(base)
                first = await oa.responses.create(
                    model="tiny", instructions="You are terse.", input="hello", max_output_tokens=4
                )
                assert first.id.startswith("resp_") and first.usage.output_tokens == 4
                previous, sizes = first.id, [first.usage.input_tokens]
                for turn in range(5):  # six turns in all, each continuing the last
                    r = await oa.responses.create(
                        model="tiny",
                        input=f"and then {turn}?",
                        previous_response_id=previous,
                        max_output_tokens=4,
                    )
                    assert r.previous_response_id == previous
                    sizes.append(r.usage.input_tokens)
                    previous = r.id
                assert sizes == sorted(sizes) and len(set(sizes)) == 6, sizes  # the history grows
                got = await oa.responses.retrieve(previous)
                assert got.id == previous and got.output_text
                items = await oa.responses.input_items.list(previous)
                # Six user turns and five answers before the last.
                assert len(items.data) == 11
                async with oa.responses.stream(
                    model="tiny",
                    input="stream it",
                    max_output_tokens=5,
                    previous_response_id=previous,
                ) as stream:
                    kinds = [event.type async for event in stream]
                    final = await stream.get_final_response()
                assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
                assert final.previous_response_id == previous and final.usage.output_tokens == 5
                assert (await oa.responses.retrieve(final.id)).output_text == final.output_text
                await oa.responses.delete(final.id)
                with pytest.raises(openai.NotFoundError) as gone:
                    await oa.responses.retrieve(final.id)
                assert "3600 s" in gone.value.body["message"]  # the retention, named
                unstored = await oa.responses.create(
                    model="tiny", input="forget me", store=False, max_output_tokens=2
                )
                with pytest.raises(openai.NotFoundError):
                    await oa.responses.retrieve(unstored.id)
                with pytest.raises(openai.NotFoundError) as missing:
                    await oa.responses.create(
                        model="tiny", input="x", previous_response_id="resp_nothing"
                    )
                assert missing.value.body["param"] == "previous_response_id"

        run(go)

    def test_a_stream_commits_at_its_first_token_not_its_opening_events(self) -> None:
        """vLLM opens a Responses stream at once (response.created, in_progress) and generates
        after: a worker that has said only that much within first_byte_timeout is left for
        another, as one that said nothing would be; the client sees one clean stream."""

        async def go() -> None:
            async with (
                emulated_workers(1, speed=0.0005) as stalled,  # seconds before its first token
                emulated_workers(1, speed=20) as fast,
                proxy(stalled + fast, first_byte_timeout=1.0) as (base, _),
            ):
                async with client(base).responses.stream(
                    model="tiny", input="hello " * 300, max_output_tokens=4
                ) as stream:
                    kinds = [event.type async for event in stream]
                    final = await stream.get_final_response()
                assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
                assert final.usage.output_tokens == 4
                async with aiohttp.ClientSession() as session:
                    retried = await samples(session, base.admin, "fairway_retries_total")
                # The stalled worker was tried first, and left.
                assert retried == {'{worker="0"}': 1.0, '{worker="1"}': 0.0}, retried

        run(go)

    @pytest.mark.slow  # the workers run as processes, so that one can be killed
    def test_a_chain_survives_the_worker_that_served_its_last_turn(self) -> None:
        """Any worker serves any turn: the proxy sends the stored conversation whole."""

        async def go() -> None:
            async with (
                emulated_processes(2, speed=20) as servers,
                proxy([s.url for s in servers], "lpm") as (base, _),
            ):
                oa = client(base)
                raw = await oa.responses.with_raw_response.create(
                    model="tiny", input="a long task " * 40, max_output_tokens=4
                )
                served_by = int(raw.headers["X-Fairway-Worker"])
                previous = raw.parse().id
                servers[served_by].proc.kill()  # the worker holding the conversation's KV
                servers[served_by].proc.wait()
                raw = await oa.responses.with_raw_response.create(
                    model="tiny", input="go on", previous_response_id=previous, max_output_tokens=4
                )
                assert int(raw.headers["X-Fairway-Worker"]) != served_by
                answer = raw.parse()
                assert answer.previous_response_id == previous and answer.output_text

        run(go, timeout=60)

    def test_a_tenant_cannot_read_or_continue_anothers_response(self) -> None:
        tenants = keyed({"key-a": Tenant("a"), "key-b": Tenant("b")})

        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, tenants=tenants, trust_client_headers=False) as (base, _),
            ):
                a = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="key-a", max_retries=0)
                b = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="key-b", max_retries=0)
                mine = await a.responses.create(model="tiny", input="secret", max_output_tokens=2)
                assert (await a.responses.retrieve(mine.id)).id == mine.id
                with pytest.raises(openai.NotFoundError):
                    await b.responses.retrieve(mine.id)
                with pytest.raises(openai.NotFoundError):
                    await b.responses.create(
                        model="tiny", input="more", previous_response_id=mine.id
                    )
                with pytest.raises(openai.NotFoundError):
                    await b.responses.delete(mine.id)
                assert (await a.responses.retrieve(mine.id)).id == mine.id  # still there

        run(go)

    def test_a_background_response_is_cancelled_at_its_worker(self) -> None:
        async def go() -> None:
            async with emulated_workers(1, speed=0.05) as urls, proxy(urls) as (base, cluster):
                oa = client(base)
                started = await oa.responses.create(
                    model="tiny", input="write a long essay", background=True, max_output_tokens=500
                )
                assert started.status == "queued"
                worker = next(iter(cluster.workers.values()))
                for _ in range(250):  # it reaches its worker
                    if worker.dispatch.in_flight:
                        break
                    await asyncio.sleep(0.02)
                assert worker.dispatch.in_flight == 1
                cancelled = await oa.responses.cancel(started.id)
                assert cancelled.status == "cancelled"
                assert worker.dispatch.in_flight == 0  # released: the worker aborted it
                assert (await oa.responses.retrieve(started.id)).status == "cancelled"
                done = await oa.responses.create(
                    model="tiny", input="short", background=True, max_output_tokens=2
                )
                for _ in range(250):
                    got = await oa.responses.retrieve(done.id)
                    if got.status not in ("queued", "in_progress"):
                        break
                    await asyncio.sleep(0.02)
                assert got.output_text and got.usage.output_tokens == 2
                with pytest.raises(openai.BadRequestError):  # finished: nothing to cancel
                    await oa.responses.cancel(done.id)

        run(go)


class TestMessages:
    def test_anthropic_client_plain_streamed_with_tools_and_counted(self) -> None:
        async def go() -> None:
            async with emulated_workers(2, speed=20) as urls, proxy(urls) as (base, _):
                ac = claude(base)
                tool = {
                    "name": "read_file",
                    "description": "Read a file",
                    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
                }
                history = [
                    {"role": "user", "content": "What is in setup.py?"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": "Let me look."},
                            {
                                "type": "tool_use",
                                "id": "t1",
                                "name": "read_file",
                                "input": {"path": "setup.py"},
                            },
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t1", "content": "import x"}
                        ],
                    },
                ]
                m = await ac.messages.create(
                    model="tiny", max_tokens=5, system="Be brief.", messages=history, tools=[tool]
                )
                assert m.type == "message" and m.usage.output_tokens == 5 and m.content[0].text
                async with ac.messages.stream(model="tiny", max_tokens=4, messages=history) as s:
                    text = "".join([t async for t in s.text_stream])
                    final = await s.get_final_message()
                assert text and final.usage.output_tokens == 4
                counted = await ac.messages.count_tokens(
                    model="tiny", system="Be brief.", messages=history
                )
                assert counted.input_tokens == anthropic_prompt_tokens(m.usage)

        run(go)

    def test_errors_come_in_anthropics_shape(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls) as (base, _),
                aiohttp.ClientSession() as session,
            ):
                ac = claude(base)
                with pytest.raises(anthropic.NotFoundError) as e:
                    await ac.messages.create(
                        model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
                    )
                assert e.value.body["error"]["type"] == "not_found_error"
                async with session.post(f"{base}/v1/messages", data=b"{not json") as r:
                    body = await r.json()
                    assert r.status == 400 and body["type"] == "error", body
                async with session.post(f"{base}/v1/messages/nothing", json={}) as r:
                    assert r.status == 404 and (await r.json())["type"] == "error"

        run(go)


def test_responses_and_messages_go_through_both_stages_of_a_split_fleet() -> None:
    """The prefill stage is asked for one token in each API's own limit field, then the decode
    worker answers the client, streamed or not."""

    async def go() -> None:
        async with (
            emulated_split_workers(["prefill", "decode"], speed=20) as servers,
            split_proxy([(url, app[CONNECTOR].role.value) for url, app in servers]) as (base, _),
        ):
            (_, prefill), (_, decode) = servers
            prompt = "the quick brown fox jumps over the lazy dog " * 40
            raw = await client(base).responses.with_raw_response.create(
                model="tiny", input=prompt, max_output_tokens=6
            )
            assert raw.headers["X-Fairway-Worker"] == "1" and raw.parse().usage.output_tokens == 6
            async with claude(base).messages.stream(
                model="tiny", max_tokens=4, messages=[{"role": "user", "content": prompt}]
            ) as stream:
                final = await stream.get_final_message()
            assert final.usage.output_tokens == 4
            assert [limit for limit, _ in prefill[CONNECTOR].received] == [1, 1]
            assert [limit for limit, _ in decode[CONNECTOR].received] == [6, 4]
            assert all(params for _, params in decode[CONNECTOR].received), "the KV was handed over"

    run(go)


def test_records_recordings_and_metrics_name_the_api(tmp_path) -> None:
    by_api: dict[str, dict[str, float]] = {}

    async def go() -> None:
        async with (
            emulated_workers(1, speed=20) as urls,
            proxy(urls, record_dir=str(tmp_path)) as (base, _),
            aiohttp.ClientSession() as session,
        ):
            oa, ac = client(base), claude(base)
            await oa.completions.create(model="tiny", prompt="a b c", max_tokens=2)
            await oa.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
            )
            await oa.responses.create(model="tiny", input="x", max_output_tokens=2)
            await ac.messages.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
            with pytest.raises(anthropic.BadRequestError):  # rejected before routing
                await ac.messages.create(model="tiny", max_tokens=-1, messages=[])
            body = {"model": "tiny", "prompt": "hi"}
            async with session.post(f"{base}/v1/tokenize", json=body) as r:
                assert r.status == 404, "not an endpoint: no series of its own"
            for path in ("/tokenize", "/v1/messages/count_tokens"):
                body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
                async with session.post(f"{base}{path}", json=body) as r:
                    assert r.status == 200, await r.text()
            counted = await samples(session, base.admin, "fairway_requests_total")
            for labels, value in counted.items():
                api = labels.split('api="')[1].split('"')[0]
                status = labels.split('status="')[1].split('"')[0]
                by_api.setdefault(api, {})[status] = by_api.get(api, {}).get(status, 0) + value

    run(go)
    assert by_api == {
        "completions": {"ok": 1}, "chat": {"ok": 1}, "responses": {"ok": 1},
        "messages": {"ok": 1, "http_400": 1}, "tokenize": {"ok": 1},
        "messages_count_tokens": {"ok": 1},
    }, by_api  # fmt: skip
    with open(tmp_path / "requests.csv") as f:
        assert [row["api"] for row in csv.DictReader(f)] == [
            "completions", "chat", "responses", "messages",
        ]  # fmt: skip
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    recorded = [json.loads(line).get("api") for line in lines if '"arrival"' in line]
    assert recorded == ["completions", "chat", "responses", "messages"]


def test_a_chat_batch_is_one_routed_request_answered_per_conversation(tmp_path) -> None:
    """vLLM's /v1/chat/completions/batch: one request to one worker (its prompt the batch's
    conversations, each rendered as chat renders it), one choice per conversation."""
    conversations = [
        [{"role": "user", "content": "first question"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "second"}],
        [{"role": "user", "content": "a third, " * 20}],
    ]

    async def go() -> None:
        async with (
            emulated_workers(2, speed=20) as urls,
            proxy(urls, "lpm", record_dir=str(tmp_path)) as (base, _),
            aiohttp.ClientSession() as session,
        ):
            alone = []
            for messages in conversations:
                answer = await client(base).chat.completions.create(
                    model="tiny", messages=messages, max_tokens=2
                )
                alone.append(answer.usage.prompt_tokens)
            body = {"model": "tiny", "messages": conversations, "max_tokens": 3}
            async with session.post(f"{base}{BATCH}", json=body) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
            assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
            assert all(c["message"]["role"] == "assistant" for c in answer["choices"])
            assert all(c["message"]["content"] for c in answer["choices"])
            assert answer["usage"]["prompt_tokens"] == sum(alone)
            assert answer["usage"]["completion_tokens"] == 3 * len(conversations)

    run(go)
    with open(tmp_path / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["api"] for row in rows] == ["chat"] * 4
    assert int(rows[-1]["prompt_tokens"]) == sum(int(row["prompt_tokens"]) for row in rows[:3])


class TestLocality:
    def test_a_session_resent_whole_hits_as_chat_does(self) -> None:
        """Agents resend the whole history each turn, with no session key: the prefix index
        keeps the turns where their KV is, whichever API carries them."""

        async def hits(api: str) -> tuple[int, int]:
            async with emulated_workers(4, speed=20) as urls, proxy(urls, "lpm") as (base, _):
                oa, ac = client(base), claude(base)
                system = "You are a coding agent. " * 60
                history: list[dict] = [{"role": "user", "content": "Fix the failing test."}]
                cached = prompt = 0
                for turn in range(10):
                    if api == "chat":
                        r = await oa.chat.completions.create(
                            model="tiny",
                            messages=[{"role": "system", "content": system}, *history],
                            max_tokens=8,
                        )
                        answer = r.choices[0].message.content
                        cached += r.usage.prompt_tokens_details.cached_tokens
                        prompt += r.usage.prompt_tokens
                    elif api == "responses":
                        r = await oa.responses.create(
                            model="tiny", instructions=system, input=history, max_output_tokens=8
                        )
                        answer = r.output_text
                        cached += r.usage.input_tokens_details.cached_tokens
                        prompt += r.usage.input_tokens
                    else:
                        m = await ac.messages.create(
                            model="tiny", system=system, messages=history, max_tokens=8
                        )
                        answer = m.content[0].text
                        cached += m.usage.cache_read_input_tokens
                        # Anthropic counts cached and cache-written tokens apart from input_tokens.
                        prompt += anthropic_prompt_tokens(m.usage)
                    history += [
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": f"tool output {turn}: " + "ok " * 30},
                    ]
                return cached, prompt

        async def go() -> None:
            chat = await hits("chat")
            for api in ("responses", "messages"):
                got = await hits(api)
                assert got[0] / got[1] >= chat[0] / chat[1] - 0.02, (api, got, chat)
            assert chat[0] / chat[1] > 0.5, chat

        run(go, timeout=180)


class TestPassedThrough:
    def test_tokenize_detokenize_and_unknown_paths(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls) as (base, _),
                aiohttp.ClientSession() as session,
            ):
                async with session.post(
                    f"{base}/tokenize", json={"model": "tiny", "prompt": "hi"}
                ) as r:
                    tokens = await r.json()
                    assert r.status == 200 and tokens["count"] == len(tokens["tokens"]) > 0
                async with session.post(
                    f"{base}/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}
                ) as r:
                    assert r.status == 200 and "hi" in (await r.json())["prompt"]
                async with session.post(
                    f"{base}/tokenize", json={"model": "nope", "prompt": "x"}
                ) as r:
                    assert r.status == 404 and (await r.json())["error"]["param"] == "model"
                async with session.post(
                    f"{base}/v1/embeddings", json={"model": "tiny", "input": "x"}
                ) as r:
                    # The emulated group generates: no embeddings, said in the OpenAI shape.
                    assert r.status == 404 and "error" in await r.json()
                async with session.get(f"{base}/v1/nothing/here") as r:
                    assert (
                        r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
                    )

        run(go)

    def test_the_realtime_socket_reaches_a_worker_and_is_bounded(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, max_body_bytes=64 * 1024) as (base, _),
                aiohttp.ClientSession() as session,
            ):
                async with session.ws_connect(f"{base}/v1/realtime?model=tiny") as ws:
                    assert (await ws.receive_json())["type"] == "session.created"
                    await ws.send_json({"type": "session.update", "model": "tiny"})
                    audio = base64.b64encode(bytes(32000)).decode()  # one second of silence
                    await ws.send_json({"type": "input_audio_buffer.append", "audio": audio})
                    await ws.send_json({"type": "input_audio_buffer.commit"})
                    kinds = []
                    while not kinds or kinds[-1] != "transcription.done":
                        kinds.append((await ws.receive_json(timeout=10))["type"])
                    assert kinds.count("transcription.delta") == 10
                    # A frame over the proxy's body limit closes the socket.
                    await ws.send_str("x" * (128 * 1024))
                    closed = await ws.receive(timeout=10)
                    assert closed.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
                async with session.get(f"{base}/v1/realtime?model=nope") as r:
                    assert r.status == 404  # refused before the upgrade

        run(go)


BATCH = "/v1/chat/completions/batch"
CONVERSATION = [{"role": "user", "content": "x"}]

HOSTILE = [
    # (path, body, expected status)
    (BATCH, json.dumps({"model": "tiny", "messages": "x"}).encode(), 400),
    (BATCH, json.dumps({"model": "tiny", "messages": []}).encode(), 400),
    (BATCH, json.dumps({"model": "tiny", "messages": [[]]}).encode(), 400),
    (BATCH, json.dumps({"model": "tiny", "messages": CONVERSATION}).encode(), 400),
    (BATCH, json.dumps({"model": "tiny", "messages": [CONVERSATION] * 1025}).encode(), 400),
    (
        BATCH,
        json.dumps({"model": "tiny", "messages": [CONVERSATION], "stream": True}).encode(),
        400,
    ),
    (BATCH, json.dumps({"model": "tiny", "messages": [CONVERSATION], "n": 2}).encode(), 400),
    (
        BATCH,
        json.dumps({"model": "tiny", "messages": [CONVERSATION], "tools": [TOOL]}).encode(),
        400,
    ),
    ("/v1/responses", b"{not json", 400),
    ("/v1/responses", json.dumps({"model": "tiny", "input": 5}).encode(), 400),
    ("/v1/responses", json.dumps({"model": "tiny", "input": [{"type": "mystery"}]}).encode(), 400),
    (
        "/v1/responses",
        json.dumps({"model": "tiny", "input": "x", "max_output_tokens": "9"}).encode(),
        400,
    ),
    ("/v1/responses", json.dumps({"model": "tiny", "input": "x", "tools": "all"}).encode(), 400),
    (
        "/v1/responses",
        json.dumps({"model": "tiny", "input": "x", "previous_response_id": 7}).encode(),
        400,
    ),
    ("/v1/responses", ("[" * 5000 + "]" * 5000).encode(), 400),
    ("/v1/responses", json.dumps({"model": "tiny", "input": "word " * 100_000}).encode(), 400),
    (
        "/v1/messages",
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}).encode(),
        400,
    ),
    ("/v1/messages", json.dumps({"model": "tiny", "max_tokens": 4, "messages": "x"}).encode(), 400),
    (
        "/v1/messages",
        json.dumps(
            {
                "model": "tiny",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"no": "type"}]}],
            }
        ).encode(),
        400,
    ),
    (
        "/v1/messages",
        json.dumps(
            {
                "model": "tiny",
                "max_tokens": 4,
                "system": 5,
                "messages": [{"role": "user", "content": "x"}],
            }
        ).encode(),
        400,
    ),
    (
        "/v1/messages/count_tokens",
        b'{"model": "tiny", "messages": [' + b"[" * 200 + b"]" * 200 + b"]}",
        400,
    ),
    ("/tokenize", b"\xff\xfe", 400),
    ("/v1/audio/transcriptions", b"not multipart", 400),
]


def test_hostile_input_to_the_new_endpoints_gets_a_4xx_in_its_apis_shape() -> None:
    async def go() -> None:
        async with (
            emulated_workers(1, speed=20) as urls,
            proxy(urls) as (base, _),
            aiohttp.ClientSession() as session,
        ):
            for path, body, status in HOSTILE:
                headers = {"Content-Type": "application/json"}
                async with session.post(f"{base}{path}", data=body, headers=headers) as r:
                    answer = await r.json()
                    assert r.status == status, (path, body[:80], r.status, answer)
                    if path.startswith("/v1/messages"):
                        assert answer["type"] == "error" and answer["error"]["message"], answer
                    else:
                        assert answer["error"]["message"], answer
            # Nothing was lost: the proxy still answers.
            r = await client(base).responses.create(model="tiny", input="ok", max_output_tokens=2)
            assert r.usage.output_tokens == 2

    run(go)
