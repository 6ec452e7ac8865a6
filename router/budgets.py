"""Tenant budgets: token buckets per tenant, for requests, input tokens and output tokens.

A tenant's `RateLimit` gives each kind a bucket that refills continuously at its rate, up to its
size, and starts full:

    kind            rate                        size (what a burst may take)
    requests        requests_per_s              burst (default max(1, requests_per_s))
    input_tokens    input_tokens_per_min / 60   input_tokens_per_min
    output_tokens   output_tokens_per_min / 60  output_tokens_per_min

A request is admitted when, on every bucket its tenant has, the level reaches what it needs:

    requests       >= 1
    input_tokens   >= min(prompt tokens, size)   a prompt larger than the bucket gets in when
                                                 the bucket is full, and leaves it in debt
    output_tokens  >= 0                          output is charged as it is produced, so a
                                                 tenant may end in debt, and waits it out

All or nothing: admitted, it takes 1 request and its prompt's tokens; refused, it takes nothing.
Output tokens are charged after the fact (`charge_output`) and may leave the bucket negative.

The step function, the one arithmetic (the Redis script in router/proxy/service/budget_store.py
applies the same steps, in the same order, on the same doubles, and a test holds both equal):

    1. refill   each bucket: elapsed = now - t, 0 if negative (a clock that stepped back, or
                another replica's a little behind); level = min(size, level + rate * elapsed).
                A tenant never seen (or forgotten: a stored tenant expires once full) is full.
    2. judge    admitted iff every bucket's level >= its need (above).
    3. charge   admitted: requests -= 1, input_tokens -= prompt tokens; store levels, t = now.
                refused: store nothing. charge_output: output_tokens -= n; store, t = now.

Everything else (the retry-after, the header figures) is computed from the refilled levels by
`judge`, here only. `retry_after` is exact in real arithmetic: (need - level) / rate for the
bucket that needs longest; float rounding may leave a caller that waits exactly that long a
hair short, so callers that tell clients round up (the proxy's Retry-After is whole seconds).

Pure: no clock is read (`now` is passed in, monotonic or simulated or wall-clock seconds), no
I/O, so the simulator and the proxy use the same objects.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

REQUESTS, INPUT_TOKENS, OUTPUT_TOKENS = "requests", "input_tokens", "output_tokens"
KINDS = (REQUESTS, INPUT_TOKENS, OUTPUT_TOKENS)

# Per kind, in KINDS' order; None where the tenant has no limit of that kind.
Levels = tuple[float | None, float | None, float | None]


@dataclass(frozen=True, slots=True)
class Bucket:
    """One kind's bucket: it refills at `rate` per second, up to `size`."""

    rate: float
    size: float


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A tenant's budget (cluster.yaml `tenants[].rate_limit`); None: that kind is unlimited."""

    requests_per_s: float | None = None
    burst: float | None = None
    input_tokens_per_min: float | None = None
    output_tokens_per_min: float | None = None
    # Per kind, in KINDS' order (None: unlimited); derived once, read on every admission.
    buckets: tuple[Bucket | None, Bucket | None, Bucket | None] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "burst", "input_tokens_per_min", "output_tokens_per_min"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"rate_limit.{name}: must be a positive number, got {value}")
        if self.burst is not None:
            if self.requests_per_s is None:
                raise ValueError("rate_limit.burst: needs requests_per_s")
            if self.burst < 1:
                raise ValueError("rate_limit.burst: at least 1 (a request takes 1)")
        requests = None
        if self.requests_per_s is not None:
            burst = self.burst if self.burst is not None else max(1.0, self.requests_per_s)
            requests = Bucket(self.requests_per_s, burst)
        inputs, outputs = self.input_tokens_per_min, self.output_tokens_per_min
        object.__setattr__(self, "buckets", (requests, _per_minute(inputs), _per_minute(outputs)))

    @property
    def is_unlimited(self) -> bool:
        return all(b is None for b in self.buckets)


def _per_minute(tokens: float | None) -> Bucket | None:
    return None if tokens is None else Bucket(tokens / 60, tokens)


@dataclass(frozen=True, slots=True)
class Figures:
    """One bucket as the client is told it: its size, its level (negative: in debt) and the
    seconds until it is full again."""

    kind: str
    limit: float
    remaining: float
    reset: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """An admission's answer. Refused: `limit` names the bucket that needs longest, and
    `retry_after` is that wait, after which every bucket allows the request (if nothing else
    is charged meanwhile). `figures`: each limited bucket after the charge (refused: as it is)."""

    ok: bool
    limit: str | None = None
    retry_after: float = 0.0
    figures: tuple[Figures, ...] = ()

    def of(self, kind: str) -> Figures | None:
        return next((f for f in self.figures if f.kind == kind), None)


