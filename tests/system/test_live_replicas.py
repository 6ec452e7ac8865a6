"""Live router replicas: counters and routing decisions shared through a real redis-server.

Fast: two proxies in this process, each with its own LiveCluster, synced by hand through the
redis-server `fairway serve` would start. Slow: `fairway serve --routers N` as a user runs it
(it starts its own Redis), with a replica SIGKILLed under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio
import yaml

from router.core import Router
from router.ledger import Ledger
from router.proxy.service.replicas import REPLICA_HEADER
from router.proxy.service.serve import SHUTDOWN_GRACE
from router.proxy.service.shared_state import SharedState, decode_key, encode_key
from router.proxy.service.store import redis_server
from router.runtime.processes import wait_healthy_async
from tests.live_helpers import (
    BLOCK,
    ROOT,
    client,
    emulated_processes,
    emulated_workers,
    free_port,
    free_ports,
    proxy,
    run,
    tokenizer_dir,
)
from traces.load import LoadSpec, Outcome, request_body, send

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (`make test` installs it)"
)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


_runs = iter(range(1 << 30))


def sharing(router: Router, url: str, name: str, prefix: str) -> SharedState:
    return SharedState(router, redis.asyncio.Redis.from_url(url), prefix, name, interval=60)


def counters(router: Router) -> dict[tuple, dict]:
    """Every nonzero ledger value of a router, by ledger key."""
    out = {k: {f: v for f, v in ledger.items() if v} for k, ledger in router.ledgers().items()}
    return {k: v for k, v in out.items() if v}


class TestConfig:
    @pytest.mark.parametrize(
        "raw, field",
        [
            ({"routers": 0}, "routers"),
            ({"routers": "many"}, "routers"),
            ({"router_sync": 0}, "router_sync"),
            ({"router_sync": -1}, "router_sync"),
            ({"redis_url": "http://127.0.0.1:6379"}, "redis_url"),
            ({"routers": 2, "replica_ports": [9001]}, "replica_ports"),
            ({"routers": 2, "replica_ports": [9001, 9001]}, "replica_ports"),
            ({"routers": 2, "port": 9001, "replica_ports": [9001, 9002]}, "replica_ports"),
        ],
    )
    def test_errors_name_the_field(self, raw, field) -> None:
        from router.proxy.service.config import validate_config

        with pytest.raises(ValueError, match=rf"{field}: "):
            validate_config(raw)

    def test_replica_ports_default_to_the_ports_after_port(self) -> None:
        from router.proxy.service.config import validate_config
        from router.proxy.service.replicas import replica_ports

        config = validate_config({"routers": 3, "port": 9000, "router_sync": 0.5})
        assert replica_ports(config) == [9001, 9002, 9003]


class TestSupervisor:
    def test_restarts_a_replica_that_dies_and_gives_up_on_one_that_cannot_start(self) -> None:
        from router.proxy.service.replicas import ReplicaSpec, Supervisor

        spec = ReplicaSpec(0, {}, "", [], "redis://127.0.0.1:9/0", "p", 9, os.getpid())
        dying = Supervisor([spec], poll=0.05, argv=[sys.executable, "-c", "raise SystemExit(3)"])
        dying.max_quick_deaths = 2
        started = time.monotonic()
        assert dying.run() == 1, "gave up and said so"
        assert dying.restarts == 2 and time.monotonic() - started < 10
        assert all(p.returncode is not None for p in dying.procs.values())


class TestKeys:
    @pytest.mark.parametrize(
        "key", ["tenant-1", ("tenant-1", 0), ("queue", 3, "counters"), 7, ("é", (1, "x"))]
    )
    def test_round_trip(self, key) -> None:
        assert decode_key(encode_key(key)) == key
        assert encode_key(key) == encode_key(decode_key(encode_key(key))), "deterministic"


class TestSharedCounters:
    def test_a_client_charged_at_one_replica_is_seen_at_the_other_after_a_sync(
        self, redis_url
    ) -> None:
        async def go() -> None:
            prefix = f"test:{next(_runs)}"
            async with (
                emulated_workers(2, speed=20) as urls,
                proxy(urls, "vtc") as (base_a, a),
                proxy(urls, "vtc") as (base_b, b),
            ):
                sa = sharing(a.router, redis_url, "a", prefix)
                sb = sharing(b.router, redis_url, "b", prefix)
                body = {"model": "tiny", "prompt": "hello " * 40, "max_tokens": 4}
                await client(base_a).completions.create(
                    **body, extra_headers={"X-Client-Id": "alice"}
                )
                charged = counters(a.router)
                assert any("alice" in v for v in charged.values()), charged
                assert counters(b.router) == {}
                await sa.sync()
                await sb.sync()
                assert counters(b.router) == charged, "B sees what A charged after a sync"

                await client(base_b).completions.create(
                    **body, extra_headers={"X-Client-Id": "bob"}
                )
                await sb.sync()
                await sa.sync()
                assert counters(a.router) == counters(b.router)
                both = {f for v in counters(a.router).values() for f in v}
                assert both == {"alice", "bob"}
                await sa.client.aclose()
                await sb.client.aclose()

        run(go)

    def test_totals_are_the_sum_of_every_replicas_changes(self, redis_url) -> None:
        async def go() -> None:
            prefix = f"test:{next(_runs)}"
            routers = [_router() for _ in range(3)]
            states = [sharing(r, redis_url, str(i), prefix) for i, r in enumerate(routers)]
            for i, r in enumerate(routers):
                ledger = _vtc(r)
                ledger["alice"] = ledger.get("alice", 0.0) + 10.0 * (i + 1)
                ledger[f"only-{i}"] = 1.0
            for _ in range(2):  # the first to sync sees the others only the second time round
                for s in states:
                    await s.sync()
            for r in routers:
                assert dict(_vtc(r)) == {"alice": 60.0, "only-0": 1.0, "only-1": 1.0,
                                         "only-2": 1.0}  # fmt: skip
            for s in states:
                await s.client.aclose()

        run(go)

    def test_a_charge_during_the_round_trip_is_kept_and_sent_next_time(self, redis_url) -> None:
        async def go() -> None:
            prefix = f"test:{next(_runs)}"
            a, b = _router(), _router()
            sa, sb = sharing(a, redis_url, "a", prefix), sharing(b, redis_url, "b", prefix)
            _vtc(a)["alice"] = 5.0
            real = sa.client.pipeline

            def pipeline(*args, **kw):
                pipe = real(*args, **kw)
                execute = pipe.execute

                async def charging_meanwhile(*a_, **kw_):
                    _vtc(a)["alice"] += 2.0  # a request charged while the reply is on its way
                    return await execute(*a_, **kw_)

                pipe.execute = charging_meanwhile
                return pipe

            sa.client.pipeline = pipeline  # type: ignore[method-assign]
            await sa.sync()
            assert _vtc(a)["alice"] == 7.0, "the store's 5 plus the 2 charged since the take"
            sa.client.pipeline = real  # type: ignore[method-assign]
            await sa.sync()
            await sb.sync()
            assert _vtc(b)["alice"] == 7.0 and _vtc(a)["alice"] == 7.0
            for s in (sa, sb):
                await s.client.aclose()

        run(go)

    def test_a_failed_round_keeps_its_changes(self, redis_url) -> None:
        async def go() -> None:
            prefix = f"test:{next(_runs)}"
            a, b = _router(), _router()
            port = free_port()  # nothing listens there
            down = SharedState(a, redis.asyncio.Redis(port=port), prefix, "a", 60)
            _vtc(a)["alice"] = 3.0
            with pytest.raises((redis.RedisError, OSError)):
                await down.sync()
            assert _vtc(a)["alice"] == 3.0, "local values stand while the store is away"
            down.client = redis.asyncio.Redis.from_url(redis_url)
            await down.sync()
            sb = sharing(b, redis_url, "b", prefix)
            await sb.sync()
            assert _vtc(b)["alice"] == 3.0, "what the failed round took was sent by the next"
            for s in (down, sb):
                await s.client.aclose()

        run(go)


def _router() -> Router:
    from router.proxy.service.config import ClusterConfig
    from router.proxy.service.serve import build_cluster

    cluster = build_cluster(ClusterConfig(policy={"name": "vtc"}, block_size=BLOCK))
    cluster.add_worker("http://127.0.0.1:9")
    return cluster.router


def _vtc(router: Router) -> Ledger:
    return router.ledgers()[("queue", 0, "counters")]


class TestSharedRouting:
    def test_decisions_at_one_replica_reach_the_others_index(self, redis_url) -> None:
        async def go() -> None:
            prefix = f"test:{next(_runs)}"
            async with (
                emulated_workers(2, speed=20) as urls,
                proxy(urls, "lpm") as (base_a, a),
                proxy(urls, "lpm") as (base_b, b),
            ):
                sa = sharing(a.router, redis_url, "a", prefix)
                sb = sharing(b.router, redis_url, "b", prefix)
                docs = [f"document {i} " * 150 for i in range(6)]
                at_a = [await _worker_of(base_a, d + "first question") for d in docs]
                assert len(set(at_a)) == 2, "least load spread the documents at A"
                routed = [h for h, _, _ in a.router.indexes.routing_log or []]
                assert all(not b.approx_index.match(h) for h in routed)
                await sa.sync()
                await sb.sync()
                assert sb.num_learned == len(docs)
                for hashes, wid in zip(routed, at_a, strict=True):
                    assert b.approx_index.match(hashes).get(int(wid)) == len(hashes)
                at_b = [await _worker_of(base_b, d + "second question") for d in docs]
                assert at_b == at_a, "B sends each document where A did"
                reasons = b.router.decisions
                assert reasons["longest prefix match"] == len(docs), reasons
                await sa.sync()
                assert sa.num_learned == 0, "a replica does not learn its own decisions"
                for s in (sa, sb):
                    await s.client.aclose()

        run(go)


async def _worker_of(base: str, prompt: str) -> str:
    async with aiohttp.ClientSession() as s:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
        async with s.post(f"{base}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return r.headers["X-Fairway-Worker"]


# --------------------------------------------------------------- fairway serve --routers N


@contextlib.asynccontextmanager
async def fairway_serve(tmp_path: Path, worker_urls: list[str], routers: int, **extra):
    """`fairway serve --routers N` in front of `worker_urls`, as a user starts it; stopped by
    SIGTERM (its replicas and its Redis with it). Yields (base URL, own URLs, process, log)."""
    port, *own = free_ports(1 + routers)
    config = {
        "model": str(tokenizer_dir()),
        "port": port,
        "replica_ports": own,
        "admin_token": "admin-token-1234",
        "trust_client_headers": True,
        "health_interval": 0.2,
        "workers": {"urls": worker_urls},
        **extra,
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "serve.log"
    log = open(log_path, "wb")  # noqa: SIM115
    argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(path),
            "--routers", str(routers)]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    own_urls = [f"http://127.0.0.1:{p}" for p in own]
    try:
        await asyncio.gather(*(wait_healthy_async(u, 90) for u in own_urls))
        yield f"http://127.0.0.1:{port}", own_urls, proc, log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def started_pids(log_path: Path) -> list[int]:
    """The replicas' and Redis's pids, as `fairway serve` logged them."""
    text = log_path.read_text(errors="replace")
    return [int(p) for p in re.findall(r"(?:replica \d+: pid|\(pid) (\d+)", text)]


def is_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


async def replica_state(session: aiohttp.ClientSession, own_url: str) -> dict:
    headers = {"Authorization": "Bearer admin-token-1234"}
    async with session.get(f"{own_url}/admin/replica", headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def ended_at(session: aiohttp.ClientSession, own_url: str) -> tuple[str, Counter[str]]:
    """(the replica's token, its requests ended by status), from its own /metrics."""
    async with session.get(f"{own_url}/metrics") as r:
        token, text = r.headers[REPLICA_HEADER], await r.text()
    ended: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("fairway_requests_total{"):
            status = re.search(r'status="([^"]*)"', line).group(1)  # type: ignore[union-attr]
            ended[status] += int(float(line.rsplit(" ", 1)[1]))
    busy = [ln for ln in text.splitlines() if ln.startswith(("fairway_router_queue_depth{",
            "fairway_worker_in_flight{")) and float(ln.rsplit(" ", 1)[1]) != 0]  # fmt: skip
    assert not busy, f"replica {token} still holds requests: {busy}"
    return token, ended


@pytest.mark.slow
class TestServeReplicas:
    def test_serve_shares_counters_and_routing_between_its_replicas(self, tmp_path) -> None:
        async def go() -> None:
            async with (
                emulated_workers(2, speed=20) as urls,
                fairway_serve(tmp_path, urls, 2, policy={"name": "vtc"}, router_sync=0.1) as (
                    base, own, proc, log_path),
                aiohttp.ClientSession() as s,
            ):  # fmt: skip
                pids = started_pids(log_path)
                assert len(pids) == 3, "two replicas and Redis"
                oa = client(own[0])  # through replica 0's own port: it is charged there
                await oa.completions.create(model="tiny", prompt="hi " * 300, max_tokens=3,
                                            extra_headers={"X-Client-Id": "alice"})  # fmt: skip
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    states = [await replica_state(s, u) for u in own]
                    seen = [_values_of(st, "alice") for st in states]
                    if seen[0] and seen[1] == seen[0] and states[1]["learned"] >= 1:
                        break
                    await asyncio.sleep(0.1)
                assert seen[0] and seen[1] == seen[0], f"alice at replica 0 and 1: {seen}"
                assert states[1]["learned"] >= 1, "replica 1 learned replica 0's decision"
                # Through the shared port: the kernel spreads connections across replicas.
                seen_tokens = set()
                for _ in range(30):
                    async with (
                        aiohttp.ClientSession() as fresh,  # a new connection each time
                        fresh.get(f"{base}/v1/models") as r,
                    ):
                        seen_tokens.add(r.headers[REPLICA_HEADER].split("-")[0])
                assert seen_tokens == {"0", "1"}, seen_tokens
            assert proc.returncode == 0, log_path.read_text()[-2000:]
            assert not [p for p in pids if is_running(p)], "replicas and Redis stopped"

        run(go, timeout=180)

    def test_replicas_and_redis_die_with_a_killed_parent(self, tmp_path) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                fairway_serve(tmp_path, urls, 2) as (base, own, proc, log_path),
            ):
                pids = started_pids(log_path)
                redis_port = int(re.search(r"redis://127.0.0.1:(\d+)", log_path.read_text())[1])
                proc.kill()  # no chance to stop anything itself
                # Each bounds its own stop: a replica by the proxy's grace, the guard by its own.
                deadline = time.monotonic() + SHUTDOWN_GRACE + 15
                while [p for p in pids if is_running(p)] and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                alive = [p for p in pids if is_running(p)]
                assert not alive, f"alive: {alive} of {pids}\n{log_path.read_text()[-4000:]}"
                with pytest.raises(OSError):
                    socket.create_connection(("127.0.0.1", redis_port), 1).close()

        run(go, timeout=120)

    def test_a_killed_replica_loses_no_request_of_the_others(self, tmp_path) -> None:
        """SIGKILL one of three replicas mid-load: every request the others took in ends
        complete, and the client sees each of them so (count in = count out per replica)."""
        spec = LoadSpec(num_requests=240, concurrency=24, duration=60.0, max_tokens=16,
                        num_tenants=4, timeout=30.0)  # fmt: skip

        async def go() -> None:
            async with (
                emulated_processes(2, speed=10) as servers,
                fairway_serve(tmp_path, [x.url for x in servers], 3, policy={"name": "lpm"}) as (
                    base, own, proc, log_path),
                aiohttp.ClientSession() as admin,
            ):  # fmt: skip
                victim, _ = await ended_at(admin, own[1])
                outcomes = await load_with_a_kill(base, spec, int(victim.split("-")[1]))
                # Let the supervisor restart the victim, then read every replica's counts.
                await wait_healthy_async(own[1], 60)
                per_token = Counter(t for o, t in outcomes if o.kind == "ok")
                failed = [o for o, t in outcomes if o.kind != "ok"]
                assert len(outcomes) == spec.num_requests, "count in = count out at the client"
                for url in own:
                    token, ended = await ended_at(admin, url)
                    assert token != victim
                    assert set(ended) <= {"ok"}, f"replica {token} ended some badly: {ended}"
                    assert ended["ok"] == per_token[token], (token, ended, per_token)
                survivors = sum(n for t, n in per_token.items() if t != victim)
                assert survivors + per_token[victim] + len(failed) == spec.num_requests
                assert len(failed) <= spec.concurrency, "only the victim's open requests"
                broken = [o.detail for o in failed if not _connection_lost(o)]
                assert not broken, f"failed otherwise than by the victim's connections: {broken}"
                print(f"kill test: {spec.num_requests} sent, {per_token[victim]} ok at the "
                      f"victim before it died, {survivors} ok at the others, {len(failed)} "
                      f"lost with the victim's connections")  # fmt: skip
            assert proc.returncode == 0

        run(go, timeout=240)


