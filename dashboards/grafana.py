"""Grafana dashboard and Prometheus scrape config for the live proxy, generated from one list.

`fairway dashboards --out DIR` writes `fairway-dashboard.json` (import it as is) and
`prometheus.yml`; the committed copies in this folder are checked against this generator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"


def _quantiles(metric: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        (
            f"histogram_quantile({q}, sum by (client, le) (rate({metric}_bucket[1m])))",
            f"p{int(q * 100)} {{{{client}}}}",
        )
        for q in (0.5, 0.99)
    )


# Joins a per-worker series to its worker's role, per proxy (each replica exports its own).
BY_ROLE = "* on (instance, worker) group_left (role) fairway_worker_role"

PANELS: tuple[Panel, ...] = (
    Panel(
        "Request rate by outcome",
        (("sum by (status) (rate(fairway_requests_total[1m]))", "{{status}}"),),
        "reqps",
    ),
    Panel(
        "Errors and retries",
        (
            ('sum(rate(fairway_requests_total{status!="ok"}[1m]))', "errors"),
            ("sum(rate(fairway_retries_total[1m]))", "retries before first byte"),
        ),
        "reqps",
    ),
    Panel(
        "Routing decisions",
        (("sum by (decision) (rate(fairway_requests_total[1m]))", "{{decision}}"),),
        "reqps",
    ),
    Panel(
        "Request rate by API",
        (("sum by (api) (rate(fairway_requests_total[1m]))", "{{api}}"),),
        "reqps",
    ),
    Panel("TTFT by client", _quantiles("fairway_ttft_seconds"), "s"),
    Panel("End-to-end latency by client", _quantiles("fairway_e2e_seconds"), "s"),
    Panel("Inter-token latency by client", _quantiles("fairway_inter_token_seconds"), "s"),
    Panel("Router queue depth per worker", (("fairway_router_queue_depth", "worker {{worker}}"),)),
    Panel("In flight per worker", (("fairway_worker_in_flight", "worker {{worker}}"),)),
    Panel(
        "Prefix hit rate: router estimate vs vLLM-reported",
        (
            (
                "sum by (worker) (rate("
                'fairway_prefix_hit_tokens_estimated_total{mode="approximate"}[1m]))'
                " / sum by (worker) (rate(fairway_prompt_tokens_total[1m]))",
                "estimated, worker {{worker}}",
            ),
            ("fairway_worker_prefix_hit_rate_reported", "reported, worker {{worker}}"),
            (
                "sum by (instance) (rate(vllm:prefix_cache_hits_total[1m])) / "
                "sum by (instance) (rate(vllm:prefix_cache_queries_total[1m]))",
                "vLLM {{instance}}",
            ),
        ),
        "percentunit",
    ),
    Panel(
        "Prefix hit tokens: predicted by the index vs reused by the worker",
        (
            (
                "sum by (worker) (rate(fairway_prefix_hit_tokens_predicted_total[1m]))",
                "predicted, worker {{worker}}",
            ),
            (
                "sum by (worker) (rate(fairway_prefix_hit_tokens_actual_total[1m]))",
                "actual, worker {{worker}}",
            ),
            ("fairway_index_level", "routing by (2 precise, 1 approximate, 0 load)"),
        ),
        "short",
    ),
    Panel(
        "Service share per client (input + 2 x output tokens)",
        (
            (
                "sum by (client) (rate(fairway_client_service_tokens_total[1m]))"
                " / ignoring(client) group_left"
                " sum(rate(fairway_client_service_tokens_total[1m]))",
                "{{client}}",
            ),
        ),
        "percentunit",
    ),
    Panel("Worker health", (("fairway_worker_healthy", "worker {{worker}}"),), "short", "stat"),
    Panel(
        "Index size (blocks) per worker", (("fairway_index_blocks", "{{mode}} worker {{worker}}"),)
    ),
    # What the proxy relies on, and the checks of it the proxy could not even make for want of
    # its own resources (router/runtime/trouble.py): never counted against the dependency.
    Panel(
        "Degraded, by cause (ray_gcs: the proxy stops at the end of ray_gcs_grace)",
        (("fairway_degraded", "{{cause}} {{instance}}"),),
    ),
    Panel(
        "Checks of the workers the proxy could not make (its own trouble)",
        (
            (
                "sum by (watcher, cause) (rate(fairway_own_trouble_total[1m]))",
                "{{watcher}} {{cause}}",
            ),
        ),
        "ops",
    ),
    # Split prefill and decode: the pools apart. Each worker's role is exported once
    # (fairway_worker_role) and joined onto its series; a mixed fleet shows one pool, "mixed".
    Panel(
        "Pools by role: requests in flight and queued in the router",
        (
            (f"sum by (role) (fairway_worker_in_flight {BY_ROLE})", "in flight, {{role}}"),
            (f"sum by (role) (fairway_router_queue_depth {BY_ROLE})", "queued, {{role}}"),
        ),
    ),
    Panel(
        "Retries before the first byte, by the failed worker's role",
        ((f"sum by (role) (rate(fairway_retries_total[1m]) {BY_ROLE})", "{{role}}"),),
        "reqps",
    ),
    Panel(
        "Handoffs from prefill to decode workers, by decode worker",
        (("sum by (worker) (rate(fairway_handoffs_total[1m]))", "decode worker {{worker}}"),),
        "reqps",
    ),
    Panel(
        "Prefill answer to the decode worker's first byte (KV transfer + decode queue; streams)",
        tuple(
            (
                f"histogram_quantile({q}, sum by (le) (rate(fairway_handoff_seconds_bucket[1m])))",
                f"p{int(q * 100)}",
            )
            for q in (0.5, 0.99)
        ),
        "s",
    ),
)


def attainment(window: str, match: str = "") -> str:
    """Per class, the share of answered requests that met the class's targets over `window`
    (`fairway_class_requests_total{class, outcome}`, outcome met or missed); `match` narrows
    the classes, e.g. `class="interactive"`."""
    met = "{" + ", ".join(m for m in ('outcome="met"', match) if m) + "}"
    every = "{" + match + "}" if match else ""
    return (
        f"sum by (class) (rate(fairway_class_requests_total{met}[{window}])) / "
        f"sum by (class) (rate(fairway_class_requests_total{every}[{window}]))"
    )


# Traffic classes and tenant budgets: their series exist once the proxy is configured with
# classes or budgets, so they have a row of their own (and PANELS stays what every proxy shows).
CLASS_PANELS: tuple[Panel, ...] = (
    Panel(
        "SLO attainment by class (met / answered, 5m)",
        ((attainment("5m"), "{{class}}"),),
        "percentunit",
    ),
    Panel(
        "Goodput by class: requests that met their targets, and those that missed",
        (
            (
                'sum by (class) (rate(fairway_class_requests_total{outcome="met"}[1m]))',
                "met {{class}}",
            ),
            (
                'sum by (class) (rate(fairway_class_requests_total{outcome="missed"}[1m]))',
                "missed {{class}}",
            ),
        ),
        "reqps",
    ),
    Panel(
        "Refusals by class and reason (queue_time, unmeetable, rate_limit)",
        (("sum by (class, reason) (rate(fairway_refusals_total[1m]))", "{{class}} {{reason}}"),),
        "reqps",
    ),
    Panel(
        "TTFT predicted / observed by class (1: exact; above: predicted too slow)",
        (
            (
                "sum by (class) (rate(fairway_ttft_predicted_seconds_total[5m])) / "
                "sum by (class) (rate(fairway_ttft_observed_seconds_total[5m]))",
                "{{class}}",
            ),
        ),
    ),
    Panel(
        "Rate-limited requests (429) by client and limit",
        (
            (
                "sum by (client, limit) (rate(fairway_rate_limited_total[1m]))",
                "{{client}} {{limit}}",
            ),
        ),
        "reqps",
    ),
)
# Autoscaling (`fairway serve --autoscale`): the planner's target per pool against the workers
# serving, and those on their way in or out.
AUTOSCALE_PANELS: tuple[Panel, ...] = (
    Panel(
        "Workers per pool: the planner's target and those serving",
        (
            ("max by (pool) (fairway_pool_target_workers)", "target {{pool}}"),
            ('max by (pool) (fairway_pool_workers{phase="serving"})', "serving {{pool}}"),
        ),
    ),
    Panel(
        "Workers starting (not yet answering) and draining (finishing what they have)",
        (
            (
                'max by (pool, phase) (fairway_pool_workers{phase=~"starting|draining"})',
                "{{phase}} {{pool}}",
            ),
        ),
    ),
)
ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Traffic classes and budgets", CLASS_PANELS),
    ("Autoscaling", AUTOSCALE_PANELS),
)


def _panel(panel_id: int, p: Panel, x: int, y: int) -> dict:
    return {
        "id": panel_id,
        "type": p.kind,
        "title": p.title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + j),
                "expr": expr,
                "legendFormat": legend,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
            }
            for j, (expr, legend) in enumerate(p.exprs)
        ],
    }


def dashboard(
    panels: tuple[Panel, ...] = PANELS, rows: tuple[tuple[str, tuple[Panel, ...]], ...] = ROWS
) -> dict:
    """`panels` two abreast, then each row: a titled row header and its panels."""
    out: list[dict] = []
    y = 0
    for title, group in ((None, panels), *rows):
        if title is not None:
            header = {"h": 1, "w": 24, "x": 0, "y": y}
            out.append({"id": len(out) + 1, "type": "row", "title": title, "collapsed": False,
                        "gridPos": header, "panels": []})  # fmt: skip
            y += 1
        for i, p in enumerate(group):
            out.append(_panel(len(out) + 1, p, 12 * (i % 2), y + 8 * (i // 2)))
        y += 8 * -(-len(group) // 2)
    return {
        "title": "Fairway router",
        "uid": "fairway-router",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "tags": ["fairway", "llm-serving"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                    "current": {},
                }
            ]
        },
        "panels": out,
    }


def prometheus_config(
    proxy: str | tuple[str, ...] = "127.0.0.1:8001",  # the admin listener(s): /metrics
    workers: tuple[str, ...] = ("127.0.0.1:8100", "127.0.0.1:8101"),
    interval: str = "5s",
) -> dict:
    """Scrape the proxy (each replica's own port, with `--routers N`) and the workers."""
    proxies = [proxy] if isinstance(proxy, str) else list(proxy)
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": ["fairway-alerts.yml"],
        "scrape_configs": [
            {"job_name": "fairway", "static_configs": [{"targets": proxies}]},
            {"job_name": "vllm", "static_configs": [{"targets": list(workers)}]},
        ],
    }


