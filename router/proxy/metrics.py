"""The proxy's Prometheus metrics: one definition, used by the router and by the dashboards.

Per-client series are bounded: anyone can name a new client (a header, the `user` field, a new
API key), and every distinct label is a series kept forever and rendered on every scrape. Only
the configured tenants and the top clients by service get a label of their own; the rest are
counted under "other". The router's own accounting (the policies' counters) still sees every
client by its real id: only the exported label is folded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


OTHER = "other"


class ClientLabels:
    """Which clients have a metric label of their own.

    Tenants always do. Up to `top` others hold the remaining labels; a client without one takes
    the place of the labelled client with the least service once it has more than twice that
    (the factor keeps two clients near the boundary from trading places on every request).
    A client that loses its label has its series removed (`on_drop`) and is counted under
    "other" from then on, so every exported series only ever grows, as counters must.
    """

    def __init__(self, tenants: Iterable[str] = (), top: int = 20) -> None:
        self.tenants, self.top = frozenset(tenants), top
        self.service: dict[str, float] = {}  # weighted tokens per client: the ranking
        self.labelled: set[str] = set()
        self.on_drop: Callable[[str], None] = lambda client: None

    def charge(self, client: str, amount: float) -> None:
        self.service[client] = self.service.get(client, 0.0) + amount

    def label(self, client: str) -> str:
        if client in self.labelled or client in self.tenants:
            return client
        if client == OTHER:  # a client really named "other" is folded, not confused with it
            return OTHER
        if len(self.labelled) < self.top:
            self.labelled.add(client)
            return client
        if not self.labelled:
            return OTHER
        weakest = min(self.labelled, key=lambda c: self.service.get(c, 0.0))
        if self.service.get(client, 0.0) > 2 * self.service.get(weakest, 0.0):
            self.labelled.remove(weakest)
            self.on_drop(weakest)
            self.labelled.add(client)
            return client
        return OTHER


class _PerClient:
    """A metric with a `client` label whose values ClientLabels bounds. `labels(client)` takes
    the real client id, as callers know it."""

    def __init__(self, metric: Counter | Histogram, clients: ClientLabels) -> None:
        self.metric, self.clients = metric, clients

    def labels(self, client: str):
        return self.metric.labels(self.clients.label(client))

    def remove(self, label: str) -> None:
        self.metric.remove(label)


class _ServiceCounter(_PerClient):
    """The service counter also feeds the ranking, with the exact amount per real client."""

    def labels(self, client: str) -> _Charge:
        return _Charge(self.metric.labels(self.clients.label(client)), self.clients, client)


class _Charge:
    __slots__ = ("child", "clients", "client")

    def __init__(self, child, clients: ClientLabels, client: str) -> None:
        self.child, self.clients, self.client = child, clients, client

    def inc(self, amount: float = 1.0) -> None:
        self.clients.charge(self.client, amount)
        self.child.inc(amount)


class RouterMetrics:
    """Every series the proxy exports, in a registry of its own (tests start many proxies)."""

    def __init__(self, tenants: Iterable[str] = (), client_labels: int = 20) -> None:
        r = self.registry = CollectorRegistry()
        self.clients = ClientLabels(tenants, client_labels)
        self.requests = Counter(
            "fairway_requests",
            "Requests by routing policy, decision, worker and outcome",
            ["policy", "decision", "worker", "status"],
            registry=r,
        )
        self.retries = Counter(
            "fairway_retries",
            "Requests re-sent to another worker before the first byte",
            ["worker"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "fairway_router_queue_depth",
            "Requests waiting in the router's per-worker queue",
            ["worker"],
            registry=r,
        )
        self.in_flight = Gauge(
            "fairway_worker_in_flight",
            "Requests the router has in flight at each worker",
            ["worker"],
            registry=r,
        )
        self.healthy = Gauge(
            "fairway_worker_healthy",
            "1 while the worker passes health checks",
            ["worker"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "fairway_prompt_tokens", "Prompt tokens routed", ["worker"], registry=r
        )
        self.estimated_hit_tokens = Counter(
            "fairway_prefix_hit_tokens_estimated",
            "Prompt tokens the router's index expected to be cached at the chosen worker",
            ["worker", "mode"],
            registry=r,
        )
        # Predicted against actual, per answered request that reported its cached tokens: the
        # drift guard's inputs (router/drift.py), and a dashboard panel and alert over them.
        self.hit_tokens_predicted = Counter(
            "fairway_prefix_hit_tokens_predicted",
            "Prompt tokens the best index kept (precise, else approximate) expected the chosen "
            "worker to reuse, over answered requests whose worker reported its cached tokens",
            ["worker"],
            registry=r,
        )
        self.hit_tokens_actual = Counter(
            "fairway_prefix_hit_tokens_actual",
            "Prompt tokens the worker reported it reused (usage.prompt_tokens_details)",
            ["worker"],
            registry=r,
        )
        self.index_level = Gauge(
            "fairway_index_level",
            "What routing uses: 2 precise index, 1 approximate index, 0 load only",
            registry=r,
        )
        self.index_level_changes = Counter(
            "fairway_index_level_changes",
            "Fallbacks and recoveries of the index routing uses, by the level taken",
            ["level"],
            registry=r,
        )
        self.reported_hit_rate = Gauge(
            "fairway_worker_prefix_hit_rate_reported",
            "Prefix-cache hit rate the worker reports (vllm:prefix_cache_hits / queries)",
            ["worker"],
            registry=r,
        )
        self.ttft = self._per_client(
            Histogram(
                "fairway_ttft_seconds",
                "Time to first byte of the answer, by client",
                ["client"],
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.itl = self._per_client(
            Histogram(
                "fairway_inter_token_seconds",
                "Time between streamed chunks, by client",
                ["client"],
                buckets=ITL_BUCKETS,
                registry=r,
            )
        )
        self.e2e = self._per_client(
            Histogram(
                "fairway_e2e_seconds",
                "Request latency, by client",
                ["client"],
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.service = _ServiceCounter(
            Counter(
                "fairway_client_service_tokens",
                "Weighted service per client: input + 2 x output tokens",
                ["client"],
                registry=r,
            ),
            self.clients,
        )
        self.clients.on_drop = self._drop_client
        self.index_blocks = Gauge(
            "fairway_index_blocks",
            "Blocks the prefix index believes each worker holds",
            ["worker", "mode"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "fairway_event_loop_lag_seconds",
            "How late the proxy's event loop runs a task due now (sampled every 50 ms)",
            buckets=LAG_BUCKETS,
            registry=r,
        )

    def label_clients(self, tenants: Iterable[str], top: int) -> None:
        """Give the configured tenants labels of their own and `top` more (before serving)."""
        self.clients.tenants, self.clients.top = frozenset(tenants), top

    def _per_client(self, metric: Histogram) -> _PerClient:
        return _PerClient(metric, self.clients)

    def _drop_client(self, client: str) -> None:
        for metric in (self.ttft, self.itl, self.e2e, self.service):
            metric.remove(client)

    def render(self) -> bytes:
        return generate_latest(self.registry)
