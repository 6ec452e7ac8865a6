"""Tenant budgets (router/budgets.py) on a hand-driven clock, and what the proxy tells clients
of them (router/proxy/ratelimit.py). Rates and sizes are chosen so that every level is exact
in binary floating point: the assertions are ==."""

from __future__ import annotations

import pytest

from router.budgets import (
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    REQUESTS,
    Budgets,
    RateLimit,
    Verdict,
)
from router.proxy.ratelimit import duration, headers, limits_of, refusal
from router.proxy.service.config import validate_config
from router.proxy.service.serve import settings_of
from router.proxy.settings import ProxySettings, Tenant, keyed


def budgets(**limit: float) -> Budgets:
    return Budgets({"t": RateLimit(**limit)})


def admit_all(b: Budgets, now: float, n: int, tokens: int = 0) -> list[bool]:
    return [b.admit("t", tokens, now).ok for _ in range(n)]


def assert_refused(verdict: Verdict, limit: str, retry_after: float) -> None:
    assert not verdict.ok, f"admitted, expected a refusal by {limit}"
    assert (verdict.limit, verdict.retry_after) == (limit, retry_after), verdict


class TestRequests:
    def test_a_burst_then_refill_at_the_rate(self) -> None:
        b = budgets(requests_per_s=2, burst=4)
        assert admit_all(b, 0.0, 4) == [True] * 4, "a full bucket takes the whole burst"
        assert_refused(b.admit("t", 0, 0.0), REQUESTS, 0.5)
        assert_refused(b.admit("t", 0, 0.25), REQUESTS, 0.25)
        assert b.admit("t", 0, 0.5).ok, "one request's worth after 1 / rate"
        assert_refused(b.admit("t", 0, 0.5), REQUESTS, 0.5)
        assert b.levels("t", 1.5) == (2.0, None, None), "2 a second"

    def test_refill_is_capped_at_the_burst(self) -> None:
        b = budgets(requests_per_s=2, burst=4)
        admit_all(b, 0.0, 4)
        assert b.levels("t", 1000.0) == (4.0, None, None)
        assert admit_all(b, 1000.0, 5) == [True] * 4 + [False]

    def test_the_burst_defaults_to_one_second_of_requests_at_least_one(self) -> None:
        assert RateLimit(requests_per_s=8).buckets[0].size == 8  # type: ignore[union-attr]
        assert RateLimit(requests_per_s=0.5).buckets[0].size == 1  # type: ignore[union-attr]
        b = budgets(requests_per_s=0.5)
        assert admit_all(b, 0.0, 2) == [True, False]
        assert_refused(b.admit("t", 0, 1.0), REQUESTS, 1.0)

    def test_retry_after_is_the_exact_wait(self) -> None:
        b = budgets(requests_per_s=4, burst=1)
        b.admit("t", 0, 0.0)
        wait = b.admit("t", 0, 0.0).retry_after
        assert wait == 0.25
        assert not b.admit("t", 0, wait - 2**-20).ok, "a hair early is refused"
        assert b.admit("t", 0, wait).ok, "exactly then is admitted"


class TestInputTokens:
    def test_tokens_refill_per_minute(self) -> None:
        b = budgets(input_tokens_per_min=600)  # 10 a second, 600 at most
        assert b.admit("t", 500, 0.0).ok
        assert_refused(b.admit("t", 200, 0.0), INPUT_TOKENS, 10.0)  # (200 - 100) / 10
        assert b.admit("t", 200, 10.0).ok
        assert b.levels("t", 10.0) == (None, 0.0, None)

    def test_a_prompt_larger_than_the_bucket_gets_in_when_full_and_leaves_a_debt(self) -> None:
        b = budgets(input_tokens_per_min=600)
        b.admit("t", 100, 0.0)
        assert_refused(b.admit("t", 1000, 0.0), INPUT_TOKENS, 10.0), "needs a full bucket"
        verdict = b.admit("t", 1000, 10.0)
        assert verdict.ok, "a full bucket admits any prompt"
        assert b.levels("t", 10.0) == (None, -400.0, None), "in debt by the excess"
        assert_refused(b.admit("t", 10, 10.0), INPUT_TOKENS, 41.0)  # (10 + 400) / 10
        assert b.admit("t", 10, 51.0).ok


class TestOutputTokens:
    def test_output_charged_after_the_fact_may_go_negative_and_refuses_until_paid(self) -> None:
        b = budgets(output_tokens_per_min=60)  # 1 a second
        assert b.admit("t", 0, 0.0).ok, "output is not known up front: nothing to check"
        b.charge_output("t", 100, 0.0)
        assert b.levels("t", 0.0) == (None, None, -40.0)
        assert_refused(b.admit("t", 0, 0.0), OUTPUT_TOKENS, 40.0)
        assert_refused(b.admit("t", 0, 39.5), OUTPUT_TOKENS, 0.5)
        assert b.admit("t", 0, 40.0).ok, "back to 0: admitted again"

    def test_charging_output_refills_first(self) -> None:
        b = budgets(output_tokens_per_min=60)
        b.charge_output("t", 60, 0.0)
        b.charge_output("t", 10, 30.0)
        assert b.levels("t", 30.0) == (None, None, 20.0)


