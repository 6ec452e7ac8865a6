"""Router replicas share fairness counters and routing decisions through Redis.

Every `interval` seconds each replica makes one round trip:

    replica ─▶ EVAL: per ledger, HINCRBYFLOAT <prefix>:ledger:<key> <field> Δ  its Ledger.take()
            ◀─       then HGETALL of each (the totals of every replica), as one JSON reply
            ─▶ XADD  <prefix>:routed MAXLEN ~ n {r, b}         its routing log since the last sync
            ◀─ XREAD <prefix>:routed since its last id        the others' ─▶ Router.learn_routed

Counters are sums of changes (router/ledger.py), so adding each replica's changes into one hash
per ledger gives every replica the same totals whatever order the syncs come in. After the
round trip a replica's value is the store's total plus what it charged during the round trip
(taken again, and sent next time): its own charges show at once, the others' at most about two
intervals late. That lag is the trade the simulator measures (`fairway experiment replicas`).

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
from collections.abc import AsyncIterator, Callable, Hashable, Iterator, Mapping
from pathlib import Path

import msgpack
import redis
import redis.asyncio
from aiohttp import web

from router.core import Router
from router.ledger import Ledger
from router.proxy.ports import free_port
from router.runtime.processes import guarded

log = logging.getLogger(__name__)

Changes = dict[Hashable, float]

# KEYS: one hash per ledger. ARGV: per key, a count n and then n (field, change) pairs. Adds
# each change (HINCRBYFLOAT: exact, atomic, with the script), then returns every key's
# HGETALL, as JSON. Changes travel as Python's repr of the float, totals as Redis formats them.
ADD_AND_READ = """
local out, a = {}, 1
for i, key in ipairs(KEYS) do
  local n = tonumber(ARGV[a])
  a = a + 1
  for _ = 1, n do
    redis.call('HINCRBYFLOAT', key, ARGV[a], ARGV[a + 1])
    a = a + 2
  end
  out[i] = redis.call('HGETALL', key)
end
return cjson.encode(out)
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
    ) -> None:
        self.router, self.client, self.prefix = router, client, prefix
        self.replica, self.interval, self.clock = replica, interval, clock
        self.stream_maxlen, self.read_count = stream_maxlen, read_count
        self.stream = f"{prefix}:routed"
        self.last_id = "0-0"  # a new replica reads the whole (bounded) log: a warm index
        self.num_syncs = 0
        self.num_learned = 0  # routing decisions of other replicas applied here
        self._unsent: dict[tuple[object, ...], Changes] = {}
        router.routing_log = []

    def describe(self) -> dict[str, object]:
        """This replica's view, for its /admin/replica: sync counts and ledger values."""
        return {
            "replica": self.replica,
            "syncs": self.num_syncs,
            "learned": self.num_learned,
            "last_id": self.last_id,
            "ledgers": {
                encode_key(key): {encode_key(k): v for k, v in ledger.items()}
                for key, ledger in self.router.ledgers().items()
            },
        }

    def ledger_name(self, key: tuple[object, ...]) -> str:
        return f"{self.prefix}:ledger:{encode_key(key)}"

    async def sync(self) -> None:
        ledgers = self.router.ledgers()
        changes = {
            k: _merged(self._unsent.pop(k, {}), ledger.take()) for k, ledger in ledgers.items()
        }
        self._unsent.clear()  # a ledger that is gone (its worker removed) sends nothing more
        routed = self.router.routing_log or []
        self.router.routing_log = []
        # One script adds every change and returns every total (one reply to parse, not one
        # per field: parsing replies is most of a round's cost on the client), then the log.
        names, argv = [], []
        for key, delta in changes.items():
            sent = [(encode_key(f), repr(d)) for f, d in delta.items() if d and math.isfinite(d)]
            names.append(self.ledger_name(key))
            argv += [len(sent), *(x for pair in sent for x in pair)]
        pipe = self.client.pipeline(transaction=False)
        pipe.eval(ADD_AND_READ, len(names), *names, *argv)
        if routed:
            batch = msgpack.packb([[h, w, t] for h, w, t in routed])
            pipe.xadd(
                self.stream,
                {"r": self.replica, "b": batch},
                maxlen=self.stream_maxlen,
                approximate=True,
            )
        pipe.xread({self.stream: self.last_id}, count=self.read_count)
        try:
            results = await pipe.execute(raise_on_error=True)
        except BaseException:
            # Not applied, or not known to be: sent again next round (a reply lost after the
            # store applied it would count those changes twice; that is the rarer error).
            self._unsent = changes
            self.router.routing_log = routed + (self.router.routing_log or [])
            raise
        totals = json.loads(results[0])
        for key, flat in zip(changes, totals if isinstance(totals, list) else [], strict=True):
            pairs = flat if isinstance(flat, list) else []  # cjson writes an empty table as {}
            self._settle(ledgers[key], key, dict(zip(pairs[::2], pairs[1::2], strict=True)))
        self._learn(results[-1])
        self.num_syncs += 1

    def _settle(self, ledger: Ledger, key: tuple[object, ...], stored: Mapping) -> None:
        """Local value := the store's total + what changed here since the take + this
        replica's own adjustments (lifts, refills: router.ledger)."""
        totals = {decode_key(f): float(v) for f, v in stored.items()}
        since = ledger.take()
        if since:
            self._unsent[key] = since
        for field in set(totals) | set(ledger):
            target = totals.get(field, 0.0) + since.get(field, 0.0) + ledger.local.get(field, 0.0)
            current = ledger.get(field, 0.0)
            if target != current:
                ledger.apply({field: target - current})

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


SHARED = web.AppKey("shared_state", SharedState)


def shared_state_ctx(
    router: Router, url: str, prefix: str, replica: str, interval: float
) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp cleanup context: sync through `url` while the app runs; on the way out, one
    last round so the others see this replica's final charges."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        client = redis.asyncio.Redis.from_url(url)
        state = app[SHARED] = SharedState(router, client, prefix, replica, interval)
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


def _merged(a: Changes, b: Changes) -> Changes:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0.0) + v
    return out


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
