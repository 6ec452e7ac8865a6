"""Tenant budgets at the proxy: checked once a request is tokenized, before it is routed.

    read_request ─▶ check: the tenant's buckets (router/budgets.py) ─┬─ refused: 429 ─▶ client
    (401, 400...)   admit with the prompt's tokens                   └─ admitted ─▶ Forward
                                                   the request ends ─▶ charge its output tokens

A tenant is an API key's (cluster.yaml `tenants`); a request with no tenant has no budget, and
nor has a tenant without `rate_limit`. The buckets are this process's (`LocalBudgets`) for one
router, or, in a replica of `fairway serve --routers N`, the replicas' store
(service/budget_store.py, installed with `use`): one budget however many replicas share it.

A refusal is OpenAI's 429: {"error": {"message", "type": "requests" | "tokens", "param": null,
"code": "rate_limit_exceeded"}}, with Retry-After (whole seconds, rounded up). Every answer to
a limited tenant, refused or not (a stream on its head), carries OpenAI's headers:

    x-ratelimit-{limit,remaining,reset}-requests        the request bucket
    x-ratelimit-{limit,remaining,reset}-tokens          the input-token bucket (as OpenAI's)
    x-ratelimit-{limit,remaining,reset}-output-tokens   the output-token bucket (ours)

each only for a bucket the tenant has: limit its size, remaining its level after this request
(whole, never below 0), reset the time until it is full again, in OpenAI's format (`1s`,
`6m0s`, `20ms`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from aiohttp import web

from router.budgets import (
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    REQUESTS,
    Budgets,
    RateLimit,
    Verdict,
)
from router.classes import RATE_LIMIT
from router.proxy.errors import APIError
from router.proxy.identity import authenticate
from router.proxy.metrics import RouterMetrics
from router.proxy.settings import ProxySettings
from router.request import Request

log = logging.getLogger(__name__)

HEADER_NAMES = {REQUESTS: "requests", INPUT_TOKENS: "tokens", OUTPUT_TOKENS: "output-tokens"}
_WHAT = {
    REQUESTS: "requests per second",
    INPUT_TOKENS: "input tokens per min",
    OUTPUT_TOKENS: "output tokens per min",
}


class Limiter(Protocol):
    """Where the buckets are: this process (`LocalBudgets`) or the replicas' store."""

    async def admit(self, tenant: str, input_tokens: int) -> Verdict: ...

    def charge_output(self, tenant: str, output_tokens: int) -> None: ...


class LocalBudgets:
    """One router's buckets: router.budgets.Budgets on the monotonic clock."""

    def __init__(self, limits: Mapping[str, RateLimit]) -> None:
        self.budgets = Budgets(limits)

    async def admit(self, tenant: str, input_tokens: int) -> Verdict:
        return self.budgets.admit(tenant, input_tokens, time.monotonic())

    def charge_output(self, tenant: str, output_tokens: int) -> None:
        self.budgets.charge_output(tenant, output_tokens, time.monotonic())


class RateLimits:
    """The app's tenant budgets (app[RATE_LIMITS]): the limits by tenant, where the buckets
    are, and what to count."""

    def __init__(
        self,
        settings: ProxySettings,
        metrics: RouterMetrics,
        on_refused: Callable[[Request, str], None] = lambda request, reason: None,
    ) -> None:
        self.settings = settings
        self.limits = limits_of(settings)
        self.store_failure = settings.rate_limit_store_failure
        self.metrics = metrics
        self.on_refused = on_refused  # counts it among the traffic class's refusals
        self.limiter: Limiter = LocalBudgets(self.limits)

    def use(self, limiter: Limiter) -> Limiter:
        """Keep the buckets in `limiter` from now on; returns the one used until now."""
        previous, self.limiter = self.limiter, limiter
        return previous


RATE_LIMITS = web.AppKey("rate_limits", RateLimits)
_TENANT = web.RequestKey("rate_limited_tenant", str)
_VERDICT = web.RequestKey("rate_limit_verdict", Verdict)


def install(
    app: web.Application,
    settings: ProxySettings,
    metrics: RouterMetrics,
    on_refused: Callable[[Request, str], None],
) -> None:
    """Give `app` its budgets (in this process) and the headers on every limited answer;
    `on_refused(request, RATE_LIMIT)` for each refusal."""
    app[RATE_LIMITS] = RateLimits(settings, metrics, on_refused)
    app.on_response_prepare.append(_add_headers)


