"""What the proxy is told at start: its limits, timeouts and tenants (cluster.yaml's proxy part,
after validation in `router.proxy.fleet.config`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# json.loads holds the GIL while it parses, worker thread or not: about 60 ms per MiB of JSON
# numbers (token ids), 10 ms per MiB of text, measured. 1 MiB keeps the event loop under 100 ms.
MAX_BODY_BYTES = 1024 * 1024
BODY_TIMEOUT = 30.0  # seconds for the whole body to arrive
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3
MAX_CLIENT_ID = 128


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who an API key belongs to (cluster.yaml `tenants`)."""

    client: str
    weight: float = 1.0


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
    admin_token: str | None = None
    policy_name: str = "?"
    health_interval: float = 1.0
    record_dir: str | None = None  # requests.csv (fairway report) and trace.jsonl (replay)
    max_body_bytes: int = MAX_BODY_BYTES  # larger bodies are refused (413) unread
    body_timeout: float = BODY_TIMEOUT  # for the whole body to arrive (else 408)
    client_labels: int = 20  # clients besides the tenants with metric labels of their own
    trust_client_headers: bool = False  # X-Client-Id / X-Client-Weight set by a trusted gateway
    tenants: Mapping[str, Tenant] = field(default_factory=dict)  # API key -> tenant; none: open
