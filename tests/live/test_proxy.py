"""The proxy over real HTTP, in front of emulated vLLM workers (fast, no model needed)."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import os
import re
import resource
import socket

import aiohttp
import pytest
from aiohttp import web

from router.proxy.app import UPSTREAM_KEEPALIVE_S
from router.proxy.settings import Tenant, keyed
from router.proxy.sse import StreamAccount, Usage, client_wants_usage, with_usage_requested
from tests.live_helpers import client, emulated_workers, proxy, run, serving
from tests.metrics_page import total


class TestOpenAIClient:
    def test_completions_and_chat_plain_and_streaming(self) -> None:
        async def go() -> None:
            async with emulated_workers(2, speed=20) as urls, proxy(urls) as (base, _):
                oa = client(base)
                c = await oa.completions.create(model="tiny", prompt="hello " * 50, max_tokens=5)
                assert c.usage.completion_tokens == 5 and c.choices[0].text
                chat = await oa.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
                )
                assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
                pieces = [
                    ch
                    async for ch in await oa.completions.create(
                        model="tiny", prompt="x y z", max_tokens=6, stream=True
                    )
                ]
                assert sum(1 for p in pieces if p.choices and p.choices[0].text) == 6
                stream = await oa.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=3,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = [ch async for ch in stream]
                assert chunks[-1].usage.completion_tokens == 3
                models = await oa.models.list()
                assert [m.id for m in models.data] == ["tiny"]

        run(go)

    def test_shared_prefixes_hit_more_under_lpm_than_round_robin(self) -> None:
        async def cached(policy: str) -> int:
            async with emulated_workers(2, speed=20) as urls, proxy(urls, policy) as (base, _):
                oa = client(base)
                total = 0
                for i in range(12):
                    doc = f"document {i % 3} " * 200  # three long shared prefixes
                    c = await oa.completions.create(
                        model="tiny", prompt=doc + f"q{i}", max_tokens=2
                    )
                    total += c.usage.prompt_tokens_details.cached_tokens
                return total

        async def go() -> None:
            lpm, rr = await cached("lpm"), await cached("round_robin")
            assert lpm > rr, (lpm, rr)

        run(go)


async def post(session: aiohttp.ClientSession, url: str, body: object, raw: bool = False):
    data = body if raw else json.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


class TestBadInput:
    @pytest.mark.parametrize(
        "path, body, status, param",
        [
            ("completions", "{not json", 400, None),
            ("completions", [1, 2], 400, None),
            ("completions", {"prompt": "x"}, 400, "model"),
            ("completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
            ("completions", {"model": "tiny"}, 400, "prompt"),
            ("completions", {"model": "tiny", "prompt": 5}, 400, "prompt"),
            ("completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
            ("completions", {"model": "tiny", "prompt": "word " * 5000}, 400, "max_tokens"),
            ("chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
            (
                "chat/completions",
                {"model": "tiny", "messages": [{"content": "x"}]},
                400,
                "messages",
            ),
        ],
    )
    def test_openai_error_shape_without_touching_a_worker(self, path, body, status, param):
        async def go() -> None:
            async with emulated_workers(1) as urls, proxy(urls) as (base, cluster):
                async with aiohttp.ClientSession() as s:
                    got, answer = await post(
                        s, f"{base}/v1/{path}", body, raw=isinstance(body, str)
                    )
                assert got == status
                assert set(answer["error"]) == {"message", "type", "param", "code"}
                assert answer["error"]["param"] == param
                assert all(w.dispatch.in_flight == 0 for w in cluster.workers.values())
                text = cluster.metrics.render().decode()
                assert "fairway_prompt_tokens_total{" not in text, "no request was routed"

        run(go)


class TestReliability:
    def test_dead_worker_is_retried_before_first_byte_and_marked_down(self) -> None:
        async def go() -> None:
            async with emulated_workers(1, speed=20) as urls:
                dead = "http://127.0.0.1:9"  # discard port: connection refused
                async with proxy([dead, *urls], "round_robin") as (base, cluster):
                    oa = client(base)
                    for _ in range(6):
                        c = await oa.completions.create(model="tiny", prompt="hi", max_tokens=2)
                        assert c.usage.completion_tokens == 2
                    text = cluster.metrics.render().decode()
                    assert 'fairway_retries_total{worker="0"}' in text
                    assert not cluster.view.workers[0].healthy
                    assert cluster.view.workers[1].healthy

        run(go)

    def test_stream_broken_midway_ends_with_an_error_event(self) -> None:
        async def broken(request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.05)
            request.transport.close()  # the worker dies mid-answer
            return resp

        async def ok(request: web.Request) -> web.Response:
            return web.Response(text="")

        async def go() -> None:
            app = web.Application()
            app.router.add_post("/v1/completions", broken)
            app.router.add_get("/health", ok)
            async with (
                serving(app) as worker,
                proxy([worker]) as (base, _),
                aiohttp.ClientSession() as s,
                s.post(
                    f"{base}/v1/completions",
                    json={"model": "tiny", "prompt": "x", "max_tokens": 5, "stream": True},
                ) as r,
            ):
                text = (await r.read()).decode()
            events = [e for e in text.split("\n\n") if e.startswith("data: ")]
            assert json.loads(events[0][6:])["choices"][0]["text"] == "a"
            assert json.loads(events[-2][6:])["error"]["code"] == "stream_broken"
            assert events[-1] == "data: [DONE]"

        run(go)

    def test_every_request_ends_when_all_workers_are_gone(self) -> None:
        async def go() -> None:
            codes = []
            async with (
                proxy(["http://127.0.0.1:9"], max_retries=1) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                for _ in range(3):
                    status, body = await post(
                        s, f"{base}/v1/completions", {"model": "tiny", "prompt": "x"}
                    )
                    codes.append(status)
                    assert "error" in body
            assert all(c in (502, 503) for c in codes)

        run(go, timeout=30)


class TestDispatchQueues:
    def test_window_holds_requests_in_the_router_and_vtc_serves_the_calm_client(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=1) as urls,
                proxy(urls, "vtc", window=1) as (base, cluster),
            ):
                done: list[str] = []

                async def ask(who: str, n: int) -> None:
                    oa = client(base, default_headers={"X-Client-Id": who})
                    await oa.completions.create(model="tiny", prompt="p " * 300, max_tokens=n)
                    done.append(who)

                flood = [asyncio.create_task(ask("flood", 8)) for _ in range(10)]
                for _ in range(200):
                    if len(cluster.workers[0].dispatch) >= 5:
                        break
                    await asyncio.sleep(0.01)
                assert len(cluster.workers[0].dispatch) >= 5, "requests wait in the router"
                assert cluster.workers[0].dispatch.in_flight == 1
                calm = asyncio.create_task(ask("calm", 8))
                await asyncio.gather(calm, *flood)
                assert done.index("calm") < 4, done

        run(go)


class TestAdmin:
    def test_admin_workers_needs_the_token(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(2) as urls,
                proxy(urls[:1], admin_token="s3cret") as (base, cluster),
                aiohttp.ClientSession() as s,
            ):
                admin = f"{base.admin}/admin/workers"
                async with s.get(admin) as r:
                    assert r.status == 401
                auth = {"Authorization": "Bearer s3cret"}
                async with s.post(admin, headers=auth, json={"url": urls[1]}) as r:
                    assert r.status == 201
                async with s.post(admin, headers=auth, json={"url": urls[0]}) as r:
                    assert r.status == 409, "a URL already in the pool is refused"
                async with s.get(admin, headers=auth) as r:
                    assert len((await r.json())["workers"]) == 2
                async with s.delete(f"{admin}?id=0", headers=auth) as r:
                    assert r.status == 200
                assert list(cluster.workers) == [1]

        run(go)


class TestClientDisconnect:
    def test_client_leaving_mid_stream_frees_the_slot(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=1) as urls,
                proxy(urls, window=1) as (
                    base,
                    cluster,
                ),
            ):
                body = {"model": "tiny", "prompt": "x " * 50, "max_tokens": 400, "stream": True}
                async with aiohttp.ClientSession() as s:
                    async with s.post(f"{base}/v1/completions", json=body) as r:
                        await r.content.readany()  # the first token, then hang up
                    for _ in range(200):
                        if cluster.workers[0].dispatch.in_flight == 0:
                            break
                        await asyncio.sleep(0.01)
                    assert cluster.workers[0].dispatch.in_flight == 0, "the window slot came back"
                    # The worker aborted it too (400 tokens would take about 5 s).
                    for _ in range(100):
                        async with s.get(f"{urls[0]}/metrics") as r:
                            scraped = await r.text()
                        if 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0' in scraped:
                            break
                        await asyncio.sleep(0.02)
                    assert 'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0' in scraped
                    status, answer = await post(
                        s,
                        f"{base}/v1/completions",
                        {"model": "tiny", "prompt": "y", "max_tokens": 2},
                    )
                    assert status == 200 and answer["usage"]["completion_tokens"] == 2
                text = cluster.metrics.render().decode()
                assert 'status="client_gone"' in text, text[:3000]

        run(go)


class TestIndexBound:
    def test_approximate_index_mirrors_the_workers_reported_cache_size(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20, num_kv_blocks=12) as urls,
                proxy(urls) as (base, cluster),
            ):
                for _ in range(100):  # the monitor reads vllm:cache_config_info
                    if cluster.view.workers[0].kv_capacity_blocks == 12:
                        break
                    await asyncio.sleep(0.02)
                assert cluster.view.workers[0].kv_capacity_blocks == 12
                oa = client(base)
                for i in range(10):  # ~3 full blocks each, all different
                    await oa.completions.create(model="tiny", prompt=f"p{i} " * 200, max_tokens=1)
                assert 0 < cluster.approx_index.num_blocks(0) <= 12
                cluster.approx_index.check_integrity()

        run(go)


class TestStreamAccounting:
    def test_events_split_across_chunks_count_once_and_usage_goes_only_to_who_asked(self) -> None:
        role = b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
        token = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
        usage = (
            b'data: {"choices": [], "usage": {"completion_tokens": 2, '
            b'"prompt_tokens_details": {"cached_tokens": 32}}}\n\n'
        )
        stream = role + token + token + usage + b"data: [DONE]\n\n"
        for forward_usage in (False, True):
            account = StreamAccount(forward_usage)
            out, tokens = b"", 0
            for i in range(0, len(stream), 7):  # chunk boundaries fall mid-event
                events, n = account.feed(stream[i : i + 7])
                out, tokens = out + events, tokens + n
            assert tokens == 2 and account.usage == Usage(2, 32)
            assert out == (stream if forward_usage else stream.replace(usage, b""))
            assert account.flush() == b""

    def test_upstream_always_asked_for_usage(self) -> None:
        body = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
        sent = with_usage_requested(body)
        assert sent["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
        assert not client_wants_usage(body) and "include_usage" not in body["stream_options"]
        assert with_usage_requested({"stream": False}) == {"stream": False}

    def test_recorded_output_tokens_are_exact_for_streams(self, tmp_path) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, "vtc", record_dir=str(tmp_path)) as (base, _),
            ):
                oa = client(base)
                chat = await oa.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=7,
                    stream=True,
                )
                chunks = [c async for c in chat]
                assert all(c.usage is None for c in chunks), "usage the client did not ask for"
                plain = await oa.completions.create(
                    model="tiny",
                    prompt="a b c",
                    max_tokens=5,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = [c async for c in plain]
                assert chunks[-1].usage.completion_tokens == 5

        run(go)
        rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
        assert [int(r["output_tokens"]) for r in rows] == [7, 5]


class TestClientIdentity:
    """Who a request is charged to: the API key's tenant, headers only from a trusted gateway;
    metric labels folded, the router's own accounting not."""

    @staticmethod
    async def _ask(base: str, headers: dict[str, str]) -> int:
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
            async with s.post(f"{base}/v1/completions", json=body, headers=headers) as r:
                return r.status

    def test_tenant_key_sets_client_and_weight_and_headers_are_ignored(self, tmp_path) -> None:
        tenants = keyed({"sk-alpha-000000": Tenant("alpha", 2.0)})

        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, tenants=tenants, trust_client_headers=False,
                      record_dir=str(tmp_path)) as (base, _),
            ):  # fmt: skip
                key = {"Authorization": "Bearer sk-alpha-000000"}
                forged = {**key, "X-Client-Id": "mallory", "X-Client-Weight": "1000"}
                assert await self._ask(base, forged) == 200
                assert await self._ask(base, {"Authorization": "Bearer sk-other-0000"}) == 401

        run(go)
        rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
        assert [(r["client"], float(r["weight"])) for r in rows] == [("alpha", 2.0)]

    def test_metrics_fold_clients_the_router_still_tells_apart(self, tmp_path) -> None:
        async def go() -> str:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, client_labels=1, record_dir=str(tmp_path)) as (base, cluster),
            ):
                for who in ("a", "b", "c"):
                    assert await self._ask(base, {"X-Client-Id": who}) == 200
                return cluster.metrics.render().decode()

        text = asyncio.run(asyncio.wait_for(go(), 60))
        rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
        assert {r["client"] for r in rows} == {"a", "b", "c"}, "real ids inside the router"
        labels = set(re.findall(r'fairway_client_service_tokens_total\{client="([^"]*)"', text))
        assert len(labels) == 2 and "other" in labels, labels
        (first,) = labels - {"other"}
        assert first.startswith("id:") and first not in ("a", "b", "c"), "the first, by pseudonym"


