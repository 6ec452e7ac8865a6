"""The proxy's Prometheus metrics: one definition, used by the router and by the dashboards."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class RouterMetrics:
    """Every series the proxy exports, in a registry of its own (tests start many proxies)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
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
        self.reported_hit_rate = Gauge(
            "fairway_worker_prefix_hit_rate_reported",
            "Prefix-cache hit rate the worker reports (vllm:prefix_cache_hits / queries)",
            ["worker"],
            registry=r,
        )
        self.ttft = Histogram(
            "fairway_ttft_seconds",
            "Time to first byte of the answer, by client",
            ["client"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "fairway_inter_token_seconds",
            "Time between streamed chunks, by client",
            ["client"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "fairway_e2e_seconds",
            "Request latency, by client",
            ["client"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.service = Counter(
            "fairway_client_service_tokens",
            "Weighted service per client: input + 2 x output tokens",
            ["client"],
            registry=r,
        )
        self.index_blocks = Gauge(
            "fairway_index_blocks",
            "Blocks the prefix index believes each worker holds",
            ["worker", "mode"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