class TestAllOrNothing:
    def test_a_refused_request_charges_nothing(self) -> None:
        b = budgets(requests_per_s=1, burst=2, input_tokens_per_min=600)
        assert b.admit("t", 550, 0.0).ok
        before = b.levels("t", 0.0)
        assert before == (1.0, 50.0, None)
        assert_refused(b.admit("t", 100, 0.0), INPUT_TOKENS, 5.0)
        assert b.levels("t", 0.0) == before, "the request bucket kept its request"
        assert b.admit("t", 50, 0.0).ok, "a smaller prompt fits what is left"

    def test_the_longest_wait_is_the_one_named(self) -> None:
        b = budgets(requests_per_s=1, burst=1, input_tokens_per_min=600, output_tokens_per_min=60)
        b.admit("t", 600, 0.0)
        b.charge_output("t", 62, 0.0)  # output: -2, 2 s; requests: 1 s; input: 600 s
        verdict = b.admit("t", 600, 0.0)
        assert_refused(verdict, INPUT_TOKENS, 60.0)
        assert not b.admit("t", 600, 59.0).ok
        assert b.admit("t", 600, 60.0).ok, "after the longest wait every bucket allows it"

    def test_a_tenant_without_a_limit_is_always_admitted_and_holds_nothing(self) -> None:
        b = Budgets({"t": RateLimit(requests_per_s=1), "free": RateLimit()})
        assert all(b.admit("free", 10**9, 0.0).ok for _ in range(100))
        assert all(b.admit("stranger", 10**9, 0.0).ok for _ in range(100))
        assert b.admit("free", 1, 0.0).figures == ()
        assert set(b._stored) == set(), "nothing stored for them"

    def test_a_clock_that_steps_back_refills_nothing(self) -> None:
        b = budgets(requests_per_s=1, burst=1)
        b.admit("t", 0, 10.0)
        assert b.levels("t", 5.0) == (0.0, None, None)
        assert_refused(b.admit("t", 0, 5.0), REQUESTS, 1.0)


class TestFigures:
    def test_remaining_and_reset_after_the_charge(self) -> None:
        b = budgets(requests_per_s=2, burst=4, input_tokens_per_min=600, output_tokens_per_min=60)
        verdict = b.admit("t", 150, 0.0)
        r, i, o = verdict.figures
        assert (r.kind, r.limit, r.remaining, r.reset) == (REQUESTS, 4, 3.0, 0.5)
        assert (i.kind, i.limit, i.remaining, i.reset) == (INPUT_TOKENS, 600, 450.0, 15.0)
        assert (o.kind, o.limit, o.remaining, o.reset) == (OUTPUT_TOKENS, 60, 60.0, 0.0)

    def test_header_values_of_an_admitted_and_a_refused_request(self) -> None:
        b = budgets(requests_per_s=2, burst=4, input_tokens_per_min=600, output_tokens_per_min=60)
        assert headers(b.admit("t", 150, 0.0)) == {
            "x-ratelimit-limit-requests": "4",
            "x-ratelimit-remaining-requests": "3",
            "x-ratelimit-reset-requests": "500ms",
            "x-ratelimit-limit-tokens": "600",
            "x-ratelimit-remaining-tokens": "450",
            "x-ratelimit-reset-tokens": "15s",
            "x-ratelimit-limit-output-tokens": "60",
            "x-ratelimit-remaining-output-tokens": "60",
            "x-ratelimit-reset-output-tokens": "0s",
        }
        b.charge_output("t", 90.5, 0.0)  # type: ignore[arg-type]
        refused = b.admit("t", 10, 0.0)
        assert_refused(refused, OUTPUT_TOKENS, 30.5)
        out = headers(refused)
        assert out["x-ratelimit-remaining-output-tokens"] == "0", "a debt shows as 0"
        assert out["x-ratelimit-reset-output-tokens"] == "1m30.5s"
        assert out["x-ratelimit-remaining-requests"] == "3", "refused: nothing charged"

    def test_unlimited_kinds_have_no_headers(self) -> None:
        assert set(headers(budgets(requests_per_s=1).admit("t", 5, 0.0))) == {
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
        }

    @pytest.mark.parametrize(
        "seconds, text",
        [
            (0.0, "0s"),
            (-1.0, "0s"),
            (0.0001, "1ms"),
            (0.02, "20ms"),
            (0.999, "999ms"),
            (0.9991, "1s"),
            (1.0, "1s"),
            (1.5, "1.5s"),
            (59.25, "59.25s"),
            (60.0, "1m0s"),
            (360.0, "6m0s"),
            (86.4, "1m26.4s"),
            (3600.0, "1h0m0s"),
            (3723.25, "1h2m3.25s"),
        ],
    )
    def test_duration_is_openais_format_rounded_up(self, seconds: float, text: str) -> None:
        assert duration(seconds) == text