UNLIMITED = Verdict(True)


def refill(limit: RateLimit, levels: Levels | None, t: float | None, now: float) -> Levels:
    """Step 1: each bucket's level at `now`, from `levels` stored at time `t` (None: full)."""
    out: list[float | None] = []
    for i, bucket in enumerate(limit.buckets):
        level = None if levels is None else levels[i]
        if bucket is None:
            out.append(None)
        elif level is None or t is None:
            out.append(bucket.size)
        else:
            elapsed = now - t
            if elapsed < 0:
                elapsed = 0.0
            out.append(min(bucket.size, level + bucket.rate * elapsed))
    return (out[0], out[1], out[2])


def needs(limit: RateLimit, input_tokens: int) -> tuple[float, float, float]:
    """What each bucket must hold to admit a request with this many prompt tokens."""
    inputs = limit.buckets[1]
    prompt = float(input_tokens)
    return (1.0, prompt if inputs is None else min(prompt, inputs.size), 0.0)


def shortfalls(limit: RateLimit, levels: Levels, input_tokens: int) -> list[tuple[str, float]]:
    """Step 2: each bucket that refuses the request, with how long it needs to allow it (in
    KINDS' order); none: admitted."""
    out = []
    for kind, bucket, level, need in zip(
        KINDS, limit.buckets, levels, needs(limit, input_tokens), strict=True
    ):
        if bucket is not None and level is not None and level < need:
            out.append((kind, (need - level) / bucket.rate))
    return out


def charged(levels: Levels, input_tokens: int) -> Levels:
    """Step 3 for an admitted request: one request and its prompt's tokens taken."""
    r, i, o = levels
    return (
        None if r is None else r - 1.0,
        None if i is None else i - float(input_tokens),
        o,
    )


def output_charged(levels: Levels, output_tokens: int) -> Levels:
    """Step 3 for `charge_output`."""
    r, i, o = levels
    return (r, i, None if o is None else o - float(output_tokens))


def judge(limit: RateLimit, levels: Levels, input_tokens: int) -> Verdict:
    """The verdict on refilled `levels`: steps 2 and 3, with the figures a client is told."""
    short = shortfalls(limit, levels, input_tokens)
    if not short:
        return Verdict(True, figures=_figures(limit.buckets, charged(levels, input_tokens)))
    kind, wait = max(short, key=lambda s: s[1])  # the first of the longest
    return Verdict(False, kind, wait, _figures(limit.buckets, levels))


def _figures(buckets: tuple[Bucket | None, ...], levels: Levels) -> tuple[Figures, ...]:
    out = []
    for kind, bucket, level in zip(KINDS, buckets, levels, strict=True):
        if bucket is not None and level is not None:
            out.append(Figures(kind, bucket.size, level, (bucket.size - level) / bucket.rate))
    return tuple(out)


class Budgets:
    """Every tenant's buckets, in this process (one router, or the simulator). Tenants without
    a limit are always admitted and hold no state; the others' state is two numbers per kind."""

    def __init__(self, limits: Mapping[str, RateLimit]) -> None:
        self.limits = {t: lim for t, lim in limits.items() if not lim.is_unlimited}
        self._stored: dict[str, tuple[Levels, float]] = {}  # tenant -> (levels, t)

    def admit(self, tenant: str, input_tokens: int, now: float) -> Verdict:
        """Admit one request of `tenant` with this many prompt tokens, charging it, or refuse
        it, charging nothing."""
        limit = self.limits.get(tenant)
        if limit is None:
            return UNLIMITED
        levels = self.levels(tenant, now)
        verdict = judge(limit, levels, input_tokens)
        if verdict.ok:
            self._stored[tenant] = (charged(levels, input_tokens), now)
        return verdict

    def charge_output(self, tenant: str, output_tokens: int, now: float) -> None:
        """Charge output tokens produced (or counted at the end); may leave a debt."""
        limit = self.limits.get(tenant)
        if limit is None or limit.buckets[2] is None or output_tokens <= 0:
            return
        self._stored[tenant] = (output_charged(self.levels(tenant, now), output_tokens), now)

    def levels(self, tenant: str, now: float) -> Levels:
        """The tenant's levels at `now` (refilled; nothing stored)."""
        levels, t = self._stored.get(tenant, (None, None))
        return refill(self.limits[tenant], levels, t, now)
