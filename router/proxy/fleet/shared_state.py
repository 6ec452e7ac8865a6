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
appends the event; every replica applies the log in order (this one at once, the others when
their next round sees the log longer), so worker ids, and the ledger keys that hold them, agree.

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
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from pathlib import Path

import msgpack
import redis
import redis.asyncio
from aiohttp import web

from router.core import Router
from router.ledger import Refill, Step
from router.prefix_index import WorkerId
from router.proxy.errors import APIError
from router.proxy.live import LiveCluster, LiveWorker
from router.proxy.membership import MEMBERSHIP, Membership, duplicate, missing, same_url
from router.proxy.ports import free_port
from router.runtime.processes import guarded

log = logging.getLogger(__name__)

# KEYS: one hash per ledger. ARGV, per key: a count of steps, then each step: "s", a count n and
# n (field, lo, hi, add) for a segment (x -> min(max(x, lo), hi) + add; "" for no bound), or "r",
# the quantum, a count n and n fields for a refill. Applies each step as router/ledger.py does
# (`bounded`, `refill_amount`), writes each value as %.17g (read back exactly), then returns
# every key's HGETALL, as JSON.
APPLY_AND_READ = """
local function value(key, field)
  local v = redis.call('HGET', key, field)
  if v then return tonumber(v) end
  return 0.0
end
local function put(key, field, x)
  redis.call('HSET', key, field, string.format('%.17g', x))
end
local out, a = {}, 1
for i, key in ipairs(KEYS) do
  local steps = tonumber(ARGV[a])
  a = a + 1
  for _ = 1, steps do
    if ARGV[a] == 's' then
      local n = tonumber(ARGV[a + 1])
      a = a + 2
      for _ = 1, n do
        local x, lo, hi = value(key, ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
        if lo and x < lo then x = lo end
        if hi and x > hi then x = hi end
        put(key, ARGV[a], x + tonumber(ARGV[a + 3]))
        a = a + 4
      end
    else
      local quantum, n = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
      a = a + 3
      local richest = 1.0
      for j = 0, n - 1 do
        local x = value(key, ARGV[a + j])
        if j == 0 or x > richest then richest = x end
      end
      if richest <= 0 then
        local add = (math.floor(-richest / quantum) + 1) * quantum
        for j = 0, n - 1 do put(key, ARGV[a + j], value(key, ARGV[a + j]) + add) end
      end
      a = a + n
    end
  end
  out[i] = redis.call('HGETALL', key)
end
return cjson.encode(out)
"""

# KEYS: the pool (a hash: URL -> worker id), the next worker id, the log of changes (a list of
# JSON [op, id, url, kv_events]; its length is the pool's version). ARGV: the op ("join", "add",
# "remove"), the starting pool as JSON (ids 0, 1, ... in its order: the store is seeded with it
# by whichever call comes first), then the op's: the URL and KV-event endpoint, or the id.
MEMBERSHIP_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  local initial = cjson.decode(ARGV[2])
  for i, url in ipairs(initial) do redis.call('HSET', KEYS[1], url, i - 1) end
  redis.call('SET', KEYS[2], #initial)
end
if ARGV[1] == 'add' then
  local have = redis.call('HGET', KEYS[1], ARGV[3])
  if have then return cjson.encode({conflict = tonumber(have)}) end
  local id = redis.call('INCR', KEYS[2]) - 1
  redis.call('HSET', KEYS[1], ARGV[3], id)
  local version = redis.call('RPUSH', KEYS[3], cjson.encode({'add', id, ARGV[3], ARGV[4]}))
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

    Owns the router's `routing_log` (turned on here). A round that fails (the store is gone)
    keeps what it took for the next round; the replica routes on with what it knows.
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
    ) -> None:
        self.router, self.client, self.prefix = router, client, prefix
        self.replica, self.interval, self.clock = replica, interval, clock
        self.stream_maxlen, self.read_count = stream_maxlen, read_count
        self.membership = membership
        self.stream = f"{prefix}:routed"
        self.last_id = "0-0"  # a new replica reads the whole (bounded) log: a warm index
        self.num_syncs = 0
        self.num_learned = 0  # routing decisions of other replicas applied here
        self._unsent: dict[tuple[object, ...], list[Step]] = {}
        router.routing_log = []

    def describe(self) -> dict[str, object]:
        """This replica's view, for its /admin/replica: sync counts and ledger values."""
        return {
            "replica": self.replica,
            "syncs": self.num_syncs,
            "learned": self.num_learned,
            "last_id": self.last_id,
            "workers_version": self.membership.version if self.membership else None,
            "ledgers": {
                encode_key(key): {encode_key(k): v for k, v in ledger.items()}
                for key, ledger in self.router.ledgers().items()
            },
        }

    def ledger_name(self, key: tuple[object, ...]) -> str:
        return f"{self.prefix}:ledger:{encode_key(key)}"

    async def sync(self) -> None:
        ledgers = self.router.ledgers()
        sent = {k: self._unsent.pop(k, []) + ledger.take() for k, ledger in ledgers.items()}
        self._unsent.clear()  # a ledger that is gone (its worker removed) sends nothing more
        routed = self.router.routing_log or []
        self.router.routing_log = []
        # One script applies every step and returns every value (one reply to parse, not one
        # per field: parsing replies is most of a round's cost on the client), then the log.
        names, argv = [], []
        for key, steps in sent.items():
            names.append(self.ledger_name(key))
            argv += encode_steps(steps)
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
        try:
            results = await pipe.execute(raise_on_error=True)
        except BaseException:
            # Not applied, or not known to be: sent again next round (a reply lost after the
            # store applied it would count those charges twice; that is the rarer error, and
            # a lift, a clamp or a refill sent twice counts once).
            self._unsent = sent
            self.router.routing_log = routed + (self.router.routing_log or [])
            raise
        totals = json.loads(results[0])
        for key, flat in zip(sent, totals if isinstance(totals, list) else [], strict=True):
            pairs = flat if isinstance(flat, list) else []  # cjson writes an empty table as {}
            stored = {decode_key(f): float(v) for f, v in zip(pairs[::2], pairs[1::2], strict=True)}
            ledgers[key].rebase(stored)
        if self.membership is not None:
            self._learn(results[-2])
            await self.membership.catch_up(int(results[-1]))
        else:
            self._learn(results[-1])
        self.num_syncs += 1

    def _learn(self, reply: object) -> None:
        entries = _stream_entries(reply, self.stream)
        now = self.clock()
        for entry_id, fields in entries:
            self.last_id = _text(entry_id)
            if _text(fields.get(b"r", fields.get("r", b""))) == self.replica:
                continue
            batch = msgpack.unpackb(fields.get(b"b", fields.get("b", b"")) or b"\x90")
            routed = [(list(h), int(w), min(float(t), now)) for h, w, t in batch]
            self.router.learn_routed(routed)
            self.num_learned += len(routed)

    async def run(self) -> None:
        """Sync every `interval` seconds until cancelled; a failed round is logged, not fatal."""
        failing = False
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sync()
                if failing:
                    log.info("replica %s: the shared store answers again", self.replica)
                failing = False
            except (redis.RedisError, OSError) as e:
                if not failing:
                    log.warning("replica %s: sync failed (%s); retrying", self.replica, e)
                failing = True
            except Exception:
                log.exception("replica %s: sync failed", self.replica)


