"""The traffic-classes row and the attainment alert, checked by Prometheus's own tool: every
panel query parses, and the alert fires on synthetic series exactly when it should."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboards import grafana


@pytest.fixture
def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.skip("Debian's prometheus (promtool) is not installed (make test installs it)")
    return binary


def check(promtool: str, *args: str, cwd: Path) -> None:
    done = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_class_panel_query_parses(promtool: str, tmp_path: Path) -> None:
    exprs = [expr for panel in grafana.CLASS_PANELS for expr, _ in panel.exprs]
    rules = [{"record": f"fairway:class_panel_{i}", "expr": e} for i, e in enumerate(exprs)]
    (tmp_path / "panels.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "p", "rules": rules}]})
    )
    check(promtool, "check", "rules", "panels.yml", cwd=tmp_path)


def per_minute(met: int, missed: int, klass: str = "interactive") -> list[dict[str, str]]:
    """Counters of `klass`'s answered requests growing by `met` and `missed` a minute."""
    return [
        {"series": f'fairway_class_requests_total{{class="{klass}",outcome="{outcome}"}}',
         "values": f"0+{n}x30"}
        for outcome, n in (("met", met), ("missed", missed))
    ]  # fmt: skip


def test_attainment_alert_fires_only_for_interactive_below_target(
    promtool: str, tmp_path: Path
) -> None:
    rules = grafana.alert_rules()
    (tmp_path / "fairway-alerts.yml").write_text(yaml.safe_dump(rules))
    rule = next(r for g in rules["groups"] for r in g["rules"]
                if r["alert"] == "FairwayInteractiveAttainmentLow")  # fmt: skip
    firing = {
        "exp_labels": {"severity": "warning", "class": "interactive"},
        "exp_annotations": rule["annotations"],
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
        # 90 % met for 20 minutes: fires once the 5 minutes' hold has passed, not before.
        case(per_minute(90, 10), "20m", [firing]),
        case(per_minute(90, 10), "4m", []),
        # 99.5 % met: within the target.
        case(per_minute(995, 5), "20m", []),
        # Batch far below: not the interactive class's alert.
        case(per_minute(995, 5) + per_minute(1, 99, "batch"), "20m", []),
        # No interactive traffic at all: nothing to judge.
        case(per_minute(1, 99, "batch"), "20m", []),
    ]
    spec = {"rule_files": ["fairway-alerts.yml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    check(promtool, "test", "rules", "test.yml", cwd=tmp_path)
