"""The replicas' store: a Redis that `fairway serve` starts and keeps, or the user's own.

    own (no redis_url) ..... OwnRedis: redis-server on a loopback port, no persistence, dying
                             with `fairway serve`; restarted on the same port when it dies
                             (backing off), and the replicas re-publish into it (shared_state);
                             bounded in memory (`memory_bound`), as one router's store is
    the user's (redis_url) . Store.connect: redis_password, redis_tls; checked at start-up,
                             unreachable is an error naming the URL

A password never travels in a URL: config.py refuses one there, so a URL is safe to log.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import NoBackoff

from router.proxy.ports import free_port
from router.runtime.processes import guarded
from router.runtime.processes import stop as stop_process

log = logging.getLogger("fairway.store")

RESTART_BACKOFF = (0.2, 10.0)  # the first delay, the longest; doubled per quick death
# What the store holds beside stored responses (budgets, shared counters, membership): small,
# one entry per tenant or worker, but kept within the bound too.
HEADROOM_BYTES = 64 * 1024 * 1024


def memory_bound(responses_max_bytes: int) -> int:
    """The memory `fairway serve`'s own Redis may use: the responses' bound (what one router's
    store keeps at most) and room for the rest."""
    return responses_max_bytes + HEADROOM_BYTES


@dataclass(frozen=True)
class Store:
    """Where the replicas' store is and how to reach it (cluster.yaml's redis_* fields)."""

    url: str
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def of_config(cls, raw: dict, url: str) -> Store:
        """From a replica's config (secrets in clear) and the URL it is told to use."""
        tls = raw.get("redis_tls") or {}
        own = not raw.get("redis_url")  # the store `fairway serve` started has no password
        return cls(
            url,
            None if own else raw.get("redis_password"),
            tls.get("ca_file"),
            tls.get("cert_file"),
            tls.get("key_file"),
        )

    def _options(self, timeout: float) -> dict[str, object]:
        options: dict[str, object] = {
            "socket_connect_timeout": timeout,
            "socket_timeout": timeout,
        }
        if self.password is not None:
            options["password"] = self.password
        if self.url.startswith("rediss://"):
            options |= {
                "ssl_ca_certs": self.ca_file,
                "ssl_certfile": self.cert_file,
                "ssl_keyfile": self.key_file,
            }
        return options

    def client(self, timeout: float = 2.0) -> redis.asyncio.Redis:
        # No retries inside a call: a replica's next sync is the retry, and a call that waits
        # through redis-py's back-off (seconds, by default) holds the replica's view stale.
        once = redis.asyncio.retry.Retry(NoBackoff(), 0)
        return redis.asyncio.Redis.from_url(self.url, retry=once, **self._options(timeout))

    def sync_client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis.from_url(self.url, **self._options(timeout))

    def check(self, timeout: float = 5.0) -> None:
        """Fail now, naming the URL, if the store cannot be reached (or refuses us)."""
        client = self.sync_client(timeout)
        try:
            client.ping()
        except redis.AuthenticationError as e:
            raise ValueError(f"redis_url {self.url}: the store refused the password: {e}") from None
        except (redis.RedisError, OSError) as e:
            raise ValueError(
                f"redis_url {self.url}: cannot reach the replicas' store ({type(e).__name__}: {e})"
            ) from None
        finally:
            client.close()


class OwnRedis:
    """The redis-server `fairway serve` starts for its replicas, on one loopback port for its
    whole run: `poll()` (from the supervisor's loop) restarts it there when it has died,
    waiting longer after each death that comes soon after a start. The replicas see the store
    come back empty and re-publish what they hold (shared_state.py).

    `max_bytes` (None: unbounded) caps its memory. Past it Redis evicts the least recently
    used key among those set to expire (stored responses, idle tenants' budgets), as one
    router's store drops its oldest responses: nothing without an expiry (membership, shared
    counters) is evicted, and a write that would need it is refused, which the replicas see
    as the store not answering."""

    def __init__(
        self, scratch: Path, ready_timeout: float = 10.0, max_bytes: int | None = None
    ) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        exe = shutil.which("redis-server")
        if exe is None:
            raise ValueError(
                "redis_url: not set and no redis-server on PATH (`make test` installs Debian's "
                "redis-server; or point redis_url at one)"
            )
        self.exe, self.scratch, self.ready_timeout = exe, scratch, ready_timeout
        self.max_bytes = max_bytes
        scratch.mkdir(parents=True, exist_ok=True)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.restarts = 0
        self.quick_deaths = 0  # in a row, each within 10 s of its start
        self.due: float | None = None  # when to start it again

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        for _ in range(3):  # a free port can be taken between the check and the bind
            self.port = free_port()
            if self._launch():
                log.info("redis-server on %s (pid %d)", self.url, self.proc.pid)  # type: ignore[union-attr]
                return self.url
        raise RuntimeError(f"redis-server did not start: see {self.scratch / 'redis.log'}")

    def poll(self) -> None:
        """Restart the server if it has died and its back-off is over."""
        now = time.monotonic()
        if self.due is not None:
            if now < self.due:
                return
            self.due = None
            self.restarts += 1
            if self._launch():
                log.warning(
                    "redis-server restarted on %s (pid %d, restart %d)",
                    self.url,
                    self.proc.pid,  # type: ignore[union-attr]
                    self.restarts,
                )
            else:
                self._died(now, "did not start again")
            return
        if self.proc is None or self.proc.poll() is None:
            return
        self._died(now, f"exited with {self.proc.returncode}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 5.0)
            self.proc = None

    def _died(self, now: float, how: str) -> None:
        lived = now - self.started
        self.quick_deaths = self.quick_deaths + 1 if lived < 10 else 1
        first, longest = RESTART_BACKOFF
        delay = min(longest, first * 2 ** (self.quick_deaths - 1))
        self.due = now + delay
        log.error(
            "redis-server on %s %s after %.1f s; restarting it in %.1f s (the replicas route "
            "on alone meanwhile)",
            self.url,
            how,
            lived,
            delay,
        )

    def _launch(self) -> bool:
        argv = [
            self.exe,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--dir",
            str(self.scratch),
            "--logfile",
            str(self.scratch / "redis.log"),
        ]
        if self.max_bytes is not None:
            argv += ["--maxmemory", str(self.max_bytes), "--maxmemory-policy", "volatile-lru"]
        self.proc = subprocess.Popen(
            guarded(argv), stdin=subprocess.DEVNULL, start_new_session=True
        )
        self.started = time.monotonic()
        if _wait_ready(self.url, self.proc, self.ready_timeout):
            return True
        stop_process(self.proc, 5.0)
        return False


@contextlib.contextmanager
def redis_server(scratch: Path, timeout: float = 10.0, max_bytes: int | None = None):
    """A redis-server of our own (not restarted), for tests and benches; yields its URL and
    stops exactly it."""
    server = OwnRedis(scratch, timeout, max_bytes)
    try:
        yield server.start()
    finally:
        server.stop()


def forget(store: Store, prefix: str) -> int:
    """Delete a run's keys from a store that outlives it. Returns how many."""
    client = store.sync_client()
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        return client.delete(*keys) if keys else 0
    finally:
        client.close()


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