class SharedMembership(Membership):
    """The replicas' pool: an add or a remove is an event in the store's log (one script checks
    it, takes the id and appends it), and every replica applies the log in order: this one at
    once, the others at their next round. The starting pool (the parent's workers, ids 0, 1, ...
    in its order) seeds the store; a restarted replica starts from it and replays the log."""

    def __init__(
        self, cluster: LiveCluster, client: redis.asyncio.Redis, prefix: str, initial: list[str]
    ) -> None:
        super().__init__(cluster)
        self.client = client
        self.keys = [f"{prefix}:workers", f"{prefix}:workers:next", f"{prefix}:workers:log"]
        self.initial = json.dumps([same_url(u) for u in initial])
        self.version = 0  # events of the log applied here
        self._applying = asyncio.Lock()

    @property
    def log(self) -> str:
        return self.keys[2]

    async def join(self) -> None:
        """Seed the store with the starting pool if no replica has, and apply the log."""
        await self.catch_up((await self._call("join"))["version"])

    async def add(self, url: str, kv_events: str | None) -> LiveWorker:
        out = await self._call("add", url, kv_events or "")
        if "conflict" in out:
            raise duplicate(url, out["conflict"])
        await self._read_back(out["version"])
        worker = self.cluster.workers.get(out["id"])
        if worker is None:  # another replica removed it in between
            raise APIError(409, f"worker {url} was added and removed again", param="url")
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
                op, wid, url, kv_events = json.loads(raw)
                if op == "add" and wid not in self.cluster.workers:
                    self.cluster.add_worker(url, kv_events or None, wid)
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
                MEMBERSHIP_SCRIPT, 3, *self.keys, op, self.initial, *args
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
    cluster: LiveCluster, url: str, prefix: str, replica: str, interval: float, workers: list[str]
) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp cleanup context: join the shared pool (`workers`: the starting one), then
    sync through `url` while the app runs; on the way out, one last round so the others see
    this replica's final charges. Installs the app's MEMBERSHIP: the admin API's adds and
    removes go through the store."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        client = redis.asyncio.Redis.from_url(url)
        membership = app[MEMBERSHIP] = SharedMembership(cluster, client, prefix, workers)
        state = app[SHARED] = SharedState(
            cluster.router, client, prefix, replica, interval, membership=membership
        )
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


def forget(url: str, prefix: str) -> int:
    """Delete a run's keys from a store that outlives it. Returns how many."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        return client.delete(*keys) if keys else 0
    finally:
        client.close()


# ------------------------------------------------------------------------- the store


@contextlib.contextmanager
def redis_server(scratch: Path, timeout: float = 10.0) -> Iterator[str]:
    """A redis-server of our own on a free loopback port, without persistence, dying with this
    process; yields its URL and stops exactly it."""

    exe = shutil.which("redis-server")
    if exe is None:
        raise ValueError(
            "redis_url: not set and no redis-server on PATH (`make test` installs Debian's "
            "redis-server; or point redis_url at one)"
        )
    scratch.mkdir(parents=True, exist_ok=True)
    for _ in range(3):  # a free port can be taken between the check and the bind
        port = free_port()
        argv = [
            exe,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--dir",
            str(scratch),
            "--logfile",
            str(scratch / "redis.log"),
        ]
        proc = subprocess.Popen(guarded(argv), stdin=subprocess.DEVNULL, start_new_session=True)
        url = f"redis://127.0.0.1:{port}/0"
        if _wait_ready(url, proc, timeout):
            break
        _stop(proc)
    else:
        raise RuntimeError(f"redis-server did not start: see {scratch / 'redis.log'}")
    log.info("redis-server on %s (pid %d)", url, proc.pid)
    try:
        yield url
    finally:
        _stop(proc)


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(redis.RedisError, OSError):
                if client.ping():
                    return True
            time.sleep(0.05)
        return False
    finally:
        client.close()


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------- helpers


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
