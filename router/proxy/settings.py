"""What the proxy is told at start: its limits, timeouts and tenants (cluster.yaml's proxy part,
after validation in `router.proxy.service.config`)."""

from __future__ import annotations

import functools
import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from router.budgets import RateLimit

# json.loads holds the GIL while it parses, worker thread or not: about 60 ms per MiB of JSON
# numbers (token ids), 10 ms per MiB of text, measured. 1 MiB keeps the event loop under 100 ms.
MAX_BODY_BYTES = 1024 * 1024
BODY_TIMEOUT = 30.0  # seconds for the whole body to arrive
HEADER_TIMEOUT = 10.0  # seconds for a request's head, from its first byte (HAProxy's advice)
# In-flight requests get this long to finish when the proxy stops; then the client gets a 503
# (a stream: an error event). Well inside the minute Ray gives a driver whose GCS is gone.
SHUTDOWN_GRACE = 20.0
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3
MAX_CLIENT_ID = 128
# Request priorities (vLLM's convention: lower is served first, default 0). Each value is a
# band in every worker's queue, so a client-chosen one is bounded.
MIN_PRIORITY, MAX_PRIORITY = -100, 100
# Responses the proxy relayed, kept to answer GET /v1/responses/{id} and to continue them
# (router/proxy/conversations.py): this long, and in one router's memory, this much.
RESPONSES_RETENTION = 3600.0
RESPONSES_MAX_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who an API key belongs to (cluster.yaml `tenants`), and its budget (None: unlimited)."""

    client: str
    weight: float = 1.0
    rate_limit: RateLimit | None = None
    priority: int = 0  # its requests' band; a trusted gateway may only lower it (a larger value)


def key_digest(key: str) -> bytes:
    """What the proxy keeps of an API key, and looks a presented key up by: its SHA-256. A dict
    lookup compares digests, so how long a wrong key matched says nothing about a real one."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def new_salt() -> bytes:
    return secrets.token_bytes(16)


def keyed(tenants: Mapping[str, Tenant]) -> dict[bytes, Tenant]:
    """`ProxySettings.tenants` from {API key: tenant}."""
    return {key_digest(key): tenant for key, tenant in tenants.items()}


@dataclass(frozen=True)
class ProxySettings:
    model_name: str
    max_model_len: int = 4096
    default_max_tokens: int = 16
    max_retries: int = 2
    queue_timeout: float = 60.0  # waiting in the router's dispatch queue
    connect_timeout: float = 5.0
    first_byte_timeout: float = 60.0  # until the client's first byte: retried elsewhere after
    stream_timeout: float = 30.0  # between two chunks of a stream, once it has begun
    request_timeout: float = 600.0
    admin_token: str | None = field(default=None, repr=False)
    admin_port: int | None = None  # the admin listener's (/metrics, /admin/*); None: none
    policy_name: str = "?"
    health_interval: float = 1.0
    record_dir: str | None = None  # requests.csv (fairway report) and trace.jsonl (replay)
    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies are refused (413) unread
    body_timeout: float = BODY_TIMEOUT  # for the whole body to arrive (else 408)
    header_timeout: float = HEADER_TIMEOUT  # for a request's head (else 408, closed)
    max_connections: int | None = None  # per listener (else 503); None: connections.py decides
    shutdown_grace: float = SHUTDOWN_GRACE  # for requests in flight when the proxy stops
    # Metric series besides the tenants': these clients by name, or that many, first come.
    client_labels: int | tuple[str, ...] = 20
    trust_client_headers: bool = False  # X-Client-Id / -Weight / X-Priority set by a gateway
    # key_digest(API key) -> tenant (`keyed`); none: generation is open to anyone
    tenants: Mapping[bytes, Tenant] = field(default_factory=dict, repr=False)
    # Keys and users become pseudonyms salted with this; replicas of one serve share it.
    client_salt: bytes = field(default_factory=new_salt, repr=False)
    # The event loop: uvloop (libuv) where installed, else asyncio's own (event_loop.py).
    event_loop: str = "uvloop"
    # Tenant budgets when the replicas' store does not answer: "open" admits, "closed" is a
    # 503 (router/proxy/service/budget_store.py says why open is the default).
    rate_limit_store_failure: str = "open"
    # Stored responses (conversations.py): seconds each can be read or continued, and the
    # bytes one router keeps in memory (replicas keep theirs in their store).
    responses_retention: float = RESPONSES_RETENTION
    responses_max_bytes: int = RESPONSES_MAX_BYTES

    @property
    def upstream_timeout(self) -> aiohttp.ClientTimeout:
        # No sock_read: the first byte has its own deadline (Forward._send), a stream's chunks
        # theirs. Built once: ClientTimeout is a frozen attrs class, costly to make per request.
        return _client_timeout(self.request_timeout, self.connect_timeout)


@functools.lru_cache(maxsize=8)
def _client_timeout(total: float, connect: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total, sock_connect=connect)
