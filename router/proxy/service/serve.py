"""The proxy's lifecycle: build the router from a validated cluster.yaml and serve the OpenAI API
in front of workers that are already running (`fairway serve` starts them: router/cli/serve.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import SecretStr

import policies
from router.budgets import RateLimit
from router.config import DEFAULT_STEP_TOKENS, RouterConfig, slowest_adapter_load
from router.cost_model import FittedCost, roofline
from router.proxy import connections
from router.proxy.app import RUNNER_OPTIONS, create_app
from router.proxy.autoscale import LiveScaler
from router.proxy.catalog import Catalog
from router.proxy.driver import LiveCluster
from router.proxy.exposure import admin_socket
from router.proxy.health import HEALTH_NOTES
from router.proxy.prompts import PromptEncoder
from router.proxy.service.config import ClusterConfig, FleetWorker, TenantConfig
from router.proxy.service.gcs_grace import GcsGrace
from router.proxy.settings import SHUTDOWN_GRACE, ProxySettings, Tenant, keyed, new_salt

log = logging.getLogger("fairway.serve")
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's --max-num-seqs when it is not given


def build_cluster(config: ClusterConfig) -> LiveCluster:
    policy = policies.global_policies.build(config.policy.name, config.policy.params)
    local_name = config.policy.local or policy.default_local
    params = dict(config.policy.local_params)
    policies.local_policies.build(local_name, params)  # fail now, not per worker

    def local_factory():
        return policies.local_policies.build(local_name, params)

    return LiveCluster(
        policy,
        local_factory,
        router_config_of(config),
        # Workers added later (admin API, a replica's store) join the one-model fleet.
        priority_scheduling=config.groups[0].workers.scheduling_policy == "priority",
    )


def router_config_of(config: ClusterConfig) -> RouterConfig:
    """The router core's settings from cluster.yaml (the proxy's own are `settings_of`)."""
    return RouterConfig(
        block_size=config.block_size,
        window=config.window,
        cost=(
            FittedCost.load(config.cost_profile)
            if config.cost_profile
            else roofline(config.cost_preset, config.cost_gpu)
        ),
        index=config.index_mode,
        adapter_load_time=slowest_adapter_load(g.adapter_load_time for g in config.groups),
        # Bands in every queue as soon as a request can carry a priority other than 0.
        classes=config.class_table if config.uses_priorities else None,
        latency_routing=config.latency_routing,
        admission=config.admission_control,
        step_tokens=step_tokens_of(config),
    )


def step_tokens_of(config: ClusterConfig) -> int:
    """The workers' step budget, as their vLLM arguments set it (the smallest of any group's:
    a prediction that errs, errs late), else vLLM's default."""
    flag = "--max-num-batched-tokens"
    budgets = [n for g in config.groups for n in vllm_ints(g.workers.vllm_args, flag)]
    return min(budgets, default=DEFAULT_STEP_TOKENS)


def max_num_seqs_of(config: ClusterConfig) -> int:
    """The first group's batch limit, as its vLLM arguments set it, else vLLM's default."""
    seqs = vllm_ints(config.groups[0].workers.vllm_args, "--max-num-seqs")
    return min(seqs, default=DEFAULT_MAX_NUM_SEQS)


def vllm_ints(args: list[str], flag: str) -> list[int]:
    """Each whole number `flag` is given in vLLM's arguments (`--flag N` or `--flag=N`)."""
    found = []
    for i, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name == flag:
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            if value.isdigit():
                found.append(int(value))
    return found


def catalog_of(config: ClusterConfig, model_dirs: dict[str, Path]) -> Catalog:
    """What the proxy serves: each group's model (its tokenizer from `model_dirs[name]`) and
    adapters."""
    catalog = Catalog()
    several = len(config.groups) > 1
    for g in config.groups:
        encoder = PromptEncoder(model_dirs[g.served_model_name], config.block_size)
        adapters = {a.name: a.path for a in g.adapters}
        catalog.add_group(g.served_model_name, encoder, g.max_model_len, adapters, several)
    return catalog


def add_workers(cluster: LiveCluster, workers: list[FleetWorker]) -> None:
    for w in workers:
        cluster.add_worker(
            w.url,
            w.kv_events,
            model=w.model,
            adapter_slots=w.adapter_slots,
            priority_scheduling=w.priority_scheduling,
            role=w.role,
            kv_shape=w.kv_shape,
        )


def settings_of(config: ClusterConfig) -> ProxySettings:
    t = config.timeouts
    labels, salt = config.limits.client_labels, _clear(config.client_salt)
    return ProxySettings(
        model_name=config.groups[0].served_model_name,
        max_model_len=config.groups[0].max_model_len,
        max_retries=config.max_retries,
        queue_timeout=t.queue,
        connect_timeout=t.connect,
        first_byte_timeout=t.first_byte,
        stream_timeout=t.stream,
        request_timeout=t.request,
        admin_token=_clear(config.admin_token),
        admin_port=config.admin_ports[0],
        policy_name=config.policy.name,
        health_interval=config.health_interval,
        record_dir=config.record_dir,
        max_body_bytes=config.limits.max_body_bytes,
        body_timeout=t.body,
        header_timeout=t.header,
        max_connections=config.limits.max_connections,
        client_labels=labels if isinstance(labels, int) else tuple(labels),
        trust_client_headers=config.trust_client_headers,
        tenants=keyed({t.api_key.get_secret_value(): _tenant(t) for t in config.tenants}),
        client_salt=salt.encode() if salt else new_salt(),  # `fairway serve` always has one
        event_loop=config.event_loop,
        rate_limit_store_failure=config.rate_limit_store_failure,
        responses_retention=config.responses.retention,
        responses_max_bytes=config.responses.max_bytes,
    )


def _tenant(t: TenantConfig) -> Tenant:
    limit = t.rate_limit
    budget = None if limit is None else RateLimit(**limit.model_dump())
    return Tenant(t.client, t.weight, budget, t.priority)


def _clear(secret: SecretStr | None) -> str | None:
    return secret.get_secret_value() if secret is not None else None


def run_proxy(
    config: ClusterConfig,
    cluster: LiveCluster,
    model_dirs: dict[str, Path],
    gcs: GcsGrace | None = None,
    autoscaler: LiveScaler | None = None,
) -> int:
    """Serve until SIGTERM or SIGINT, then give in-flight requests SHUTDOWN_GRACE to finish.
    `gcs`: the grace a lost Ray GCS gets, shown on /health and /metrics while it runs;
    `autoscaler`: sizes the fleet while the proxy serves (router/proxy/autoscale.py)."""
    settings = settings_of(config)
    app = create_app(cluster, catalog_of(config, model_dirs), settings)
    if autoscaler is not None:
        app.cleanup_ctx.append(autoscaler.running)
    if gcs is not None:
        app[HEALTH_NOTES].append(gcs.health_note)
        cluster.metrics.watch_degraded("ray_gcs", gcs.is_degraded)
        app.cleanup_ctx.append(gcs.watching(cluster))
    admin = admin_socket(config.admin_host, config.admin_ports[0])  # /metrics, /admin/*
    log.info(
        "Fairway proxy on http://%s:%d, admin on http://%s:%d (policy %s)",
        config.host,
        config.port,
        config.admin_host,
        config.admin_ports[0],
        config.policy.name,
    )
    connections.run_app(
        app,
        settings,
        host=config.host,
        port=config.port,
        sock=admin,
        shutdown_timeout=SHUTDOWN_GRACE,
        **RUNNER_OPTIONS,
    )
    return 0
