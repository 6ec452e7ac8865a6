"""The replicas' stored responses in a real redis-server: one key per response, read only by
its owner, gone after the retention; and when the server stops answering (stopped, then
killed), each call fails as StoreUnavailable within a few seconds rather than hanging. A
replica's app keeps its responses there, under its run's prefix."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest
import redis
from aiohttp import web
from openai.types.responses import Response

from router.proxy.conversations import RESPONSES, RedisResponses, Stored, StoreUnavailable
from router.proxy.responses import GENERATING, HOLD
from router.proxy.service.config import validate_config
from router.proxy.service.replicas import REPLICA_HEADER, ReplicaSpec, build_replica_app
from router.proxy.service.store import OwnRedis, Store, redis_server
from tests.live_helpers import emulated_workers, free_port, run, tokenizer_dir
from tests.metrics_page import total
from tests.system.test_budget_replicas import kill, own_redis
from tests.system.test_live_replicas import fairway_serve

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (`make test` installs it)"
)

PREFIX = "fairway:test"
RETENTION = 1.0
PROMPT = [{"type": "message", "role": "user", "content": "hello"}]


def stored(owner: str, text: str) -> Stored:
    answer = [{"type": "output_text", "text": text}]
    output = [{"type": "message", "role": "assistant", "content": answer}]
    return Stored(owner, {"id": f"resp_{text}", "object": "response", "output": output}, PROMPT)


def server_pid(server: OwnRedis) -> int:
    """The redis-server this test started: its guard's one child."""
    assert server.proc is not None
    guard = server.proc.pid
    children = Path(f"/proc/{guard}/task/{guard}/children").read_text().split()
    assert len(children) == 1, f"the guard {guard} runs one server: {children}"
    return int(children[0])


async def fails_soon(call, within: float = 5.0) -> float:
    """Await `call`, which must raise StoreUnavailable within `within` seconds; how long it
    took."""
    start = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await asyncio.wait_for(call, within + 5)  # a hang fails the test, not the run
    took = time.monotonic() - start
    assert took < within, f"StoreUnavailable after {took:.1f} s"
    return took


def test_responses_in_redis(tmp_path: Path) -> None:
    async def go() -> None:
        with own_redis(tmp_path / "redis") as server:
            client = Store(server.url).client()
            try:
                store = RedisResponses(client, PREFIX, RETENTION)
                await store.put("resp_1", stored("team-a", "one"))
                assert await store.get("team-a", "resp_1") == stored("team-a", "one")
                assert await store.get("team-b", "resp_1") is None, "another owner's"
                assert await store.get("team-a", "resp_2") is None, "never stored"
                ttl = await client.pttl(f"{PREFIX}:response:resp_1")
                assert 0 < ttl <= RETENTION * 1000, f"Redis expires it: {ttl} ms left"

                assert await store.delete("team-b", "resp_1") is False
                assert await store.delete("team-a", "resp_1") is True
                assert await store.get("team-a", "resp_1") is None
                assert await store.delete("team-a", "resp_1") is False

                await store.put("resp_3", stored("team-a", "three"))
                put_at = time.monotonic()
                while await store.get("team-a", "resp_3") is not None:
                    assert time.monotonic() - put_at < RETENTION + 3, "never expired"
                    await asyncio.sleep(0.05)
                assert time.monotonic() - put_at > RETENTION * 0.9, "expired too soon"

                # A background response's hold lasts until it lapses, unless renewed.
                await store.hold("resp_3", 0.4)
                held_at = time.monotonic()
                assert await store.is_held("resp_3") and not await store.is_held("resp_9")
                assert 0 < await client.pttl(f"{PREFIX}:generating:resp_3") <= 400
                await asyncio.sleep(0.2)
                await store.hold("resp_3", 0.4)  # renewed: 0.4 s from now
                while await store.is_held("resp_3"):
                    assert time.monotonic() - held_at < 3, "never lapsed"
                    await asyncio.sleep(0.02)
                assert time.monotonic() - held_at > 0.55, "lapsed before its renewal ran out"

                # Stopped: connections open, nothing answered. Each call ends at the
                # client's 2 s timeout.
                pid = server_pid(server)
                os.kill(pid, signal.SIGSTOP)
                try:
                    await fails_soon(store.get("team-a", "resp_1"))
                    await fails_soon(store.put("resp_4", stored("team-a", "four")))
                finally:
                    os.kill(pid, signal.SIGCONT)

                await kill(server)  # refused at once
                assert await fails_soon(store.get("team-a", "resp_1")) < 1.0
                assert await fails_soon(store.put("resp_5", stored("team-a", "five"))) < 1.0
                assert await fails_soon(store.delete("team-a", "resp_1")) < 1.0
            finally:
                with contextlib.suppress(redis.RedisError, OSError):
                    await client.aclose()

    run(go, timeout=60)