def limits_of(settings: ProxySettings) -> dict[str, RateLimit]:
    """Each limited tenant's RateLimit. Several keys of one tenant (a key being rotated)
    share its budget, so they must give it the same limit."""
    limits: dict[str, RateLimit] = {}
    seen: dict[str, RateLimit | None] = {}
    for tenant in settings.tenants.values():
        if tenant.client in seen and seen[tenant.client] != tenant.rate_limit:
            raise ValueError(
                f"tenants: the keys of {tenant.client!r} give it different rate_limits; "
                "they share one budget"
            )
        seen[tenant.client] = tenant.rate_limit
        if tenant.rate_limit is not None and not tenant.rate_limit.is_unlimited:
            limits[tenant.client] = tenant.rate_limit
    return limits


async def check(http: web.Request, req: Request) -> None:
    """Admit `req` against its tenant's budget (charging it), or raise the 429."""
    limits = http.app[RATE_LIMITS]
    if not limits.limits:
        return
    tenant = authenticate(http, limits.settings)  # a digest and a lookup, as read_request's
    if tenant is None or tenant.client not in limits.limits:
        return
    verdict = await limits.limiter.admit(tenant.client, req.prompt_len)
    http[_TENANT] = tenant.client
    http[_VERDICT] = verdict
    if not verdict.ok:
        assert verdict.limit is not None, "a refusal names its limit"
        metrics = limits.metrics
        metrics.rate_limited.labels(metrics.clients.label(tenant.client), verdict.limit).inc()
        limits.on_refused(req, RATE_LIMIT)
        raise refusal(verdict, req.prompt_len)


def charge_output(http: web.Request, output_tokens: int) -> None:
    """The request has ended: charge what it produced to its tenant's budget, if it has one."""
    tenant = http.get(_TENANT)
    if tenant is None or output_tokens <= 0:
        return
    try:
        http.app[RATE_LIMITS].limiter.charge_output(tenant, output_tokens)
    except Exception:  # the answer is out; a charge lost costs accuracy, not the client
        log.exception("charging %d output tokens failed", output_tokens)


def refusal(verdict: Verdict, input_tokens: int) -> APIError:
    """The 429, with Retry-After (the x-ratelimit headers come with every limited answer)."""
    kind = verdict.limit or REQUESTS
    figures = verdict.of(kind)
    requested = {REQUESTS: 1, INPUT_TOKENS: input_tokens, OUTPUT_TOKENS: 0}[kind]
    detail = ""
    if figures is not None:
        detail = f": Limit {_number(figures.limit)}, Remaining {_whole(figures.remaining)}"
        detail += f", Requested {requested}" if kind != OUTPUT_TOKENS else ""
        if figures.remaining < 0:
            detail += f" (in debt by {math.ceil(-figures.remaining)})"
    message = (
        f"Rate limit reached for {_WHAT[kind]}{detail}. "
        f"Please try again in {duration(verdict.retry_after)}."
    )
    error = APIError(
        429, message, "requests" if kind == REQUESTS else "tokens", code="rate_limit_exceeded"
    )
    error.headers["Retry-After"] = str(max(1, math.ceil(verdict.retry_after)))
    return error


def headers(verdict: Verdict) -> dict[str, str]:
    """The x-ratelimit-* headers for a verdict (none for an unlimited one)."""
    out = {}
    for f in verdict.figures:
        name = HEADER_NAMES[f.kind]
        out[f"x-ratelimit-limit-{name}"] = _number(f.limit)
        out[f"x-ratelimit-remaining-{name}"] = _whole(f.remaining)
        out[f"x-ratelimit-reset-{name}"] = duration(f.reset)
    return out


def duration(seconds: float) -> str:
    """OpenAI's (Go's) duration format, to the millisecond, rounded up so that a client that
    waits it is never early: `0s`, `20ms`, `1s`, `1.5s`, `6m0s`, `1h2m3.25s`."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    text = f"{whole}.{fraction:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def _number(x: float) -> str:
    return str(int(x)) if x == int(x) else f"{x:g}"


def _whole(level: float) -> str:
    return str(max(0, math.floor(level)))


async def _add_headers(http: web.Request, response: web.StreamResponse) -> None:
    verdict = http.get(_VERDICT)
    if verdict is not None:
        response.headers.update(headers(verdict))