class TestRefusal:
    def test_openais_shape_and_retry_after_in_whole_seconds_rounded_up(self) -> None:
        b = budgets(requests_per_s=0.4, burst=1)
        b.admit("t", 0, 0.0)
        error = refusal(b.admit("t", 0, 0.0), 0)
        assert error.status == 429
        assert error.body == {
            "error": {
                "message": "Rate limit reached for requests per second: Limit 1, Remaining 0, "
                "Requested 1. Please try again in 2.5s.",
                "type": "requests",
                "param": None,
                "code": "rate_limit_exceeded",
            }
        }
        assert error.headers == {"Retry-After": "3"}

    def test_a_token_limit_is_of_type_tokens(self) -> None:
        b = budgets(input_tokens_per_min=60)
        b.admit("t", 60, 0.0)
        error = refusal(b.admit("t", 30, 0.25), 30)
        assert error.body["error"]["type"] == "tokens"  # type: ignore[index]
        assert error.headers == {"Retry-After": "30"}
        assert "Limit 60, Remaining 0, Requested 30" in error.message


class TestConfig:
    KEY = "sk-team-a-0123"

    def tenant(self, **rate_limit: object) -> dict:
        return {"api_key": self.KEY, "client": "team-a", "rate_limit": rate_limit}

    @pytest.mark.parametrize(
        "rate_limit, field",
        [
            ({"requests_per_s": 0}, "tenants.0.rate_limit.requests_per_s"),
            ({"requests_per_s": -1}, "tenants.0.rate_limit.requests_per_s"),
            ({"requests_per_s": "inf"}, "tenants.0.rate_limit.requests_per_s"),
            ({"requests_per_s": 1, "burst": 0.5}, "tenants.0.rate_limit.burst"),
            ({"burst": 3}, "tenants.0.rate_limit: .*burst: needs requests_per_s"),
            ({"input_tokens_per_min": 0}, "tenants.0.rate_limit.input_tokens_per_min"),
            ({"output_tokens_per_min": -5}, "tenants.0.rate_limit.output_tokens_per_min"),
            ({"tokens_per_min": 5}, "tenants.0.rate_limit.tokens_per_min"),
        ],
    )
    def test_errors_name_the_field(self, rate_limit: dict, field: str) -> None:
        with pytest.raises(ValueError, match=field):
            validate_config({"tenants": [self.tenant(**rate_limit)]})

    def test_the_failure_mode_is_open_or_closed(self) -> None:
        assert validate_config({}).rate_limit_store_failure == "open"
        with pytest.raises(ValueError, match="rate_limit_store_failure"):
            validate_config({"rate_limit_store_failure": "ajar"})

    def test_the_limit_reaches_the_proxys_tenant(self) -> None:
        config = validate_config(
            {
                "tenants": [
                    self.tenant(requests_per_s=2, burst=5, input_tokens_per_min=1000),
                    {"api_key": "sk-team-b-0123", "client": "team-b"},
                ],
                "rate_limit_store_failure": "closed",
            }
        )
        s = settings_of(config)
        assert s.tenants == keyed(
            {
                self.KEY: Tenant("team-a", 1.0, RateLimit(2, 5, 1000)),
                "sk-team-b-0123": Tenant("team-b"),
            }
        )
        assert s.rate_limit_store_failure == "closed"
        assert limits_of(s) == {"team-a": RateLimit(2, 5, 1000)}, "team-b is unlimited"

    def test_two_keys_of_one_tenant_share_its_budget_so_need_the_same_limit(self) -> None:
        same = {
            "a-key-0001": Tenant("a", 1.0, RateLimit(1)),
            "a-key-0002": Tenant("a", 1.0, RateLimit(1)),
        }
        assert limits_of(ProxySettings("tiny", tenants=keyed(same))) == {"a": RateLimit(1)}
        differ = {**same, "a-key-0003": Tenant("a", 1.0, RateLimit(2))}
        with pytest.raises(ValueError, match="keys of 'a' give it different rate_limits"):
            limits_of(ProxySettings("tiny", tenants=keyed(differ)))

    def test_a_rate_limit_is_checked_outside_the_config_too(self) -> None:
        with pytest.raises(ValueError, match="rate_limit.burst: at least 1"):
            RateLimit(requests_per_s=1, burst=0.5)
        with pytest.raises(ValueError, match="rate_limit.input_tokens_per_min: must be"):
            RateLimit(input_tokens_per_min=float("nan"))