async def load_with_a_kill(base: str, spec: LoadSpec, victim_pid: int) -> list[tuple[Outcome, str]]:
    """Closed-loop load (traces.load's requests and judge); SIGKILL `victim_pid`
    once a third of the requests have ended. Returns each outcome with the replica token that
    answered."""
    answered_by: dict[str, str] = {}

    async def on_end(session, ctx, params) -> None:
        rid = params.headers.get("X-Request-Id") if params.headers else None
        if rid:
            answered_by[rid] = params.response.headers.get(REPLICA_HEADER, "")

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(on_end)
    outcomes: list[tuple[Outcome, str]] = []
    next_i, killed = 0, False
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace]) as session:

        async def loop() -> None:
            nonlocal next_i, killed
            while next_i < spec.num_requests:
                i, next_i = next_i, next_i + 1
                path, body, tenant = request_body(i, spec, random.Random(i))
                rid = f"load-{i}"
                headers = {"X-Client-Id": tenant, "X-Request-Id": rid}
                outcome = await send(session, base, path, body, headers, spec.timeout)
                outcomes.append((outcome, answered_by.get(rid, "")))
                if not killed and len(outcomes) >= spec.num_requests // 3:
                    killed = True
                    os.kill(victim_pid, signal.SIGKILL)

        await asyncio.gather(*(loop() for _ in range(spec.concurrency)))
    return outcomes


def _connection_lost(o: Outcome) -> bool:
    """Ended by the victim's connections: one it had accepted broke, or a connect the kernel
    had queued at its listening socket was refused as the socket died (Linux hands such a
    connection to another replica only with net.ipv4.tcp_migrate_req=1, off by default)."""
    detail = o.detail.lower()
    return o.kind == "refused" or (
        o.kind == "lost" and ("connection" in detail or "disconnect" in detail)
    )


def _values_of(state: dict, field: str) -> dict[str, float]:
    key = encode_key(field)
    return {k: v[key] for k, v in state["ledgers"].items() if v.get(key)}
