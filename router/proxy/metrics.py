"""The proxy's Prometheus metrics: one definition, used by the router and by the dashboards.

Per-client series are bounded: anyone can name a new client (a header, the `user` field, a new
API key), and every distinct label is a series kept forever and rendered on every scrape. The
tenants, and the clients `client_labels` names, get a label of their own; of the rest, a count
get a pseudonym each, first come; everyone else is counted under "other" (see ClientLabels).
The router's own accounting (the policies' counters) still sees every client: only the exported
label is folded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.runtime.trouble import CAUSES

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


OTHER = "other"
NO_DECODE = "none"  # fairway_handoffs_total's worker when no decode worker was healthy
DEGRADED_CAUSES = ("ray_gcs", "shared_state")  # fairway_degraded's
WATCHERS = ("health", "metrics", "kv_events")  # fairway_own_trouble_total's (monitor.py)


class SyncState(Protocol):
    """What the shared-state series read (router/proxy/service/shared_state.py's SharedState)."""

    in_sync: bool

    def seconds_since_sync(self) -> float: ...


class ClientLabels:
    """Which label a client's series go under:

        a tenant, or a client `named` .............. its name
        a gateway's sub-client "<tenant>/<id>" ..... its tenant's name
        the first `top` other clients .............. `hide(client)`, a pseudonym
        everyone else .............................. "other"

    Labels are given first come and never taken back, so every exported series only grows, as
    counters must, and a page holds at most tenants + named + `top` client series. `named` maps
    a client as the router knows it (a `user` by its pseudonym) to the name it is shown by.
    """

    def __init__(
        self,
        tenants: Iterable[str] = (),
        top: int = 20,
        named: Mapping[str, str] | None = None,
        hide: Callable[[str], str] | None = None,
    ) -> None:
        self.tenants, self.top = frozenset(tenants), top
        self.named = dict(named or {})
        self.hide = hide or (lambda client: client)
        self.given: dict[str, str] = {}  # client -> label, for the `top` first come

    def label(self, client: str) -> str:
        if client in self.tenants:
            return client
        if (name := self.named.get(client)) is not None:
            return name
        tenant, sep, _ = client.partition("/")
        if sep and tenant in self.tenants:
            return tenant
        if (label := self.given.get(client)) is not None:
            return label
        if client == OTHER or len(self.given) >= self.top:
            return OTHER  # a client really named "other" is folded, not confused with it
        label = self.given[client] = self.hide(client)
        return label


class Labelled:
    """A labelled metric whose children are looked up once per distinct label values.

    prometheus_client's `labels()` checks and joins the values and takes a lock on every call,
    a cost the proxy paid several times per request (and once per streamed chunk); here it is a
    dict lookup. Children are never removed from these metrics, so a kept one stays current.
    """

    def __init__(self, metric: Counter | Gauge | Histogram) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], object] = {}

    def labels(self, *values: str):
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class _PerClient(Labelled):
    """A metric with a `client` label whose values ClientLabels bounds. `labels(client)` takes
    the client as the router knows it."""

    def __init__(self, metric: Counter | Histogram, clients: ClientLabels) -> None:
        super().__init__(metric)
        self.clients = clients

    def labels(self, client: str):  # type: ignore[override]
        return super().labels(self.clients.label(client))


