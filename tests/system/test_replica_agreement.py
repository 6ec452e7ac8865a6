"""Router replicas agree (issue 27 E): after the load stops, every replica's ledgers are the
store's, so they equal each other and rank the clients alike.

`fairway serve --routers 2` with VTC in front of two emulated workers (processes), 300 requests
from 3 clients sent through both replicas' own ports at once; the load stops, two sync
intervals pass, and every replica's `/admin/replica` is read. Each ledger value must be within
1 % of the other replica's and of the store's, and each queue's clients rank the same on every
replica (before the ledger's operations: 8-14 % apart, the store at about half, ranks
different). Bounded: 300 requests, 90 s of load at most.

And the rule is one: random steps applied by the simulator's in-memory store and by the
replicas' Redis script give the same values, to the bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import redis

from router.ledger import Ledger, LedgerStore, Segment
from router.proxy.ports import free_port
from router.proxy.service.shared_state import APPLY_AND_READ, decode_key, encode_key, script_args
from router.proxy.service.store import Store, redis_server
from tests.live_helpers import emulated_processes, run
from tests.system.test_live_replicas import fairway_serve, replica_state
from traces.load import LoadSpec, run_load

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (`make test` installs it)"
)

SYNC = 0.1  # router_sync, seconds
SPEED = 5  # the emulated workers' speed-up: the load lasts a few seconds, dozens of syncs
TOLERANCE = 0.01


@dataclass
class Agreement:
    """What the replicas and the store hold for the same ledgers, and how far apart."""

    replicas: list[dict[str, dict[str, float]]]  # per replica: ledger -> field -> value
    store: dict[str, dict[str, float]]
    syncs: list[int]

    @property
    def worst_between_replicas(self) -> tuple[float, str]:
        """The largest relative difference between two replicas' values, and where it is."""
        return _worst(self.replicas)

    @property
    def worst_against_store(self) -> tuple[float, str]:
        """The largest relative difference between a replica's value and the store's."""
        return max(_worst([r, self.store]) for r in self.replicas)

    def ranks(self) -> list[dict[str, list[str]]]:
        """Per replica: each queue's clients, least served first."""
        return [
            {k: sorted(v, key=lambda f: (v[f], f)) for k, v in r.items()} for r in self.replicas
        ]


async def read_agreement(session: aiohttp.ClientSession, own: list[str], url: str) -> Agreement:
    states = [await replica_state(session, u) for u in own]
    return Agreement(
        [_nonzero(s["ledgers"]) for s in states], read_store(url), [s["syncs"] for s in states]
    )


def read_store(url: str) -> dict[str, dict[str, float]]:
    """Every ledger hash in the store, keyed as /admin/replica keys them."""
    client = redis.Redis.from_url(url)
    try:
        out = {}
        for name in client.scan_iter(match="fairway:*:ledger:*"):
            key = name.decode().split(":ledger:", 1)[1]
            values = {f.decode(): float(v) for f, v in client.hgetall(name).items()}
            out[key] = values
        return _nonzero(out)
    finally:
        client.close()


