"""The admin API's worker pool (issue 27 D): it refuses nonsense, and under `--routers N` an add
or a remove made at any replica reaches every replica, with the same worker ids.

A URL already in the pool is a 409 and a malformed one a 400, both in the OpenAI error shape,
never a 5xx, and the pool is unchanged. With replicas, the pool is a log in the store: after a
change at one replica, every replica's `/admin/workers` lists the same workers under the same
ids (and the same version) within two sync intervals. Bounded: a few dozen admin calls and
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil

import aiohttp
import pytest

from router.proxy.app import create_app
from router.proxy.prompts import PromptEncoder
from router.proxy.service.config import ClusterConfig
from router.proxy.service.serve import build_cluster
from router.proxy.settings import ProxySettings
from tests.live_helpers import BLOCK, emulated_workers, free_port, run, serving, tokenizer_dir
from tests.system.test_live_replicas import fairway_serve

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (`make test` installs it)"
)

SYNC = 0.1
TOKEN = "admin-token-1234"  # what fairway_serve configures
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BAD_URLS = [
    None,
    42,
    "",
    "127.0.0.1:8000",
    "ftp://127.0.0.1:8000",
    "http://",
    "http://127.0.0.1:70000",
    "http://127.0.0.1:port",
    "http://user:secret@127.0.0.1:8000",
    "http://127.0.0.1:8000/v1?x=1",
    "http://127.0.0.1 :8000",
]


async def call(s: aiohttp.ClientSession, method: str, url: str, **kw) -> tuple[int, dict]:
    async with s.request(method, url, headers=AUTH, **kw) as r:
        return r.status, await r.json()


async def pool(s: aiohttp.ClientSession, base: str) -> tuple[list[tuple[int, str]], object]:
    """(id, url) of each worker in the replica's pool, and its version."""
    status, body = await call(s, "GET", f"{base}/admin/workers")
    assert status == 200, body
    return sorted((w["id"], w["url"]) for w in body["workers"]), body.get("version")


def assert_error_shape(body: dict, param: str) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert error["param"] == param and error["message"], body


async def assert_refuses_nonsense(s: aiohttp.ClientSession, base: str, pool_urls: list[str]):
    before = await pool(s, base)
    for url in BAD_URLS:
        status, body = await call(s, "POST", f"{base}/admin/workers", json={"url": url})
        assert status == 400, (url, status, body)
        assert_error_shape(body, "url")
    wrong = [("kv_events", 5557), ("role", "leader"), ("role", ["decode"]), ("model", "no-such")]
    wrong += [("model", {"name": "tiny"})]
    for field, value in wrong:
        bad = {"url": "http://127.0.0.1:1", field: value}
        status, body = await call(s, "POST", f"{base}/admin/workers", json=bad)
        assert status == 400, (bad, status, body)
        assert_error_shape(body, field)
    for url in pool_urls:
        for spelling in (url, url + "/", url.upper().replace("HTTP://", "http://")):
            status, body = await call(s, "POST", f"{base}/admin/workers", json={"url": spelling})
            assert status == 409, (spelling, status, body)
            assert_error_shape(body, "url")
            assert body["error"]["code"] == "worker_exists", body
    for wid in ("99", "x", "-1"):
        status, body = await call(s, "DELETE", f"{base}/admin/workers?id={wid}")
        assert status == 404, (wid, status, body)
    assert await pool(s, base) == before, "nothing refused changed the pool"


@contextlib.asynccontextmanager
async def admin_proxy(worker_urls: list[str]):
    """One proxy in this process whose only listener is its admin one; yields (URL, cluster)."""
    cluster = build_cluster(ClusterConfig(block_size=BLOCK))
    for url in worker_urls:
        cluster.add_worker(url)
    port = free_port()
    settings = ProxySettings(model_name="tiny", admin_token=TOKEN, admin_port=port)
    app = create_app(cluster, PromptEncoder(tokenizer_dir(), BLOCK), settings)
    async with serving(app, port) as url:
        yield url, cluster


def test_one_proxy_refuses_a_duplicate_and_a_bad_url() -> None:
    async def go() -> None:
        async with (
            emulated_workers(2, speed=20) as urls,
            admin_proxy(urls[:1]) as (base, cluster),
            aiohttp.ClientSession() as s,
        ):
            await assert_refuses_nonsense(s, base, urls[:1])
            status, body = await call(s, "POST", f"{base}/admin/workers", json={"url": urls[1]})
            assert status == 201 and body["id"] == 1, body
            status, body = await call(s, "POST", f"{base}/admin/workers", json={"url": urls[1]})
            assert status == 409, body
            assert [w.url for w in cluster.workers.values()] == urls

    run(go)


@pytest.mark.slow
def test_an_add_or_remove_at_one_replica_reaches_every_replica(tmp_path) -> None:
    async def go() -> None:
        async with (
            emulated_workers(4, speed=20) as urls,
            fairway_serve(
                tmp_path, urls[:2], 2, policy={"name": "round_robin"}, router_sync=SYNC
            ) as (
                base,
                own,
                proc,
                log_path,
            ),
            aiohttp.ClientSession() as s,
        ):

            async def every_replica() -> list:
                await asyncio.sleep(2 * SYNC + 0.05)  # two sync intervals, and a round trip
                return [await pool(s, u) for u in own]

            start = await every_replica()
            assert start[0] == start[1] == ([(0, urls[0]), (1, urls[1])], 0), start

            status, body = await call(s, "POST", f"{own[0]}/admin/workers", json={"url": urls[2]})
            assert status == 201 and body["id"] == 2, body
            added = await every_replica()
            assert added[0] == added[1] == ([(0, urls[0]), (1, urls[1]), (2, urls[2])], 1)

            status, body = await call(s, "DELETE", f"{own[1]}/admin/workers?id=0")
            assert status == 200, body
            removed = await every_replica()
            assert removed[0] == removed[1] == ([(1, urls[1]), (2, urls[2])], 2), removed

            # The same URL at both replicas at once: the store takes one, refuses the other.
            tries = [
                call(s, "POST", f"{u}/admin/workers", json={"url": urls[3] + "/"}) for u in own
            ]
            statuses = sorted(status for status, _ in await asyncio.gather(*tries))
            assert statuses == [201, 409], statuses
            # A removed worker comes back under a new id: ledger keys are never reused.
            status, body = await call(s, "POST", f"{own[1]}/admin/workers", json={"url": urls[0]})
            assert status == 201 and body["id"] == 4, body
            final = await every_replica()
            expect = [(1, urls[1]), (2, urls[2]), (3, urls[3]), (4, urls[0])]
            assert final[0] == final[1] == (expect, 4), final

            for u in own:
                await assert_refuses_nonsense(s, u, urls)
            # Both replicas route to the pool they agree on (round robin: every worker).
            seen = set()
            for i in range(16):
                body = {"model": "tiny", "prompt": f"question {i} " * 20, "max_tokens": 2}
                async with s.post(f"{own[i % 2]}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    seen.add(int(r.headers["X-Fairway-Worker"]))
            assert seen == {1, 2, 3, 4}, seen

            # A server's role travels with it: added as a decode worker at one replica, it is
            # one at the other (a dead address: it only has to be listed).
            dead = "http://127.0.0.1:1"
            status, body = await call(
                s, "POST", f"{own[0]}/admin/workers", json={"url": dead, "role": "decode"}
            )
            assert status == 201 and body["role"] == "decode", body
            await every_replica()
            status, body = await call(s, "GET", f"{own[1]}/admin/workers")
            assert {w["url"]: w["role"] for w in body["workers"]}[dead] == "decode", body

    run(go, timeout=180)
