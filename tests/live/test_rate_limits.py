"""Tenant budgets at the proxy, over real HTTP in front of emulated workers: a limited
tenant's request past its burst gets OpenAI's 429 (Retry-After, x-ratelimit-* headers) and
never reaches routing; waiting Retry-After lets it in; an unlimited tenant is never refused;
a stream's head carries the headers, and its output is charged when it ends."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import openai
import pytest

from router.budgets import RateLimit
from router.proxy.settings import Tenant, keyed
from tests.live_helpers import emulated_workers, proxy, run
from tests.metrics_page import samples

LIMITED, FREE = "sk-limited-0001", "sk-free-000001"
BURST = 3
TENANTS = keyed(
    {
        LIMITED: Tenant(
            "alpha",
            rate_limit=RateLimit(
                requests_per_s=1,
                burst=BURST,
                input_tokens_per_min=60_000,
                output_tokens_per_min=600,
            ),
        ),
        FREE: Tenant("beta"),
    }
)
BODY = {"model": "tiny", "prompt": "hello there " * 8, "max_tokens": 4}
RATE_HEADERS = {
    f"x-ratelimit-{what}-{kind}"
    for what in ("limit", "remaining", "reset")
    for kind in ("requests", "tokens", "output-tokens")
}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def post(
    s: aiohttp.ClientSession, base: str, key: str, **extra: object
) -> tuple[int, dict[str, str], dict]:
    async with s.post(f"{base}/v1/completions", json={**BODY, **extra}, headers=auth(key)) as r:
        return r.status, dict(r.headers), await r.json()


def lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


class TestLimitedTenant:
    def test_past_the_burst_a_429_in_openais_shape_then_admitted_after_retry_after(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, tenants=TENANTS, trust_client_headers=False) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                started = time.monotonic()
                answers = [await post(s, base, LIMITED) for _ in range(BURST)]
                assert time.monotonic() - started < 0.9, "the burst went out within a refill"
                assert [status for status, _, _ in answers] == [200] * BURST
                remaining = [lower(h)["x-ratelimit-remaining-requests"] for _, h, _ in answers]
                assert remaining == ["2", "1", "0"], remaining
                first = lower(answers[0][1])
                assert set(first) >= RATE_HEADERS, sorted(first)
                assert first["x-ratelimit-limit-requests"] == str(BURST)
                assert first["x-ratelimit-limit-tokens"] == "60000"
                assert re.fullmatch(r"\d+ms|\d+(\.\d+)?s", first["x-ratelimit-reset-requests"])

                status, headers, body = await post(s, base, LIMITED)
                assert status == 429, body
                assert body["error"]["type"] == "requests"
                assert body["error"]["code"] == "rate_limit_exceeded"
                assert body["error"]["param"] is None
                assert body["error"]["message"].startswith("Rate limit reached for requests")
                headers = lower(headers)
                assert headers["retry-after"] == "1", headers
                assert set(headers) >= RATE_HEADERS
                assert headers["x-ratelimit-remaining-requests"] == "0"

                routed = await samples(s, base.admin, "fairway_requests_total")
                ok = sum(v for k, v in routed.items() if 'status="ok"' in k)
                refused = [k for k in routed if 'status="http_429"' in k]
                assert ok == BURST, routed
                assert refused == [
                    '{api="completions",decision="rejected",policy="round_robin",'
                    'status="http_429",worker="none"}'
                ]
                prompts = await samples(s, base.admin, "fairway_prompt_tokens_total")
                limited = await samples(s, base.admin, "fairway_rate_limited_total")
                assert limited == {'{client="alpha",limit="requests"}': 1.0}
                refusals = await samples(s, base.admin, "fairway_refusals_total")
                assert refusals == {'{class="priority 0",reason="rate_limit"}': 1.0}, refusals
                errors = await samples(s, base.admin, "fairway_rate_limit_store_errors_total")
                assert errors == {"": 0.0}, "one router: no store"

                await asyncio.sleep(int(headers["retry-after"]))
                status, headers, body = await post(s, base, LIMITED)
                assert status == 200, body
                again = await samples(s, base.admin, "fairway_prompt_tokens_total")
                assert sum(again.values()) > sum(prompts.values()), "routed this time"

        run(go, timeout=60)

    def test_the_openai_client_sees_a_rate_limit_error(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, tenants=TENANTS) as (base, _),
            ):
                client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=LIMITED, max_retries=0)
                for _ in range(BURST):
                    await client.completions.create(**BODY)  # type: ignore[call-overload]
                with pytest.raises(openai.RateLimitError) as refused:
                    await client.completions.create(**BODY)  # type: ignore[call-overload]
                assert refused.value.code == "rate_limit_exceeded"
                assert refused.value.type == "requests"
                assert refused.value.response.headers["retry-after"] == "1"

        run(go, timeout=60)

    def test_a_streams_head_carries_the_headers_and_its_output_is_charged(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, tenants=TENANTS) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                body = {**BODY, "stream": True, "max_tokens": 16}
                async with s.post(f"{base}/v1/completions", json=body, headers=auth(LIMITED)) as r:
                    assert r.status == 200
                    head = lower(dict(r.headers))
                    assert "text/event-stream" in head["content-type"]
                    assert set(head) >= RATE_HEADERS, sorted(head)
                    assert head["x-ratelimit-remaining-requests"] == str(BURST - 1)
                    assert head["x-ratelimit-remaining-output-tokens"] == "600", "none yet"
                    text = (await r.read()).decode()
                assert text.rstrip().endswith("data: [DONE]"), text[-200:]
                status, headers, _ = await post(s, base, LIMITED, max_tokens=1)
                assert status == 200
                left = int(lower(headers)["x-ratelimit-remaining-output-tokens"])
                # 16 charged at the stream's end, 10 a second refilled since: well under 600.
                assert left <= 600 - 16 + 10, left

        run(go, timeout=60)


class TestUnlimitedTenant:
    def test_never_refused_and_no_headers(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls, tenants=TENANTS) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                answers = await asyncio.gather(*(post(s, base, FREE) for _ in range(4 * BURST)))
                assert [a[0] for a in answers] == [200] * (4 * BURST)
                assert not any(k.lower().startswith("x-ratelimit") for k in answers[0][1])
                limited = await samples(s, base.admin, "fairway_rate_limited_total")
                assert limited == {}, "no one refused"

        run(go, timeout=60)

    def test_without_tenants_there_is_no_budget(self) -> None:
        async def go() -> None:
            async with (
                emulated_workers(1, speed=20) as urls,
                proxy(urls) as (base, _),
                aiohttp.ClientSession() as s,
            ):
                answers = await asyncio.gather(*(post(s, base, "any-key") for _ in range(10)))
                assert {a[0] for a in answers} == {200}

        run(go, timeout=60)
