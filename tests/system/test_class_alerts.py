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


def check_panels_parse(promtool: str, tmp_path: Path, panels: list[grafana.Panel]) -> None:
    """Every query of `panels` parses, as a recording rule promtool checks."""
    exprs = [expr for panel in panels for expr, _ in panel.exprs]
    rules = [{"record": f"fairway:panel_{i}", "expr": e} for i, e in enumerate(exprs)]
    (tmp_path / "panels.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "p", "rules": rules}]})
    )
    check(promtool, "check", "rules", "panels.yml", cwd=tmp_path)


def alert_rule(tmp_path: Path, alert: str) -> dict:
    """Fairway's alert rules written where promtool will read them; the one named `alert`."""
    rules = grafana.alert_rules()
    (tmp_path / "fairway-alerts.yml").write_text(yaml.safe_dump(rules))
    return next(r for g in rules["groups"] for r in g["rules"] if r["alert"] == alert)


def alert_case(
    alert: str, series: list[dict[str, str]], at: str, expected: list[dict], interval: str = "1m"
) -> dict:
    """One promtool unit test: `series` sampled every `interval`, and the alerts of `alert`
    firing at `at`."""
    return {
        "interval": interval,
        "input_series": series,
        "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": expected}],
    }


def check_alert_cases(
    promtool: str, tmp_path: Path, cases: list[dict], evaluation_interval: str = "1m"
) -> None:
    """`cases` run by promtool against the rules `alert_rule` wrote."""
    spec = {
        "rule_files": ["fairway-alerts.yml"],
        "evaluation_interval": evaluation_interval,
        "tests": cases,
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(spec, sort_keys=False))
    check(promtool, "test", "rules", "test.yml", cwd=tmp_path)


def test_every_class_panel_query_parses(promtool: str, tmp_path: Path) -> None:
    check_panels_parse(promtool, tmp_path, grafana.CLASS_PANELS)


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
    rule = alert_rule(tmp_path, "FairwayInteractiveAttainmentLow")
    firing = {
        "exp_labels": {"severity": "warning", "class": "interactive"},
        "exp_annotations": rule["annotations"],
    }

    def case(series: list[dict[str, str]], at: str, expected: list[dict]) -> dict:
        return alert_case(rule["alert"], series, at, expected)

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
    check_alert_cases(promtool, tmp_path, tests)
