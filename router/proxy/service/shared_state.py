"""Router replicas share fairness counters, routing decisions and the worker pool through Redis.

Every `interval` seconds each replica makes one round trip:

    replica ─▶ EVAL: per ledger, its Ledger.take() steps (router/ledger.py), applied to one hash
            ◀─       per ledger in order; then HGETALL of each, as one JSON reply   ─▶ rebase
            ─▶ XADD  <prefix>:routed MAXLEN ~ n {r, b}         its routing log since the last sync
            ◀─ XREAD <prefix>:routed since its last id        the others' ─▶ Router.learn_routed
            ◀─ LLEN  <prefix>:workers:log                     the pool's version ─▶ catch up

A ledger's steps are operations any replica may repeat: charges as sums, a lift as a max, a clamp
as a min, a refill that does nothing once a client is in credit. The script applies them with the
ledger's own arithmetic (`bounded`, `refill_amount`), to the bit: values are written as %.17g and
read back exactly, and Lua's numbers are the same doubles as Python's. So the store holds what one
router applying every replica's operations in the order they arrived would hold, and after a
round trip a replica's values are the store's plus what it did while the reply was on its way
(replayed by `Ledger.rebase`, sent next time). Its own charges show at once, the others' at most
about two intervals late: the lag the simulator measures (`fairway experiment replicas`).

The pool is shared as a log of adds and removes (`SharedMembership`). An admin call at any
replica runs one script that checks the URL against the pool, takes the next worker id and
appends the event (an add with the server's model group and role); every replica applies the
log in order (this one at once, the others when their next round sees the log longer), so
worker ids, and the ledger keys that hold them, agree.

Keys and fields are JSON (a ledger key `("queue", 0, "counters")`, a field `"tenant-1"` or
`["tenant-1", 0]`), so every replica encodes the same thing the same way. Routing decisions
travel as one msgpack batch per replica per sync; their times are the sender's monotonic clock,
which on one host is everyone's. In precise mode each replica hears the workers' KV events
itself, so the index that routes needs no store; the approximate one learns the batches still.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable

import msgpack
import redis
import redis.asyncio
import redis.exceptions
from aiohttp import web

from router.core import Router
from router.ledger import NONE_ABOVE, Refill, Segment, Step
from router.prefix_index import WorkerId
from router.proxy.driver import LiveCluster, LiveWorker
from router.proxy.errors import APIError
from router.proxy.health import HEALTH_NOTES
from router.proxy.membership import (
    MEMBERSHIP,
    Membership,
    NewWorker,
    duplicate,
    missing,
    same_url,
)
from router.proxy.metrics import SharedStateMetrics
from router.proxy.service.store import Store
from router.runtime.trouble import TroubleLog, own_trouble

log = logging.getLogger(__name__)

# KEYS: the store's epoch (a token the first replica sets), the batches each replica has had
# applied (a hash: replica -> the last batch's number), then one hash per ledger. ARGV: the
# epoch the replica last synced with ("" for none yet), a new token, whether restore steps are
# included ("1"/"0"), the replica's name, its number of batches; then per ledger its restore
# steps; then each batch: its number, then per ledger its steps. Steps: a count, then each step:
# "s", a count n and n (field, lo, hi, add) for a segment (x -> min(max(x, lo), hi) + add; ""
# for no bound), or "r", the quantum, a count n and n fields for a refill. Applies each step as
# router/ledger.py does (`bounded`, `refill_amount`) and writes each value as %.17g (read back
# exactly).
# - A batch is applied once: one numbered at most the replica's last is skipped (a round that
#   timed out may still be applied later, by a store that was stopped, not gone; the replica
#   sends its batches again, and they must not count twice).
# - Restore steps are applied only when the epoch is not the replica's (the store came back
#   without its state, or this is the replica's first round); if the replica sent none, nothing
#   is applied and the reply asks for them.
# Returns {e: epoch, r: 1 if the epoch was not the replica's, again: 1 if nothing was applied,
# v: every ledger's HGETALL}, as JSON.
APPLY_AND_READ = """
local function value(key, field)
  local v = redis.call('HGET', key, field)
  if v then return tonumber(v) end
  return 0.0
end
local function put(key, field, x)
  redis.call('HSET', key, field, string.format('%.17g', x))
