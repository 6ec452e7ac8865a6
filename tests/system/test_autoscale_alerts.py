"""The autoscaling row and alert, checked by Prometheus's own tool: every panel query parses,
and the alert fires on synthetic series exactly when the target outstays the workers serving."""

from __future__ import annotations

from pathlib import Path

from dashboards import grafana
from tests.system.test_class_alerts import (  # noqa: F401 (promtool: a fixture)
    alert_case,
    alert_rule,
    check_alert_cases,
    check_panels_parse,
    promtool,
)


def test_every_autoscale_panel_query_parses(promtool: str, tmp_path: Path) -> None:  # noqa: F811
    check_panels_parse(promtool, tmp_path, grafana.AUTOSCALE_PANELS)


def fleet(target: str, serving: str) -> list[dict[str, str]]:
    """One proxy's pool `mixed`: its target and serving workers, a value a minute."""
    labels = 'instance="proxy:8001",pool="mixed"'
    return [
        {"series": f"fairway_pool_target_workers{{{labels}}}", "values": target},
        {"series": f'fairway_pool_workers{{{labels},phase="serving"}}', "values": serving},
        {"series": f'fairway_pool_workers{{{labels},phase="starting"}}', "values": "0x40"},
    ]


def test_the_alert_fires_when_the_target_outstays_the_fleet(
    promtool: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    rule = alert_rule(tmp_path, "FairwayAutoscaleBehind")
    firing = {
        "exp_labels": {"severity": "warning", "instance": "proxy:8001", "pool": "mixed"},
        "exp_annotations": {
            k: v.replace("{{ $labels.instance }}", "proxy:8001").replace(
                "{{ $labels.pool }}", "mixed"
            )
            for k, v in rule["annotations"].items()
        },
    }

    def case(series: list[dict[str, str]], at: str, expected: list[dict]) -> dict:
        return alert_case(rule["alert"], series, at, expected)

    tests = [
        # Target 4, 2 serving from the start: fires once the hold has passed, not before.
        case(fleet("4x40", "2x40"), "20m", [firing]),
        case(fleet("4x40", "2x40"), "10m", []),
        # Workers that start within minutes: the gap closes before the hold.
        case(fleet("4x40", "2x5 4x35"), "30m", []),
        # More serving than the target (draining down): no alert.
        case(fleet("2x40", "4x40"), "30m", []),
    ]
    check_alert_cases(promtool, tmp_path, tests)
