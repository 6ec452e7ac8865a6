"""The lost-GCS alert, checked by Prometheus's own tool: it fires on synthetic series exactly
while the proxy says Ray's GCS is gone (fairway_degraded{cause="ray_gcs"}), not for a replica
out of sync. (Its panels are checked with the others: tests/system/test_dashboards.py.)"""

from __future__ import annotations

from pathlib import Path

from tests.system.test_class_alerts import (  # noqa: F401 (promtool: a fixture)
    alert_case,
    alert_rule,
    check_alert_cases,
    promtool,
)


def test_the_lost_gcs_alert_fires_while_the_proxy_says_so(
    promtool: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    rule = alert_rule(tmp_path, "FairwayRayGcsLost")
    firing = {
        "exp_labels": {"severity": "critical", "cause": "ray_gcs", "instance": "proxy"},
        "exp_annotations": {
            "summary": rule["annotations"]["summary"],
            "description": rule["annotations"]["description"].replace(
                "{{ $labels.instance }}", "proxy"
            ),
        },
    }

    def degraded(cause: str, values: str) -> dict[str, str]:
        return {"series": f'fairway_degraded{{cause="{cause}",instance="proxy"}}', "values": values}

    def case(series: list[dict[str, str]], at: str, expected: list[dict]) -> dict:
        return alert_case(rule["alert"], series, at, expected, interval="15s")

    tests = [
        # Answering, then lost at 1 m, through a grace, then stopped (no more series).
        case([degraded("ray_gcs", "0x3 1x4")], "30s", []),
        case([degraded("ray_gcs", "0x3 1x4")], "1m15s", [firing]),
        # Lost, then answering again within the grace: over.
        case([degraded("ray_gcs", "1x2 0x4")], "1m", []),
        # A replica out of sync is another alert's.
        case([degraded("shared_state", "1x8")], "1m", []),
    ]
    check_alert_cases(promtool, tmp_path, tests, evaluation_interval="15s")