end
local function apply(key, a, live)
  local steps = tonumber(ARGV[a])
  a = a + 1
  for _ = 1, steps do
    if ARGV[a] == 's' then
      local n = tonumber(ARGV[a + 1])
      a = a + 2
      for _ = 1, n do
        if live then
          local x, lo, hi = value(key, ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
          if lo and x < lo then x = lo end
          if hi and x > hi then x = hi end
          put(key, ARGV[a], x + tonumber(ARGV[a + 3]))
        end
        a = a + 4
      end
    else
      local quantum, n = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
      a = a + 3
      if live then
        local richest = 1.0
        for j = 0, n - 1 do
          local x = value(key, ARGV[a + j])
          if j == 0 or x > richest then richest = x end
        end
        if richest <= 0 then
          local add = (math.floor(-richest / quantum) + 1) * quantum
          for j = 0, n - 1 do put(key, ARGV[a + j], value(key, ARGV[a + j]) + add) end
        end
      end
      a = a + n
    end
  end
  return a
end
local epoch, reset = redis.call('GET', KEYS[1]), 0
if epoch ~= ARGV[1] then
  reset = 1
  if ARGV[3] ~= '1' then return cjson.encode({e = epoch or '', r = 1, again = 1}) end
  if not epoch then
    epoch = ARGV[2]
    redis.call('SET', KEYS[1], epoch)
  end
end
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[4]) or '0')
local out, a = {}, 6
for i = 3, #KEYS do a = apply(KEYS[i], a, reset == 1) end
for _ = 1, tonumber(ARGV[5]) do
  local batch = tonumber(ARGV[a])
  a = a + 1
  for i = 3, #KEYS do a = apply(KEYS[i], a, batch > last) end
  if batch > last then last = batch end
end
redis.call('HSET', KEYS[2], ARGV[4], last)
for i = 3, #KEYS do out[i - 2] = redis.call('HGETALL', KEYS[i]) end
return cjson.encode({e = epoch, r = reset, again = 0, v = out})
"""

# KEYS: the pool (a hash: URL -> worker id), the next worker id, the log of changes (a list of
# JSON [op, id, url, kv_events]; its length is the pool's version). ARGV: the op ("join", "add",
# "remove"), the caller's pool as JSON {pool: [[url, id], ...], next: id} (the store is seeded
# with it by whichever call comes first: the starting pool at start, ids 0, 1, ... in its order,
# and after the store lost its state, the pool the replicas still hold), then the op's: the URL
# and KV-event endpoint, or the id.
MEMBERSHIP_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  local seed = cjson.decode(ARGV[2])
  for _, pair in ipairs(seed.pool) do redis.call('HSET', KEYS[1], pair[1], pair[2]) end
  redis.call('SET', KEYS[2], seed.next)
end
if ARGV[1] == 'add' then
  local have = redis.call('HGET', KEYS[1], ARGV[3])
  if have then return cjson.encode({conflict = tonumber(have)}) end
  local id = redis.call('INCR', KEYS[2]) - 1
  redis.call('HSET', KEYS[1], ARGV[3], id)
  local version = redis.call('RPUSH', KEYS[3], cjson.encode({'add', id, ARGV[3], ARGV[4], ARGV[5]}))
  return cjson.encode({id = id, version = version})
end
if ARGV[1] == 'remove' then
  local id, pool = tonumber(ARGV[3]), redis.call('HGETALL', KEYS[1])
  for i = 1, #pool, 2 do
    if tonumber(pool[i + 1]) == id then
      redis.call('HDEL', KEYS[1], pool[i])
      local version = redis.call('RPUSH', KEYS[3], cjson.encode({'remove', id, pool[i], ''}))
      return cjson.encode({id = id, version = version})
    end
  end
  return cjson.encode({missing = id})
end
return cjson.encode({version = redis.call('LLEN', KEYS[3])})
"""


def encode_key(key: object) -> str:
    """Deterministic text for a ledger key or field (tuples as JSON arrays)."""
    return json.dumps(key, separators=(",", ":"), ensure_ascii=False)


def decode_key(text: str | bytes) -> Hashable:
    def tuples(v: object) -> Hashable:
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v  # type: ignore[return-value]

    return tuples(json.loads(text))