def test_a_bounded_store_drops_its_oldest_responses_and_keeps_the_rest(tmp_path) -> None:
    """`fairway serve`'s own Redis is bounded in bytes, as one router's store is: past the
    bound the least recently used responses go, every put is taken, and what has no expiry
    (membership, shared counters) stays."""
    bound = 8 * 1024 * 1024
    text = "x" * 32 * 1024  # a response of about 32 KiB: 400 of them are 1.6x the bound

    async def go() -> None:
        with redis_server(tmp_path / "redis", max_bytes=bound) as url:
            client = Store(url).client()
            try:
                await client.hset(f"{PREFIX}:members", mapping={"w0": "1", "w1": "1"})
                store = RedisResponses(client, PREFIX, retention=600.0)
                for i in range(400):
                    await store.put(f"resp_{i}", stored("team-a", f"{i}-{text}"))
                info = await client.info("memory")
                assert info["used_memory"] <= bound, info["used_memory"]
                assert info["maxmemory_policy"] == "volatile-lru"
                newest = await store.get("team-a", "resp_399")
                assert newest == stored("team-a", f"399-{text}")
                kept = [await client.exists(store.key(f"resp_{i}")) for i in range(400)]
                assert 40 < sum(kept) < 400, f"{sum(kept)} of 400 kept"
                # Redis's LRU is approximate (it evicts the least recent of a few keys it
                # samples), so the oldest go first as a rule, not one by one: resp_0 outlived
                # the bound in about 1 run in 15 here. Of the oldest and the newest 40, runs
                # kept 0-4 and 32-40; evicting at random would keep about 9 of each.
                oldest, newest_kept = sum(kept[:40]), sum(kept[-40:])
                assert oldest <= 8 and newest_kept >= 28, (oldest, newest_kept)
                assert await client.hgetall(f"{PREFIX}:members") == {b"w0": b"1", b"w1": b"1"}
            finally:
                await client.aclose()

    run(go, timeout=60)


def test_a_replica_keeps_its_responses_in_the_store(tmp_path: Path) -> None:
    async def go() -> None:
        with own_redis(tmp_path / "redis") as server:
            config = validate_config({"port": free_port(), "responses": {"retention": 30}})
            spec = ReplicaSpec(
                0,
                config.with_secrets(),
                {"tiny": str(tokenizer_dir())},
                [],
                server.url,
                "fairway:replica-test",
                free_port(),
            )
            runner = web.AppRunner(build_replica_app(spec))
            await runner.setup()  # its cleanup contexts open: the store's client among them
            try:
                store = runner.app[RESPONSES]
                assert isinstance(store, RedisResponses), type(store)
                assert (store.prefix, store.retention) == ("fairway:replica-test", 30)
                await store.put("resp_1", stored("team-a", "one"))
            finally:
                await runner.cleanup()
            check = redis.Redis.from_url(server.url)
            try:
                key = "fairway:replica-test:response:resp_1"
                assert 0 < check.pttl(key) <= 30_000, "stored, expiring after the retention"
            finally:
                check.close()

    run(go, timeout=60)


@pytest.mark.slow
def test_chains_cross_replicas_and_a_dead_store_fails_only_them(tmp_path) -> None:
    """Two replicas of `fairway serve` share the conversation store: a chain's turns alternate
    between them. With the store killed, a chained turn gets a 503 that says why, while a turn
    that continues nothing is answered as before."""

    async def go() -> None:
        with own_redis(tmp_path / "redis") as server:
            async with (
                emulated_workers(2, speed=20) as urls,
                fairway_serve(tmp_path, urls, 2, redis_url=server.url) as (_, own, _, log_path),
            ):
                replicas = [
                    openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
                    for url in own
                ]
                previous = None
                for turn in range(4):  # each turn at the other replica
                    r = await replicas[turn % 2].responses.create(
                        model="tiny", input=f"turn {turn}", previous_response_id=previous,
                        max_output_tokens=3,
                    )  # fmt: skip
                    assert r.previous_response_id == previous
                    previous = r.id
                assert (await replicas[0].responses.retrieve(previous)).id == previous

                await kill(server)
                with pytest.raises(openai.APIStatusError) as down:
                    await replicas[1].responses.create(
                        model="tiny", input="more", previous_response_id=previous
                    )
                assert down.value.status_code == 503
                assert down.value.body["code"] == "store_unavailable", down.value.body
                plain = await replicas[0].responses.create(
                    model="tiny", input="fresh", max_output_tokens=3
                )
                assert plain.usage.output_tokens == 3
                async with aiohttp.ClientSession() as s:
                    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
                    async with s.post(f"{own[1]}/v1/chat/completions", json=chat) as r:
                        assert r.status == 200
                assert "Traceback" not in log_path.read_text()

    run(go, timeout=180)


