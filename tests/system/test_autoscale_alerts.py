"""The autoscaling row and alert, checked by Prometheus's own tool: every panel query parses,
and the alert fires on synthetic series exactly when the target outstays the workers serving."""

from __future__ import annotations

from pathlib import Path

import yaml

from dashboards import grafana
from tests.system.test_class_alerts import check, promtool  # noqa: F401 (a fixture)


def test_every_autoscale_panel_query_parses(promtool: str, tmp_path: Path) -> None:  # noqa: F811
    exprs = [expr for panel in grafana.AUTOSCALE_PANELS for expr, _ in panel.exprs]
    rules = [{"record": f"fairway:autoscale_panel_{i}", "expr": e} for i, e in enumerate(exprs)]
    (tmp_path / "panels.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "p", "rules": rules}]})
    )
    check(promtool, "check", "rules", "panels.yml", cwd=tmp_path)


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
    rules = grafana.alert_rules()
    (tmp_path / "fairway-alerts.yml").write_text(yaml.safe_dump(rules))
    rule = next(r for g in rules["groups"] for r in g["rules"]
                if r["alert"] == "FairwayAutoscaleBehind")  # fmt: skip
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
        return {
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": at, "alertname": rule["alert"], "exp_alerts": expected}
            ],
        }

    tests = [
        # Target 4, 2 serving from the start: fires once the hold has passed, not before.
        case(fleet("4x40", "2x40"), "20m", [firing]),
        case(fleet("4x40", "2x40"), "10m", []),
        # Workers that start within minutes: the gap closes before the hold.
        case(fleet("4x40", "2x5 4x35"), "30m", []),
        # More serving than the target (draining down): no alert.
        case(fleet("2x40", "4x40"), "30m", []),
    ]
    spec = {"rule_files": ["fairway-alerts.yml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    check(promtool, "test", "rules", "test.yml", cwd=tmp_path)
