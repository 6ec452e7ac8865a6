"""Reports and dashboards from finished runs, simulated or live."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_report(args: argparse.Namespace) -> int:
    from dashboards.report import load_run, write_report

    runs = [load_run(d) for d in args.runs]
    report = write_report(runs, Path(args.out))
    print(f"report: {report} (and {report.with_suffix('.md')})")
    return 0


def cmd_dashboards(args: argparse.Namespace) -> int:
    from dashboards import grafana

    if args.out:
        for path in grafana.write(Path(args.out)):
            print(f"wrote {path}")
    else:
        print(json.dumps(grafana.dashboard(), indent=2))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="an HTML + Markdown report from existing run folders")
    p.add_argument("runs", nargs="+", help="folders with requests.csv (simulated or live)")
    p.add_argument("--out", default="report.html")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("dashboards", help="print or write the Grafana dashboard and scrape config")
    p.add_argument("--out", help="folder to write fairway-dashboard.json and prometheus.yml")
    p.set_defaults(func=cmd_dashboards)
