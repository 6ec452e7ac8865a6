"""Tenant budgets shared by router replicas: the buckets of router/budgets.py, held in Redis.

One hash per limited tenant, `<prefix>:budget:<tenant>` = {r, i, o: levels, t: when stored},
changed only by BUDGET_STEP: one EVALSHA per admission (and one per finished request with an
output limit), which refills, judges and charges atomically on the server. The script is
router/budgets.py's step function line by line on the same doubles (levels written as %.17g
and read back exactly), so a replica's verdict is the one a single router holding every
replica's charges would give; a test (tests/system/test_budget_script.py) holds the two equal.
It returns the refilled levels; the replica computes the verdict's figures from them with
`router.budgets.judge`, the one place that arithmetic lives.

The clock is the caller's wall clock (`time.time()`), passed in, not Redis's TIME: the script
then is a pure function of its arguments and the hash, the same step as the in-process one
(and testable against it on a hand-driven clock); the replicas are on one host, so they share
that clock. Across hosts, NTP keeps wall clocks within milliseconds, and the step never lets
time run backwards (a behind clock refills nothing), so skew costs at most rate x skew.

A hash expires a minute after its buckets would all be full again: a missing hash reads as
full buckets, so an idle tenant's state vanishes without changing any verdict.

When the store does not answer (within `timeout`; after a failure it is not asked again for
`hold` seconds, so a stopped store delays few requests), `rate_limit_store_failure` decides:

    open (default)  admit, unmetered: no x-ratelimit headers; an output charge is dropped
    closed          503 in the OpenAI shape (`rate_limit_store_unavailable`), Retry-After 1

Each such decision (and each dropped charge) counts in fairway_rate_limit_store_errors_total,
and a warning is logged at most once per 10 s. Open is the default because the limits guard
against a tenant taking more than its share, which the fairness policy and the dispatch
queues still bound while the store is away, whereas closed turns a store outage (one that
`fairway serve` repairs in seconds, restarting its Redis) into an outage of every limited
tenant; replicas route on without their store for the same reason (shared_state.py). Closed
is for budgets that must never be exceeded (a cost cap), at that price.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping

import redis
import redis.asyncio
from aiohttp import web
from prometheus_client import Counter

from router.budgets import UNLIMITED, Levels, RateLimit, Verdict, judge
from router.proxy.errors import APIError
from router.proxy.ratelimit import RATE_LIMITS
from router.proxy.service.store import Store

log = logging.getLogger(__name__)

TIMEOUT = 0.5  # seconds a budget check waits for the store, its turn included (a local Redis
# answers in a fraction of a millisecond)
HOLD = 1.0  # seconds the store is not asked again after a failure
WARN_EVERY = 10.0  # seconds between two warnings of an unreachable store
MARGIN_MS = 60_000  # a hash outlives its buckets' refill by this: clocks may differ a little
# Script calls at once; more wait their turn (within TIMEOUT). Below redis-py's pool of 100
# connections, which refuses the 101st call outright rather than queueing it.
MAX_CALLS = 64

# KEYS[1]: the tenant's hash. ARGV: 'admit' or 'output'; now; the prompt's tokens (admit) or
# the output tokens to charge (output); then per kind (requests, input_tokens, output_tokens)
# its rate per second and its size, '' '' for none. Steps 1-3 of router/budgets.py, in its
# order and arithmetic. Returns {'1' admitted / '0' refused, then per kind its level after
# step 1 ('' for none)}, as text: a Redis reply would truncate a Lua number to an integer.
BUDGET_STEP = """
local FIELDS = {'r', 'i', 'o'}
local op, now, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local stored = redis.call('HMGET', KEYS[1], 'r', 'i', 'o', 't')
local t = tonumber(stored[4])
local rate, size, level = {}, {}, {}
for k = 1, 3 do  -- 1. refill
  rate[k], size[k] = tonumber(ARGV[2 + 2 * k]), tonumber(ARGV[3 + 2 * k])
  if rate[k] then
    local x = tonumber(stored[k])
    if x == nil or t == nil then
      level[k] = size[k]
    else
      local elapsed = now - t
      if elapsed < 0 then elapsed = 0.0 end
      level[k] = math.min(size[k], x + rate[k] * elapsed)
    end
  end
end
local need = {1.0, n, 0.0}  -- 2. judge
if rate[2] then need[2] = math.min(n, size[2]) end
local admitted = '1'
for k = 1, 3 do
  if rate[k] and level[k] < need[k] then admitted = '0' end
end
local reply = {admitted}
for k = 1, 3 do
  reply[k + 1] = rate[k] and string.format('%.17g', level[k]) or ''
end
local after = {level[1], level[2], level[3]}  -- 3. charge
if op == 'output' then
  if not rate[3] then return reply end
  after[3] = level[3] - n
elseif admitted == '1' then
  if rate[1] then after[1] = level[1] - 1.0 end
  if rate[2] then after[2] = level[2] - n end
else
  return reply