class SharedState:
    """One replica's side of the store: `sync()` is one round, `run()` repeats it.

    Owns the router's `routing_log` (turned on here). A round that fails (the store is gone,
    or silent past `timeout`) keeps what it took for the next round; the replica routes on with
    what it knows, reports itself out of sync (`status`, /health, the shared-state metrics),
    and when the store answers again, catches up.

    A store that comes back empty (restarted, or a user's own Redis after losing its data) is
    told apart by its epoch, a token the first replica writes. The first replica to sync with
    it re-publishes what it holds, and so does each that follows: its ledgers as they were at
    its last round, raised to (never added: every replica holds the same values), then what it
    did since; its routing decisions of the last `stream_maxlen`; the pool. Charges made during
    the outage are kept exactly; of those made before it, what reached any replica's last
    round survives (within a round's charges of what one store would hold).
    """

    def __init__(
        self,
        router: Router,
        client: redis.asyncio.Redis,
        prefix: str,
        replica: str,
        interval: float,
        stream_maxlen: int = 10_000,
        read_count: int = 1_000,
        clock: Callable[[], float] = time.monotonic,
        membership: SharedMembership | None = None,
        timeout: float | None = None,
        metrics: SharedStateMetrics | None = None,
    ) -> None:
        self.router, self.client, self.prefix = router, client, prefix
        self.replica, self.interval, self.clock = replica, interval, clock
        self.stream_maxlen, self.read_count = stream_maxlen, read_count
        # A store that is stopped (not gone) keeps the connection open and never answers.
        self.timeout = timeout if timeout is not None else max(1.0, 5 * interval)
        self.membership = membership
        self.metrics = metrics
        self.stream = f"{prefix}:routed"
        self.epoch_key = f"{prefix}:epoch"
        self.epoch: str | None = None  # the store's, as of this replica's last round
        self.last_id = "0-0"  # a new replica reads the whole (bounded) log: a warm index
        self.num_syncs = 0
        self.num_learned = 0  # routing decisions of other replicas applied here
        self.num_resets = 0  # times the store came back without its state
        self.in_sync = False  # the last round succeeded
        self.last_sync = clock()  # of the last successful round (or the start)
        self.last_failure = ""  # its kind, while out of sync
        self.applied_key = f"{prefix}:applied"
        self._batches: list[tuple[int, dict[tuple[object, ...], list[Step]]]] = []  # unconfirmed
        self._next_batch = 1
        self._snapshot: dict[tuple[object, ...], dict[Hashable, float]] = {}
        self._own_routed: deque[tuple[object, int, float]] = deque(maxlen=stream_maxlen)
        self.trouble = TroubleLog(f"replica {replica}: sync with the store", log)
        router.indexes.routing_log = []
        if metrics is not None:
            metrics.watch(self)

    def describe(self) -> dict[str, object]:
        """This replica's view, for its /admin/replica: sync counts and ledger values."""
        return {
            "replica": self.replica,
            "syncs": self.num_syncs,
            "learned": self.num_learned,
            "resets": self.num_resets,
            "in_sync": self.in_sync,
            "seconds_since_sync": self.seconds_since_sync(),
            "last_id": self.last_id,
            "workers_version": self.membership.version if self.membership else None,
            "ledgers": {
                encode_key(key): {encode_key(k): v for k, v in ledger.items()}
                for key, ledger in self.router.ledgers().items()
            },
        }

    def seconds_since_sync(self) -> float:
        return max(0.0, self.clock() - self.last_sync)

    def health_note(self) -> str | None:
        """Why this replica is degraded (/health), or None while it is in sync."""
        if self.in_sync:
            return None
        return (
            f"shared state out of sync for {self.seconds_since_sync():.1f} s "
            f"({self.last_failure or 'not synced yet'}): fairness counters and routing "
            "decisions are this replica's own until the store answers"
        )

    def ledger_name(self, key: tuple[object, ...]) -> str:
        return f"{self.prefix}:ledger:{encode_key(key)}"

    async def sync(self) -> None:
        """One round: send what changed here, read everyone's totals and decisions. On a
        store that lost its state since the last round, a second trip re-publishes."""
        ledgers = self.router.ledgers()
        self._batches.append((self._next_batch, {k: v.take() for k, v in ledgers.items()}))
        self._next_batch += 1
        keys = list(ledgers)  # a ledger that is gone (its worker removed) sends nothing more
        routed = self.router.indexes.routing_log or []
        self.router.indexes.routing_log = []
        first_contact = self.epoch is None
        try:
            # First contact: nothing to restore from, so the restore steps (none) go at once.
            reply, results = await self._round(keys, routed, restore=first_contact)
            if reply["again"]:  # the store lost its state: send again, with what to restore
                self.last_id = "0-0"  # the old log is gone; read the new one whole
                # This round's decisions went with the first trip; the earlier ones are lost.
                republished = list(self._own_routed)
                reply, results = await self._round(keys, republished, restore=True)
                await self._restored(reply, len(republished))
        except BaseException:
            # Not applied, or not known to be: the batches go again next round (the store
            # skips one it has applied), and so do the decisions (learning one twice is
            # harmless).
            self.router.indexes.routing_log = routed + (self.router.indexes.routing_log or [])
            raise
        self._batches.clear()
        self.epoch = reply["e"]
        self._own_routed.extend(routed)
        totals = reply.get("v") or []
        self._snapshot = {}
        for key, flat in zip(keys, totals if isinstance(totals, list) else [], strict=True):
            pairs = flat if isinstance(flat, list) else []  # cjson writes an empty table as {}
            stored = {decode_key(f): float(v) for f, v in zip(pairs[::2], pairs[1::2], strict=True)}
            ledgers[key].rebase(stored)
            self._snapshot[key] = stored
        if self.membership is not None:
            self._learn(results[-2])
            await self.membership.catch_up(int(results[-1]))
        else:
            self._learn(results[-1])
        self.num_syncs += 1

    async def _round(
        self, keys: list[tuple[object, ...]], routed: list, restore: bool
    ) -> tuple[dict, list]:
        """One trip: the script (`restore`: with this replica's last values to raise an empty
        store to), this replica's decisions, the others', the pool's version."""
        names = [self.epoch_key, self.applied_key, *map(self.ledger_name, keys)]
        argv = script_args(
            self.epoch or "",
            uuid.uuid4().hex,
            self.replica,
            [self._restore_steps(k) for k in keys] if restore else None,
            [(n, [batch.get(k, []) for k in keys]) for n, batch in self._batches],
        )
        pipe = self.client.pipeline(transaction=False)
        pipe.eval(APPLY_AND_READ, len(names), *names, *argv)
        if routed:
            batch = msgpack.packb([[h, w, t] for h, w, t in routed])
            pipe.xadd(
                self.stream,
                {"r": self.replica, "b": batch},
                maxlen=self.stream_maxlen,
                approximate=True,
            )
        pipe.xread({self.stream: self.last_id}, count=self.read_count)
        if self.membership is not None:
            pipe.llen(self.membership.log)
        async with asyncio.timeout(self.timeout):
            results = await pipe.execute(raise_on_error=True)
        return json.loads(results[0]), results

    def _restore_steps(self, key: tuple[object, ...]) -> list[Step]:
        """Raise each value to what the store held at this replica's last round."""
        values = self._snapshot.get(key) or {}
        return [Segment({f: (v, NONE_ABOVE, 0.0) for f, v in values.items()})] if values else []

    async def _restored(self, reply: dict, republished: int) -> None:
        self.num_resets += 1
        if self.metrics is not None:
            self.metrics.resets.inc()
        log.warning(
            "replica %s: the shared store came back without its state (epoch %s); "
            "re-published %d ledgers' values and %d routing decisions%s",
            self.replica,
            reply["e"][:8],
            len(self._snapshot),
            republished,
            ", and the pool" if self.membership is not None else "",
        )
        if self.membership is not None:
            await self.membership.rejoin()

    def _learn(self, reply: object) -> None:
        entries = _stream_entries(reply, self.stream)
        now = self.clock()
        for entry_id, fields in entries:
            self.last_id = _text(entry_id)
            if _text(fields.get(b"r", fields.get("r", b""))) == self.replica:
                continue
            batch = msgpack.unpackb(fields.get(b"b", fields.get("b", b"")) or b"\x90")
            routed = [(list(h), int(w), min(float(t), now)) for h, w, t in batch]
            self.router.indexes.learn_routed(routed)
            self.num_learned += len(routed)

    async def run(self) -> None:
        """Sync every `interval` seconds until cancelled; a failed round is logged (when the
        replica falls out of sync and when it is back), counted by kind, never fatal."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                async with asyncio.timeout(2 * self.timeout):  # each trip has its own
                    await self.sync()
            except Exception as e:
                self._failed(e)
            else:
                self.trouble.clear()
                if not self.in_sync and self.num_syncs > 1:
                    log.warning(
                        "replica %s: in sync again after %.1f s",
                        self.replica,
                        self.seconds_since_sync(),
                    )
                self.in_sync, self.last_failure = True, ""
                self.last_sync = self.clock()

    def _failed(self, e: Exception) -> None:
        kind = failure_kind(e)
        if self.metrics is not None:
            self.metrics.failures.labels(kind).inc()
        if kind == "own":  # not the store's doing: said once per interval, with a count
            self.trouble.add(own_trouble(e) or kind, repr(e))
        elif self.in_sync or not self.last_failure:
            log.warning(
                "replica %s: sync failed (%s: %s); routing on alone, retrying every %g s",
                self.replica,
                kind,
                e,  # names the store's URL, which holds no password (config.py refuses one)
                self.interval,
            )
        elif kind == "other":
            log.exception("replica %s: sync failed", self.replica)
        self.in_sync, self.last_failure = False, kind


def failure_kind(e: BaseException) -> str:
    """A failed round, for the failures metric: own (this replica could not even try: out of
    descriptors or memory, router/runtime/trouble.py), timeout (a store that does not answer),
    connection (refused, reset), loading (restarted, loading its data), auth, response (the
    store refused a command), other (a bug)."""
    if own_trouble(e) is not None:
        return "own"
    if isinstance(e, (TimeoutError, redis.TimeoutError)):
        return "timeout"
    if isinstance(e, redis.BusyLoadingError):
        return "loading"
    if isinstance(e, (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError)):
        return "auth"
    if isinstance(e, (redis.ConnectionError, OSError)):
        return "connection"
    if isinstance(e, redis.ResponseError):
        return "response"
    return "other"


class SharedMembership(Membership):
    """The replicas' pool: an add or a remove is an event in the store's log (one script checks
    it, takes the id and appends it), and every replica applies the log in order: this one at
    once, the others at their next round. The starting pool (the parent's workers, ids 0, 1, ...
    in its order) seeds the store; a restarted replica starts from it and replays the log."""

    def __init__(self, cluster: LiveCluster, client: redis.asyncio.Redis, prefix: str) -> None:
        super().__init__(cluster)
        self.client = client
        self.keys = [f"{prefix}:workers", f"{prefix}:workers:next", f"{prefix}:workers:log"]
        self.version = 0  # events of the log applied here
        self._applying = asyncio.Lock()

    @property
    def log(self) -> str:
        return self.keys[2]

    async def join(self) -> None:
        """Seed the store with this replica's pool if no replica has, and apply the log."""
        await self.catch_up((await self._call("join"))["version"])

    async def rejoin(self) -> None:
        """The store lost its state: seed it with the pool held here (unless another replica
        has), and apply its new log from the start."""
        async with self._applying:
            self.version = 0
        await self.join()

    def _seed(self) -> str:
        pool = [[same_url(w.url), wid] for wid, w in sorted(self.cluster.workers.items())]
        return json.dumps({"pool": pool, "next": self.cluster.next_worker_id})

    async def add(self, new: NewWorker) -> LiveWorker:
        kind = json.dumps({"model": new.model, "role": new.role.value})
        out = await self._call("add", new.url, new.kv_events or "", kind)
        if "conflict" in out:
            raise duplicate(new.url, out["conflict"])
        await self._read_back(out["version"])
        worker = self.cluster.workers.get(out["id"])
        if worker is None:  # another replica removed it in between
            raise APIError(409, f"worker {new.url} was added and removed again", param="url")
        return worker

    async def remove(self, wid: WorkerId) -> None:
        out = await self._call("remove", wid)
        if "missing" in out:
            raise missing(wid)
        await self._read_back(out["version"])

    async def catch_up(self, version: int) -> None:
        """Apply the log's events up to `version`, in order, once each."""
        async with self._applying:
            if version <= self.version:
                return
            for raw in await self.client.lrange(self.log, self.version, version - 1):
                op, wid, url, kv_events, *rest = json.loads(raw)
                if op == "add" and wid not in self.cluster.workers:
                    kind = json.loads(rest[0]) if rest else {}  # its model group and role
                    self.cluster.add_worker_like_peers(
                        url, kv_events or None, kind.get("model"), kind.get("role", "mixed"), wid
                    )
                elif op == "remove" and wid in self.cluster.workers:
                    self.cluster.remove_worker(wid)
                self.version += 1
                log.info("workers v%d: %s %s (id %d)", self.version, op, url, wid)

    async def _read_back(self, version: int) -> None:
        """Apply the log up to this replica's own change, so that its answer shows it."""
        try:
            await self.catch_up(version)
        except (redis.RedisError, OSError) as e:
            raise APIError(
                503,
                f"the pool changed (version {version}) but the store went away before this "
                f"replica applied it; it will at its next sync ({e})",
                "service_unavailable",
                code="store_unavailable",
            ) from e

    async def _call(self, op: str, *args: object) -> dict:
        try:
            reply = await self.client.eval(
                MEMBERSHIP_SCRIPT, 3, *self.keys, op, self._seed(), *args
            )
        except (redis.RedisError, OSError) as e:
            raise APIError(
                503,
                f"the replicas' store is unreachable; the pool is unchanged ({e})",
                "service_unavailable",
                code="store_unavailable",
            ) from e
        return json.loads(reply)