INTERACTIVE = 'class="interactive"'  # the class whose attainment is alerted on

# Drift as the router's guard measures it (router/drift.py), over Prometheus's window.
DRIFT = (
    "sum by (worker) (abs(rate(fairway_prefix_hit_tokens_predicted_total[10m]) - "
    "rate(fairway_prefix_hit_tokens_actual_total[10m]))) / sum by (worker) (clamp_min("
    "rate(fairway_prefix_hit_tokens_predicted_total[10m]), 1))"
)


# The planner wants more workers than serve: the gap a start-up closes is expected, one that
# outlasts any start-up (vLLM loads a large model in minutes) is not.
BEHIND = (
    "max by (instance, pool) (fairway_pool_target_workers) > "
    'max by (instance, pool) (fairway_pool_workers{phase="serving"})'
)


def alert_rules(
    threshold: float = 0.5,
    hold: str = "10m",
    sync_hold: str = "1m",
    attainment_target: float = 0.99,
    attainment_hold: str = "5m",
    scale_hold: str = "15m",
) -> dict:
    """Prometheus alerting rules: the index's predictions and the workers' reuse drift apart
    (a tokenizer or chat-template mismatch, lost KV events, a worker restarted with an empty
    cache), routing fell back from the index it was configured with, a router replica has
    not synced with the replicas' store for `sync_hold`, the interactive class's answered
    requests met their targets less than `attainment_target` of the time over 5 minutes,
    Ray's GCS is gone (the proxy serves on through its grace, then stops), an autoscaled
    pool has served fewer workers than its target for `scale_hold`, and a policy hook raised."""
    return {
        "groups": [
            {
                "name": "fairway",
                "rules": [
                    {
                        "alert": "FairwayPrefixPredictionDrift",
                        "expr": f"{DRIFT} > {threshold}",
                        "for": hold,
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": "Prefix-cache predictions drift from the worker's reuse",
                            "description": "Worker {{ $labels.worker }}: the router's index "
                            "predicts hits the worker does not report (or the reverse) for "
                            f"{hold}. Check tokenizer and chat template, KV events, restarts.",
                        },
                    },
                    {
                        "alert": "FairwayRoutingFellBack",
                        "expr": "fairway_index_level < 2 and "
                        "changes(fairway_index_level_changes_total[1h]) > 0",
                        "for": "1m",
                        "labels": {"severity": "info"},
                        "annotations": {
                            "summary": "Routing no longer uses the index it was configured "
                            "with (fairway_index_level: 2 precise, 1 approximate, 0 load)"
                        },
                    },
                    {
                        "alert": "FairwayReplicaOutOfSync",
                        "expr": "fairway_shared_state_up == 0",
                        "for": sync_hold,
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": "A router replica cannot sync with the replicas' store",
                            "description": "{{ $labels.instance }} has not synced for "
                            f"{sync_hold} or more: its fairness counters and routing "
                            "decisions are its own until the store answers (check Redis).",
                        },
                    },
                    {
                        "alert": "FairwayInteractiveAttainmentLow",
                        "expr": f"{attainment('5m', INTERACTIVE)} < {attainment_target}",
                        "for": attainment_hold,
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": "The interactive class misses its latency targets",
                            "description": "Fewer than "
                            f"{attainment_target:.0%} of interactive requests answered over "
                            "5 minutes met their TTFT and TPOT targets. Check the refusals "
                            "and queue depth: batch load past capacity, or a worker down.",
                        },
                    },
                    {
                        "alert": "FairwayRayGcsLost",
                        "expr": 'fairway_degraded{cause="ray_gcs"} == 1',
                        "for": "0s",
                        "labels": {"severity": "critical"},
                        "annotations": {
                            "summary": "Ray's GCS is gone: the proxy stops when its grace ends",
                            "description": "{{ $labels.instance }} lost its workers' Ray GCS. "
                            "It serves on the workers that still answer, degraded, and stops "
                            "itself when ray_gcs_grace is over. Bring the Ray head back within "
                            "the grace (the stop is called off), or restart the proxy after.",
                        },
                    },
                    {
                        "alert": "FairwayAutoscaleBehind",
                        "expr": BEHIND,
                        "for": scale_hold,
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": "An autoscaled pool serves fewer workers than its target",
                            "description": "{{ $labels.instance }}, pool {{ $labels.pool }}: "
                            f"the planner's target has stayed above the workers serving for "
                            f"{scale_hold}. Workers fail to start (see the proxy's log and the "
                            "workers' logs) or the cluster has no room for them (Ray's "
                            "resources, GPUs).",
                        },
                    },
                    {
                        "alert": "FairwayPolicyHookErrors",
                        "expr": "sum by (instance, hook) "
                        "(increase(fairway_policy_hook_errors_total[5m])) > 0",
                        "for": "0s",
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": "A routing policy's hook raised",
                            "description": "{{ $labels.instance }}: {{ $labels.hook }} raised "
                            "in the last 5 minutes. Requests go on, but the policy's state "
                            "(its fairness counters, what it believes is queued) may be off "
                            "from there: the proxy's log has each traceback.",
                        },
                    },
                ],
            }
        ]
    }


def write(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    board = out / "fairway-dashboard.json"
    board.write_text(json.dumps(dashboard(), indent=2) + "\n")
    prom = out / "prometheus.yml"
    prom.write_text(yaml.safe_dump(prometheus_config(), sort_keys=False))
    rules = out / "fairway-alerts.yml"
    rules.write_text(yaml.safe_dump(alert_rules(), sort_keys=False))
    return [board, prom, rules]