@dataclass
class Background:
    """A long background response started at the first of two replicas."""

    workers: list[str]  # the emulated workers' URLs
    own: list[str]  # each replica's own URL
    first: openai.AsyncOpenAI
    second: openai.AsyncOpenAI
    started: Response
    session: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def background_at_first(tmp_path: Path, workers: int) -> AsyncIterator[Background]:
    """`fairway serve --routers 2` with its own Redis, over slow emulated workers; its log
    must hold no traceback at the end."""
    with own_redis(tmp_path / "redis") as server:
        async with (
            emulated_workers(workers, speed=0.05) as urls,
            fairway_serve(tmp_path, urls, 2, redis_url=server.url) as (_, own, _, log_path),
            aiohttp.ClientSession() as session,
        ):
            first, second = (
                openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0) for url in own
            )
            started = await first.responses.create(
                model="tiny", input="write a long essay", background=True, max_output_tokens=500
            )
            yield Background(urls, own, first, second, started, session)
            assert "Traceback" not in log_path.read_text()


def test_a_background_response_is_cancelled_from_the_other_replica(tmp_path) -> None:
    """A background response generating at one replica is stopped when the client asks the
    other: that replica asks through the store, the one running it aborts it at its worker,
    and both then read it as cancelled."""

    async def running_at(session: aiohttp.ClientSession, urls: list[str]) -> float:
        return sum([await total(session, url, "vllm:num_requests_running") for url in urls])

    async def go() -> None:
        async with background_at_first(tmp_path, workers=2) as bg:
            for _ in range(250):  # it reaches its worker
                if await running_at(bg.session, bg.workers):
                    break
                await asyncio.sleep(0.02)
            assert await running_at(bg.session, bg.workers) == 1
            asked = time.monotonic()
            cancelled = await bg.second.responses.cancel(bg.started.id)
            assert cancelled.status == "cancelled"
            assert time.monotonic() - asked < 3.0
            for _ in range(100):  # the worker aborted it
                if not await running_at(bg.session, bg.workers):
                    break
                await asyncio.sleep(0.02)
            assert await running_at(bg.session, bg.workers) == 0
            for replica in (bg.first, bg.second):
                assert (await replica.responses.retrieve(bg.started.id)).status == "cancelled"
            with pytest.raises(openai.NotFoundError):  # another owner's: not there at all
                other = openai.AsyncOpenAI(
                    base_url=f"{bg.own[1]}/v1", api_key="k", max_retries=0,
                    default_headers={"X-Client-Id": "someone-else"},
                )  # fmt: skip
                await other.responses.cancel(bg.started.id)

    run(go, timeout=120)


def test_a_background_response_of_a_killed_replica_ends_as_failed(tmp_path) -> None:
    """SIGKILL the replica generating a background response: once its hold lapses, the other
    replica reads the response as failed (a client polling it gets an end, not `queued`
    forever), and it can no longer be cancelled."""

    async def go() -> None:
        async with background_at_first(tmp_path, workers=1) as bg:
            rid = bg.started.id
            assert (await bg.second.responses.retrieve(rid)).status in GENERATING
            async with bg.session.get(f"{bg.own[0]}/health") as r:
                pid = int(r.headers[REPLICA_HEADER].split("-")[1])  # "<index>-<pid>"
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            while (got := await bg.second.responses.retrieve(rid)).status in GENERATING:
                assert time.monotonic() - killed < HOLD + 10, "still generating"
                await asyncio.sleep(0.2)
            assert got.status == "failed" and got.error.code == "server_error", got
            assert time.monotonic() - killed > HOLD / 2, "failed while its hold was fresh"
            with pytest.raises(openai.BadRequestError, match=r"has ended \(failed\)"):
                await bg.second.responses.cancel(rid)

    run(go, timeout=120)