def _worst(views: list[dict[str, dict[str, float]]]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for ledger in sorted(set().union(*views)):
        for f in sorted(set().union(*(v.get(ledger, {}) for v in views))):
            values = [v.get(ledger, {}).get(f, 0.0) for v in views]
            scale = max(abs(x) for x in values) or 1.0
            if (max(values) - min(values)) / scale > worst:
                worst, where = (max(values) - min(values)) / scale, f"{ledger} {f}: {values}"
    return worst, where


def _nonzero(ledgers: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {k: {f: v for f, v in fields.items() if v} for k, fields in ledgers.items()}
    return {k: v for k, v in out.items() if v}


def redis_url_of(log_text: str) -> str:
    return re.search(r"redis-server on (redis://\S+)", log_text)[1]  # type: ignore[index]


async def load_through(own: list[str], num_requests: int, **spec: object) -> None:
    """`num_requests` in all, split evenly over the replicas' own ports, all at once (each
    replica's load a LoadSpec of `spec`, seeded by its index); every one answered ok."""
    results = await asyncio.gather(
        *(
            run_load(url, LoadSpec(num_requests=num_requests // len(own), seed=i, **spec))  # type: ignore[arg-type]
            for i, url in enumerate(own)
        )
    )
    for r in results:
        assert r.counts["ok"] == len(r.outcomes), r.summary()


@contextlib.asynccontextmanager
async def vtc_replicas(tmp_path: Path):
    """Two emulated workers behind `fairway serve --routers 2` (VTC, syncing every SYNC s);
    yields (own URLs, the serve log, a client session)."""
    async with (
        emulated_processes(2, speed=SPEED) as servers,
        fairway_serve(
            tmp_path, [x.url for x in servers], 2, policy={"name": "vtc"}, router_sync=SYNC
        ) as (_, own, _, log_path),
        aiohttp.ClientSession() as session,
    ):
        yield own, log_path, session


@pytest.mark.slow
def test_replicas_agree_two_syncs_after_the_load(tmp_path) -> None:
    async def go() -> None:
        async with vtc_replicas(tmp_path) as (own, log_path, session):
            load = {"concurrency": 12, "duration": 90.0, "max_tokens": 32, "timeout": 30.0}
            await load_through(own, 300, num_tenants=3, **load)
            await asyncio.sleep(2 * SYNC + 0.05)  # two sync intervals, and their round trips
            agreement = await read_agreement(session, own, redis_url_of(log_path.read_text()))
            worst, where = agreement.worst_between_replicas
            off, off_where = agreement.worst_against_store
            print(
                f"\nafter 2 syncs ({agreement.syncs} syncs): replicas apart by at most "
                f"{100 * worst:.2f} % ({where}), from the store by {100 * off:.2f} % "
                f"({off_where})\n{json.dumps(agreement.replicas)}\n"
                f"store {json.dumps(agreement.store)}"
            )
            assert agreement.replicas[0], "the load was charged"
            assert worst <= TOLERANCE, f"replicas differ by {100 * worst:.1f} %: {where}"
            assert off <= TOLERANCE, f"a replica differs from the store: {off_where}"
            ranks = agreement.ranks()
            assert all(r == ranks[0] for r in ranks), f"the clients rank differently: {ranks}"

    run(go, timeout=240)


def test_the_redis_script_and_the_simulators_store_apply_the_same_arithmetic(tmp_path) -> None:
    """Three replicas' random charges, lifts, clamps and refills, applied round after round by
    `LedgerStore` and by APPLY_AND_READ: equal values, with ==."""
    rng = random.Random(5)
    fields = ["a", ("b", 1), "c", "d"]
    memory = LedgerStore()
    with redis_server(tmp_path / "redis") as url:
        client = redis.Redis.from_url(url)
        try:
            ledgers = [Ledger() for _ in range(3)]
            batch = 0
            for _ in range(60):
                for ledger in ledgers:
                    for _ in range(rng.randrange(8)):
                        random_operation(ledger, rng, fields)
                    steps = ledger.take()
                    memory.apply("k", steps)
                    # The epoch as the first round sets it, nothing to restore, one batch.
                    batch += 1
                    args = script_args("e", "e", "r", [[]], [(batch, [steps])])
                    keys = ["test:epoch", "test:applied", "test:k"]
                    reply = client.eval(APPLY_AND_READ, len(keys), *keys, *args)
                    flat = json.loads(reply)["v"][0]
                    pairs = zip(flat[::2], flat[1::2], strict=True)
                    stored = {decode_key(f): float(v) for f, v in pairs}
                    assert stored == memory.values["k"]
                    ledger.rebase(stored)
            assert len(memory.values["k"]) == len(fields)
            assert client.hget("test:k", encode_key(("b", 1))) is not None, "keys as JSON"
        finally:
            client.close()


def random_operation(ledger: Ledger, rng: random.Random, fields: list) -> None:
    field, op = rng.choice(fields), rng.randrange(5)
    if op < 2:
        ledger[field] = ledger.get(field, 0.0) + rng.uniform(-300, 300) / 7
    elif op == 2:
        ledger.raise_to(field, rng.uniform(-500, 500) / 3)
    elif op == 3:
        ledger.lower_to(field, rng.uniform(-500, 500) / 3)
    else:
        ledger.refill(rng.sample(fields, 2), rng.choice([2048.0, 100.0 / 3]))


def test_a_batch_applied_late_is_not_applied_again(tmp_path) -> None:
    """A round that timed out against a stopped store is applied when it resumes; the replica
    sends that batch again with its next one: it counts once."""
    with redis_server(tmp_path / "redis") as url:
        client = redis.Redis.from_url(url)
        keys = ["t:epoch", "t:applied", "t:k"]
        try:
            charge = [Segment({"alice": (-math.inf, math.inf, 5.0)})]
            more = [Segment({"alice": (-math.inf, math.inf, 2.0)})]
            late = script_args("", "e1", "r", [[]], [(1, [charge])])
            client.eval(APPLY_AND_READ, len(keys), *keys, *late)  # the stopped store's late run
            again = script_args("e1", "e2", "r", None, [(1, [charge]), (2, [more])])
            reply = json.loads(client.eval(APPLY_AND_READ, len(keys), *keys, *again))
            assert reply["v"][0] == ['"alice"', "7"], reply
        finally:
            client.close()


def test_an_external_store_is_checked_at_start_naming_its_url(tmp_path) -> None:
    """A password-protected Redis: the right password reaches it, a wrong one and an address
    where nothing listens are errors naming the URL, and the password is in neither."""
    port = free_port()
    secret = "s3cret-password-for-the-store"
    argv = [shutil.which("redis-server"), "--bind", "127.0.0.1", "--port", str(port), "--save",
            "", "--appendonly", "no", "--requirepass", secret, "--dir", str(tmp_path)]  # fmt: skip
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                Store(url, secret).check()
                break
            except ValueError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        for store, says in [
            (Store(url, "wrong-password"), "refused the password"),
            (Store(url), ""),  # no password: NOAUTH, or a refusal, as the server words it
            (Store(f"redis://127.0.0.1:{free_port()}/0", secret), "cannot reach"),
        ]:
            with pytest.raises(ValueError) as e:
                store.check(timeout=2)
            assert store.url in str(e.value) and secret not in str(e.value), e.value
            assert says in str(e.value), e.value
            assert "redis_url" in str(e.value)
    finally:
        server.terminate()
        server.wait(10)