end
local fields, full_in = {'t', ARGV[2]}, 0.0
for k = 1, 3 do
  if rate[k] then
    fields[#fields + 1] = FIELDS[k]
    fields[#fields + 1] = string.format('%.17g', after[k])
    full_in = math.max(full_in, (size[k] - after[k]) / rate[k])
  end
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], math.ceil(full_in * 1000) + MARGIN_MS)
return reply
""".replace("MARGIN_MS", str(MARGIN_MS))


def step_args(op: str, now: float, tokens: int, limit: RateLimit) -> list[str]:
    """BUDGET_STEP's ARGV (floats as repr: read back exactly)."""
    args = [op, repr(float(now)), str(int(tokens))]
    for bucket in limit.buckets:
        args += ["", ""] if bucket is None else [repr(bucket.rate), repr(bucket.size)]
    return args


def parse_reply(reply: list) -> tuple[bool, Levels]:
    """BUDGET_STEP's reply: whether it admitted, and the refilled levels."""
    text = [v.decode() if isinstance(v, bytes) else str(v) for v in reply]
    levels = tuple(float(x) if x else None for x in text[1:4])
    return text[0] == "1", (levels[0], levels[1], levels[2])


class SharedBudgets:
    """Every limited tenant's buckets in the replicas' store (one script call per admission).
    `errors`: fairway_rate_limit_store_errors_total."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        prefix: str,
        limits: Mapping[str, RateLimit],
        failure: str = "open",
        errors: Counter | None = None,
        timeout: float = TIMEOUT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert failure in ("open", "closed"), f"rate_limit_store_failure {failure!r}"
        self.client, self.prefix, self.failure = client, prefix, failure
        self.limits = {t: lim for t, lim in limits.items() if not lim.is_unlimited}
        self.errors, self.timeout, self.clock = errors, timeout, clock
        self.script = client.register_script(BUDGET_STEP)
        self._down_until = 0.0  # monotonic: not asked again before this, after a failure
        self._warned_at: float | None = None
        self._pending: set[asyncio.Task] = set()  # output charges under way
        self._calls = asyncio.Semaphore(MAX_CALLS)
        self._closed = False

    def key(self, tenant: str) -> str:
        return f"{self.prefix}:budget:{tenant}"

    async def admit(self, tenant: str, input_tokens: int) -> Verdict:
        """As Budgets.admit, through the store; without it, as `failure` says."""
        limit = self.limits.get(tenant)
        if limit is None:
            return UNLIMITED
        reply = await self._step("admit", tenant, input_tokens, limit)
        if reply is None:
            return self._unchecked()
        admitted, levels = parse_reply(reply)
        verdict = judge(limit, levels, input_tokens)
        assert verdict.ok == admitted, "the script and router.budgets judged alike"
        return verdict

    def charge_output(self, tenant: str, output_tokens: int) -> None:
        """Charge output tokens in the background (the request has ended; nothing waits)."""
        limit = self.limits.get(tenant)
        if limit is None or limit.buckets[2] is None or output_tokens <= 0 or self._closed:
            return
        task = asyncio.create_task(self._step("output", tenant, output_tokens, limit))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def settle(self, timeout: float = 2.0) -> None:
        """Wait (at most `timeout` s) for the output charges under way."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout)

    async def close(self, timeout: float = 2.0) -> None:
        """Take no more charges; let those under way finish (bounded)."""
        self._closed = True
        await self.settle(timeout)

    async def _step(self, op: str, tenant: str, tokens: int, limit: RateLimit) -> list | None:
        """One script call; None if the store failed (counted, logged, held off)."""
        now = self.clock()
        try:
            async with asyncio.timeout(self.timeout):
                if time.monotonic() < self._down_until:  # before queueing for a call, and after
                    self._failed(None)
                    return None
                async with self._calls:
                    if time.monotonic() < self._down_until:
                        self._failed(None)
                        return None
                    return await self.script(
                        keys=[self.key(tenant)], args=step_args(op, now, tokens, limit)
                    )
        except (redis.RedisError, OSError, TimeoutError) as e:
            self._down_until = time.monotonic() + HOLD
            self._failed(e)
            return None

    def _failed(self, e: BaseException | None) -> None:
        if self.errors is not None:
            self.errors.inc()
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning(
                "tenant budgets: the store is unreachable (%s); failing %s: %s",
                "held off after a failure" if e is None else f"{type(e).__name__}: {e}",
                self.failure,
                "admitting unmetered" if self.failure == "open" else "answering 503",
            )

    def _unchecked(self) -> Verdict:
        if self.failure == "open":
            return UNLIMITED
        error = APIError(
            503,
            "The rate-limit store is unreachable; try again shortly.",
            "service_unavailable",
            code="rate_limit_store_unavailable",
        )
        error.headers["Retry-After"] = "1"
        raise error


def shared_budgets_ctx(
    store: Store, prefix: str
) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp cleanup context: while the app runs, its tenant budgets (ratelimit.py's
    RATE_LIMITS, installed by create_app) are kept in `store` under `prefix`."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        limits = app[RATE_LIMITS]
        client = store.client(timeout=1.0)
        shared = SharedBudgets(
            client,
            prefix,
            limits.limits,
            limits.store_failure,
            limits.metrics.rate_limit_store_errors,
        )
        local = limits.use(shared)
        try:
            yield
        finally:
            limits.use(local)
            await shared.close()
            with contextlib.suppress(redis.RedisError, OSError):
                await client.aclose()

    return ctx