class RouterMetrics:
    """Every series the proxy exports, in a registry of its own (tests start many proxies)."""

    def __init__(self, tenants: Iterable[str] = (), client_labels: int = 20) -> None:
        r = self.registry = CollectorRegistry()
        self.clients = ClientLabels(tenants, client_labels)
        self.requests = Labelled(
            Counter(
                "fairway_requests",
                "Requests by routing policy, decision, worker, outcome and API (the client's: "
                "completions, chat, responses, messages; or the endpoint passed through)",
                ["policy", "decision", "worker", "status", "api"],
                registry=r,
            )
        )
        self.retries = Labelled(
            Counter(
                "fairway_retries",
                "Requests re-sent to another worker before the first byte",
                ["worker"],
                registry=r,
            )
        )
        # No adapter label: an adapter's name can name the customer it was tuned for.
        self.adapter_loads = Labelled(
            Counter(
                "fairway_adapter_loads",
                "LoRA adapters the proxy loaded onto a worker, by outcome (loaded, failed)",
                ["worker", "outcome"],
                registry=r,
            )
        )
        self.queue_depth = Labelled(
            Gauge(
                "fairway_router_queue_depth",
                "Requests waiting in the router's per-worker queue",
                ["worker"],
                registry=r,
            )
        )
        self.in_flight = Labelled(
            Gauge(
                "fairway_worker_in_flight",
                "Requests the router has in flight at each worker",
                ["worker"],
                registry=r,
            )
        )
        self.healthy = Labelled(
            Gauge(
                "fairway_worker_healthy",
                "1 while the worker passes health checks",
                ["worker"],
                registry=r,
            )
        )
        # Split fleets: each worker's role, once, so that any per-worker series can be split
        # into the prefill and decode pools by a join (`* on (worker) group_left (role)`).
        self.worker_role = Labelled(
            Gauge(
                "fairway_worker_role",
                "1 for each worker, labelled by its role: mixed, prefill or decode",
                ["worker", "role"],
                registry=r,
            )
        )
        self.handoffs = Labelled(
            Counter(
                "fairway_handoffs",
                "Split requests handed from their prefill worker to a decode worker, by the "
                'decode worker ("none": no decode worker was healthy, and the attempt ended)',
                ["worker"],
                registry=r,
            )
        )
        self.handoffs.labels(NO_DECODE)  # a zero series from the start: rate() needs one
        self.handoff_seconds = Histogram(
            "fairway_handoff_seconds",
            "From a split request's prefill answer to its decode worker's first byte: the KV "
            "transfer and the decode queues (the router's and the server's), as the proxy sees it",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Labelled(
            Counter("fairway_prompt_tokens", "Prompt tokens routed", ["worker"], registry=r)
        )
        self.estimated_hit_tokens = Labelled(
            Counter(
                "fairway_prefix_hit_tokens_estimated",
                "Prompt tokens the router's index expected to be cached at the chosen worker",
                ["worker", "mode"],
                registry=r,
            )
        )
        # Predicted against actual, per answered request that reported its cached tokens: the
        # drift guard's inputs (router/drift.py), and a dashboard panel and alert over them.
        self.hit_tokens_predicted = Labelled(
            Counter(
                "fairway_prefix_hit_tokens_predicted",
                "Prompt tokens the best index kept (precise, else approximate) expected the chosen "
                "worker to reuse, over answered requests whose worker reported its cached tokens",
                ["worker"],
                registry=r,
            )
        )
        self.hit_tokens_actual = Labelled(
            Counter(
                "fairway_prefix_hit_tokens_actual",
                "Prompt tokens the worker reported it reused (usage.prompt_tokens_details)",
                ["worker"],
                registry=r,
            )
        )
        self.index_level = Gauge(
            "fairway_index_level",
            "What routing uses: 2 precise index, 1 approximate index, 0 load only",
            registry=r,
        )
        self.index_level_changes = Labelled(
            Counter(
                "fairway_index_level_changes",
                "Fallbacks and recoveries of the index routing uses, by the level taken",
                ["level"],
                registry=r,
            )
        )
        self.reported_hit_rate = Labelled(
            Gauge(
                "fairway_worker_prefix_hit_rate_reported",
                "Prefix-cache hit rate the worker reports (vllm:prefix_cache_hits / queries)",
                ["worker"],
                registry=r,
            )
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
        self.service = _PerClient(
            Counter(
                "fairway_client_service_tokens",
                "Weighted service per client: input + 2 x output tokens",
                ["client"],
                registry=r,
            ),
            self.clients,
        )
        # Traffic classes (router/classes.py). `class` is a configured class's name, or
        # "other" for a priority no class names (LiveCluster.class_label): never a client's.
        self.refusals = Labelled(
            Counter(
                "fairway_refusals",
                "Requests refused, by class and reason: admission control's queue_time and "
                "unmeetable (503), a tenant budget's rate_limit (429)",
                ["class", "reason"],
                registry=r,
            )
        )
        self.class_requests = Labelled(
            Counter(
                "fairway_class_requests",
                "Answered requests by class and outcome: met (both the class's targets, on the "
                "measured TTFT and TPOT) or missed",
                ["class", "outcome"],
                registry=r,
            )
        )
        self.ttft_predicted = Labelled(
            Counter(
                "fairway_ttft_predicted_seconds",
                "Sum of the router's predicted TTFT over streamed answers that had a prediction",
                ["class"],
                registry=r,
            )
        )
        self.ttft_observed = Labelled(
            Counter(
                "fairway_ttft_observed_seconds",
                "Sum of the measured TTFT over the same answers as fairway_ttft_predicted_seconds",
                ["class"],
                registry=r,
            )
        )
        self.ttft_prediction_error = Labelled(
            Histogram(
                "fairway_ttft_prediction_abs_error_seconds",
                "|predicted - measured| TTFT of streamed answers that had a prediction",
                ["class"],
                buckets=LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.index_blocks = Labelled(
            Gauge(
                "fairway_index_blocks",
                "Blocks the prefix index believes each worker holds",
                ["worker", "mode"],
                registry=r,
            )
        )
        # Tenant budgets (router/proxy/ratelimit.py): `client` as ClientLabels gives it.
        self.rate_limited = Labelled(
            Counter(
                "fairway_rate_limited",
                "Requests refused (429) by their tenant's budget, by the limit that refused "
                "(requests, input_tokens, output_tokens)",
                ["client", "limit"],
                registry=r,
            )
        )
        self.rate_limit_store_errors = Counter(
            "fairway_rate_limit_store_errors",
            "Budget checks and output charges the replicas' store did not answer (decided by "
            "rate_limit_store_failure; charges dropped)",
            registry=r,
        )
        self.degraded = Labelled(
            Gauge(
                "fairway_degraded",
                "1 while the proxy serves degraded (/health says why), by cause: ray_gcs (Ray's "
                "GCS is gone: the proxy stops at the end of ray_gcs_grace), shared_state (a "
                "replica out of sync with its store)",
                ["cause"],
                registry=r,
            )
        )
        self.policy_hook_errors = Labelled(
            Counter(
                "fairway_policy_hook_errors",
                "Policy hooks that raised, by hook (the policy's class and method); each is "
                "logged, and the request it was called for goes on",
                ["hook"],
                registry=r,
            )
        )
        self.own_trouble = Labelled(
            Counter(
                "fairway_own_trouble",
                "Checks of the workers this process could not even make, by watcher (health, "
                "metrics, kv_events) and cause (descriptors, memory, executor, loop_stall); "
                "never counted against the worker",
                ["watcher", "cause"],
                registry=r,
            )
        )
        # Autoscaling (router/proxy/autoscale.py), by pool: the planner's target, and the
        # workers starting, serving and draining towards it (present only with --autoscale).
        self.pool_target_workers = Labelled(
            Gauge(
                "fairway_pool_target_workers",
                "Workers the autoscaling planner wants in each pool",
                ["pool"],
                registry=r,
            )
        )
        self.pool_workers = Labelled(
            Gauge(
                "fairway_pool_workers",
                "Workers in each pool by phase: starting (not yet answering), serving, draining "
                "(routed nothing new, finishing what they have)",
                ["pool", "phase"],
                registry=r,
            )
        )
        # Zero series from the start: the dashboard and rate() need them.
        for cause in DEGRADED_CAUSES:
            self.degraded.labels(cause).set(0)
        for watcher in WATCHERS:
            for cause in CAUSES:
                self.own_trouble.labels(watcher, cause)
        self._shared_state: SharedStateMetrics | None = None
        self.loop_lag = Histogram(
            "fairway_event_loop_lag_seconds",
            "How late the proxy's event loop runs a task due now (sampled every 50 ms)",
            buckets=LAG_BUCKETS,
            registry=r,
        )

    def label_clients(
        self,
        tenants: Iterable[str],
        top: int,
        named: Mapping[str, str] | None = None,
        hide: Callable[[str], str] | None = None,
    ) -> None:
        """Set who gets a label of their own (before serving): see ClientLabels."""
        c = self.clients
        c.tenants, c.top, c.named = frozenset(tenants), top, dict(named or {})
        c.hide = hide or c.hide

    def watch_degraded(self, cause: str, is_degraded: Callable[[], bool]) -> None:
        """fairway_degraded{cause} reads `is_degraded()` at each scrape."""
        self.degraded.labels(cause).set_function(lambda: 1.0 if is_degraded() else 0.0)

    def count_own_trouble(self, watcher: str) -> Callable[[str], None]:
        """What a watcher's TroubleLog calls per check not made: fairway_own_trouble_total."""
        return lambda cause: self.own_trouble.labels(watcher, cause).inc()

    def _per_client(self, metric: Histogram) -> _PerClient:
        return _PerClient(metric, self.clients)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def shared_state(self) -> SharedStateMetrics:
        """The series of a router replica's sync with its store (created on first call: one
        router alone has no store, and exports none of them)."""
        if self._shared_state is None:
            self._shared_state = SharedStateMetrics(self.registry)
        return self._shared_state


class SharedStateMetrics:
    """Whether a router replica shares counters and routing decisions with the others."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge(
            "fairway_shared_state_up",
            "1 while this replica's last sync with the replicas' store succeeded",
            registry=registry,
        )
        self.since_sync = Gauge(
            "fairway_shared_state_seconds_since_sync",
            "Seconds since this replica's last successful sync with the replicas' store",
            registry=registry,
        )
        self.failures = Labelled(
            Counter(
                "fairway_shared_state_sync_failures",
                "Failed syncs with the replicas' store, by kind (own: this replica could not "
                "even try; timeout, connection, loading, auth, response, other)",
                ["kind"],
                registry=registry,
            )
        )
        self.resets = Counter(
            "fairway_shared_state_resets",
            "Times the store came back without its state and this replica re-published its own",
            registry=registry,
        )
        for kind in ("own", "timeout", "connection", "loading", "auth", "response", "other"):
            self.failures.labels(kind)  # zero series from the start: rate() needs them

    def watch(self, state: SyncState) -> None:
        """Read `state` at each scrape."""
        self.up.set_function(lambda: 1.0 if state.in_sync else 0.0)
        self.since_sync.set_function(state.seconds_since_sync)
