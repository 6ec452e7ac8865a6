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
)


def dashboard(panels: tuple[Panel, ...] = PANELS) -> dict:
    out = []
    for i, p in enumerate(panels):
        out.append(
            {
                "id": i + 1,
                "type": p.kind,
                "title": p.title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
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
        )
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


# Drift as the router's guard measures it (router/drift.py), over Prometheus's window.
DRIFT = (
    "sum by (worker) (abs(rate(fairway_prefix_hit_tokens_predicted_total[10m]) - "
    "rate(fairway_prefix_hit_tokens_actual_total[10m]))) / sum by (worker) (clamp_min("
    "rate(fairway_prefix_hit_tokens_predicted_total[10m]), 1))"
)


def alert_rules(threshold: float = 0.5, hold: str = "10m", sync_hold: str = "1m") -> dict:
    """Prometheus alerting rules: the index's predictions and the workers' reuse drift apart
    (a tokenizer or chat-template mismatch, lost KV events, a worker restarted with an empty
    cache), routing fell back from the index it was configured with, and a router replica has
    not synced with the replicas' store for `sync_hold`."""
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
