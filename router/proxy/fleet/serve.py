"""The proxy's lifecycle: build the router from a validated cluster.yaml and serve the OpenAI API
in front of workers that are already running (`fairway serve` starts them: router/cli/serve.py).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from aiohttp import web

import policies
from router.cost_model import FittedCost, roofline
from router.proxy.app import RUNNER_OPTIONS, create_app
from router.proxy.fleet.config import ClusterConfig
from router.proxy.live import LiveCluster
from router.proxy.prompts import PromptEncoder
from router.proxy.settings import ProxySettings, Tenant

log = logging.getLogger("fairway.serve")


def build_cluster(config: ClusterConfig) -> LiveCluster:
    policy = policies.global_policies.build(config.policy.name, config.policy.params)
    local_name = config.policy.local or getattr(policy, "default_local", "fcfs")
    params = dict(config.policy.local_params)
    policies.local_policies.build(local_name, params)  # fail now, not per worker

    def local_factory():
        return policies.local_policies.build(local_name, params)

    return LiveCluster(
        policy,
        local_factory,
        config.block_size,
        config.window,
        cost=(
            FittedCost.load(config.cost_profile)
            if config.cost_profile
            else roofline(config.cost_preset, config.cost_gpu)
        ),
        precise=config.index_mode == "precise",
    )


def settings_of(config: ClusterConfig) -> ProxySettings:
    t = config.timeouts
    return ProxySettings(
        model_name=config.served_model_name,
        max_model_len=config.max_model_len,
        max_retries=config.max_retries,
        queue_timeout=t.queue,
        connect_timeout=t.connect,
        first_byte_timeout=t.first_byte,
        stream_timeout=t.stream,
        request_timeout=t.request,
        admin_token=config.admin_token,
        policy_name=config.policy.name,
        health_interval=config.health_interval,
        record_dir=config.record_dir,
        max_body_bytes=config.limits.max_body_bytes,
        body_timeout=t.body,
        client_labels=config.limits.client_labels,
        trust_client_headers=config.trust_client_headers,
        tenants={t.api_key: Tenant(t.client, t.weight) for t in config.tenants},
    )


def run_proxy(config: ClusterConfig, cluster: LiveCluster, model_dir: Path) -> int:
    """Serve until SIGTERM or SIGINT, then give in-flight requests SHUTDOWN_GRACE to finish."""
    app = create_app(cluster, PromptEncoder(model_dir, config.block_size), settings_of(config))
    log.info(
        "Fairway proxy on http://%s:%d (policy %s)", config.host, config.port, config.policy.name
    )
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        print=None,
        access_log=None,
        shutdown_timeout=SHUTDOWN_GRACE,
        **RUNNER_OPTIONS,  # type: ignore[arg-type]
    )
    return 0


# In-flight requests get this long to finish when the proxy stops; then streams end with an
# error event. Well inside the minute Ray gives a driver whose GCS is gone.
SHUTDOWN_GRACE = 20.0


def shut_down(reason: str) -> None:
    """The pool's Ray cluster is gone: stop as on SIGTERM (finish in-flight requests, stop the
    servers), before Ray ends this process and leaves them running."""
    log.error("%s: shutting down", reason)
    os.kill(os.getpid(), signal.SIGTERM)