SHARED = web.AppKey("shared_state", SharedState)


def shared_state_ctx(
    cluster: LiveCluster, store: Store, prefix: str, replica: str, interval: float
) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp cleanup context: join the shared pool (seeding it with the cluster's
    starting pool if no replica has), then sync through `store` while the app runs; on the way
    out, one last round so the others see this replica's final charges. Installs the app's
    MEMBERSHIP (the admin API's adds and removes go through the store), the shared-state
    series, and a health note while the replica is out of sync."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        client = store.client()
        membership = app[MEMBERSHIP] = SharedMembership(cluster, client, prefix)
        state = app[SHARED] = SharedState(
            cluster.router,
            client,
            prefix,
            replica,
            interval,
            membership=membership,
            metrics=cluster.metrics.shared_state(),
        )
        app[HEALTH_NOTES].append(state.health_note)
        cluster.metrics.watch_degraded("shared_state", lambda: not state.in_sync)
        # The store away: routing starts from the starting pool, and catches up when it answers.
        with contextlib.suppress(APIError, redis.RedisError, OSError, TimeoutError):
            async with asyncio.timeout(5.0):
                await membership.join()
        task = asyncio.create_task(state.run(), name="fairway-shared-state")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            with contextlib.suppress(redis.RedisError, OSError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await state.sync()
            await client.aclose()

    return ctx


# ------------------------------------------------------------------------- helpers


def script_args(
    epoch: str,
    new_epoch: str,
    replica: str,
    restore: list[list[Step]] | None,
    batches: list[tuple[int, list[list[Step]]]],
) -> list[object]:
    """APPLY_AND_READ's ARGV: `restore`, per ledger in KEYS' order, the steps to restore an
    empty store from (None: this round sends none); `batches` (number, per ledger its steps),
    oldest first, each with a step list per ledger."""
    argv: list[object] = [epoch, new_epoch, "0" if restore is None else "1", replica]
    argv.append(len(batches))
    ledgers = len(restore) if restore is not None else len(batches[0][1]) if batches else 0
    for steps in restore if restore is not None else [[]] * ledgers:
        argv += encode_steps(steps)
    for number, per_ledger in batches:
        argv.append(number)
        for steps in per_ledger:
            argv += encode_steps(steps)
    return argv


def encode_steps(steps: list[Step]) -> list[object]:
    """A ledger's steps as APPLY_AND_READ's arguments; a change that is not a finite number
    (a bug upstream) is left out rather than stored."""
    out: list[object] = []
    for step in steps:
        if isinstance(step, Refill):
            out += ["r", repr(step.quantum), len(step.keys), *map(encode_key, step.keys)]
            continue
        ops = [(k, op) for k, op in step.ops.items() if not any(math.isnan(x) for x in op)]
        ops = [(k, (lo, hi, add)) for k, (lo, hi, add) in ops if math.isfinite(add)]
        out += ["s", len(ops)]
        for k, (lo, hi, add) in ops:
            out += [encode_key(k), _bound(lo), _bound(hi), repr(add)]
    return [len(steps), *out]


def _bound(x: float) -> str:
    return repr(x) if math.isfinite(x) else ""


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _stream_entries(reply: object, stream: str) -> list[tuple[object, dict]]:
    """XREAD's entries for `stream`, from a RESP2 list or a RESP3 map."""
    if not reply:
        return []
    if isinstance(reply, dict):
        for name, value in reply.items():
            if _text(name) == stream:
                return list(value[0] if value and isinstance(value[0], list) else value)
        return []
    for name, entries in reply:  # type: ignore[attr-defined]
        if _text(name) == stream:
            return list(entries)
    return []