class TestErrorsKeepWorkersPrivate:
    def test_a_502_does_not_show_the_workers_address(self) -> None:
        async def go() -> None:
            async with (
                proxy(["http://127.0.0.1:9"], max_retries=0) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                status, body = await post(
                    s, f"{base}/v1/completions", {"model": "tiny", "prompt": "x"}
                )
            assert status == 502, body
            assert "127.0.0.1" not in body["error"]["message"], body
            assert ":9" not in body["error"]["message"], body

        run(go, timeout=30)


def test_a_client_hanging_up_aborts_its_non_streamed_request_at_the_worker() -> None:
    """A non-streamed answer is sent whole at the end, so the client's departure shows only as
    a closed connection: the proxy must pass it on, and the worker stop generating."""

    async def go() -> None:
        async with emulated_workers(1, speed=0.2) as urls, proxy(urls) as (base, cluster):
            body = {"model": "tiny", "prompt": "hello " * 20, "max_tokens": 3000}
            async with aiohttp.ClientSession() as session:
                with contextlib.suppress(asyncio.TimeoutError):
                    async with session.post(
                        f"{base}/v1/completions",
                        json=body,
                        timeout=aiohttp.ClientTimeout(total=1.0),
                    ) as r:
                        await r.read()  # fmt: skip
                deadline = asyncio.get_running_loop().time() + 10
                while await total(session, urls[0], "vllm:num_requests_running") > 0:
                    assert asyncio.get_running_loop().time() < deadline, "still generating"
                    await asyncio.sleep(0.2)
            worker = next(iter(cluster.workers.values()))
            assert worker.dispatch.in_flight == 0, "the slot came back"

    run(go)


class TestOwnTroubleIsNotTheWorkers:
    def test_no_descriptor_to_reach_a_worker_is_a_503_and_no_workers_fault(self) -> None:
        """With the open-files limit reached, the proxy cannot open a connection to a worker:
        its own trouble, not the workers'. The client gets a 503 with Retry-After, no worker
        is counted against, and once descriptors are back the next request is answered."""
        body = {"model": "tiny", "prompt": "a short prompt", "max_tokens": 2}

        async def go() -> None:
            async with (
                emulated_workers(2, speed=50) as urls,
                proxy(urls, health_interval=60.0) as (base, cluster),
                aiohttp.ClientSession() as session,
            ):
                async with session.post(f"{base}/v1/completions", json=body) as r:
                    assert r.status == 200  # the client's connection, kept open
                    await r.read()
                # The proxy's idle connections to the workers close (UPSTREAM_KEEPALIVE_S).
                await asyncio.sleep(UPSTREAM_KEEPALIVE_S + 0.5)
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                held: list[socket.socket] = []
                try:
                    resource.setrlimit(
                        resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard)
                    )
                    for _ in range(64):  # bounded: the limit is reached within a few
                        try:
                            held.append(socket.socket())
                        except OSError:
                            break
                    async with session.post(f"{base}/v1/completions", json=body) as r:
                        status, retry_after = r.status, r.headers.get("Retry-After")
                        error = (await r.json())["error"]
                finally:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                    for s in held:
                        s.close()
                assert (status, retry_after, error["code"]) == (503, "1", "router_overloaded")
                for w in (0, 1):
                    assert cluster.workers[w].consecutive_failures == 0
                    assert cluster.view.workers[w].healthy
                async with session.post(f"{base}/v1/completions", json=body) as r:
                    assert r.status == 200

        run(go)
