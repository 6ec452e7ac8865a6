"""The tenant budgets' two forms apply one arithmetic: router/budgets.py in this process, and
the Redis script replicas share (router/proxy/service/budget_store.py). Random admissions and
output charges of tenants with every kind of limit, on a hand-driven wall clock that sometimes
steps back: the same verdicts, and the same stored levels and times, with ==."""

from __future__ import annotations

import asyncio
import random
import shutil

import pytest
import redis.asyncio

from router.budgets import Budgets, Levels, RateLimit
from router.proxy.service.budget_store import MARGIN_MS, SharedBudgets
from router.proxy.service.store import redis_server
from tests.live_helpers import run

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs redis-server (`make test` installs it)"
)

LIMITS = {
    "requests": RateLimit(requests_per_s=3, burst=5),
    "inputs": RateLimit(input_tokens_per_min=1000),
    "outputs": RateLimit(output_tokens_per_min=700),
    "all": RateLimit(requests_per_s=0.7, input_tokens_per_min=5000, output_tokens_per_min=2000),
    "odd": RateLimit(1 / 3, 1.5, 333.3, 77.7),  # rates no binary fraction holds exactly
    "free": RateLimit(),
}


async def stored(client: redis.asyncio.Redis, key: str) -> tuple[Levels, float] | None:
    """A tenant's hash as Budgets keeps its state: (levels, t); None if there is none."""
    r, i, o, t = await client.hmget(key, "r", "i", "o", "t")
    if t is None:
        return None
    levels = tuple(None if v is None else float(v) for v in (r, i, o))
    return (levels[0], levels[1], levels[2]), float(t)


def test_the_script_and_the_step_function_agree_to_the_bit(tmp_path) -> None:
    async def go() -> None:
        with redis_server(tmp_path / "redis") as url:
            client = redis.asyncio.Redis.from_url(url)
            clock = [1.7e9]  # a wall clock's doubles, as replicas pass them
            shared = SharedBudgets(client, "test", LIMITS, clock=lambda: clock[0])
            local = Budgets(LIMITS)
            rng = random.Random(11)
            outcomes = {True: 0, False: 0}
            limits_seen = set()
            try:
                for step in range(3000):
                    clock[0] += rng.choice(
                        [0.0, rng.uniform(0, 0.5), rng.expovariate(0.2), -rng.uniform(0, 0.05)]
                    )
                    tenant = rng.choice(list(LIMITS))
                    if rng.random() < 0.7:
                        tokens = rng.choice([0, rng.randrange(1, 300), rng.randrange(300, 8000)])
                        expected = local.admit(tenant, tokens, clock[0])
                        verdict = await shared.admit(tenant, tokens)
                        assert verdict == expected, (step, tenant, tokens)
                        outcomes[verdict.ok] += 1
                        limits_seen.add(verdict.limit)
                    else:
                        n = rng.randrange(0, 600)
                        local.charge_output(tenant, n, clock[0])
                        shared.charge_output(tenant, n)
                        await shared.settle()
                    state = await stored(client, shared.key(tenant))
                    assert state == local._stored.get(tenant), (step, tenant)
                assert min(outcomes.values()) > 300, f"both outcomes, often: {outcomes}"
                assert limits_seen >= {None, "requests", "input_tokens", "output_tokens"}
                for tenant in LIMITS:
                    ttl = await client.pttl(shared.key(tenant))
                    assert (ttl > MARGIN_MS / 2) if tenant != "free" else ttl == -2, (tenant, ttl)
            finally:
                await client.aclose()

    run(go, timeout=120)


def test_a_forgotten_tenant_is_a_full_one(tmp_path) -> None:
    """A hash that expired (deleted here) reads as full buckets: the verdict a tenant never
    seen gets, so expiry changes nothing once the buckets would be full."""

    async def go() -> None:
        with redis_server(tmp_path / "redis") as url:
            client = redis.asyncio.Redis.from_url(url)
            shared = SharedBudgets(client, "test", LIMITS, clock=lambda: 100.0)
            try:
                first = await shared.admit("all", 100)
                await client.delete(shared.key("all"))
                assert await shared.admit("all", 100) == first
                assert first == Budgets(LIMITS).admit("all", 100, 100.0)
            finally:
                await client.aclose()

    asyncio.run(asyncio.wait_for(go(), 60))
