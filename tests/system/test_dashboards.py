"""Dashboards checked against a real Prometheus scraping the proxy over emulated workers."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import aiohttp
import pytest
import yaml

from dashboards import grafana
from router.proxy.ports import free_port
from tests.live_helpers import client, emulated_workers, proxy, run

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"


def test_committed_files_match_the_generator() -> None:
    assert json.loads((DASHBOARDS / "fairway-dashboard.json").read_text()) == grafana.dashboard()
    committed = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    assert committed == grafana.prometheus_config()
    rules = yaml.safe_load((DASHBOARDS / "fairway-alerts.yml").read_text())
    assert rules == grafana.alert_rules()


@pytest.mark.slow
def test_every_panel_query_parses_and_returns_data() -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus is not installed (make test installs it)")

    async def go() -> None:
        async with emulated_workers(2, speed=20) as urls, proxy(urls, "lpm") as (base, _):
            scratch = Path(tempfile.mkdtemp(prefix="fairway-prom-"))
            config = grafana.prometheus_config(
                proxy=base.admin.removeprefix("http://"),  # /metrics: the admin listener
                workers=tuple(u.removeprefix("http://") for u in urls),
                interval="1s",
            )
            (scratch / "prometheus.yml").write_text(yaml.safe_dump(config))
            (scratch / "fairway-alerts.yml").write_text(yaml.safe_dump(grafana.alert_rules()))
            port = free_port()
            prom = subprocess.Popen(
                [binary, f"--config.file={scratch / 'prometheus.yml'}",
                 f"--storage.tsdb.path={scratch / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            prom_url = f"http://127.0.0.1:{port}"
            try:
                # A loaded 2-core machine can take seconds to start Prometheus; load sent before
                # its first scrape would leave counters with too few samples for rate().
                await wait_until_scraping(prom_url, jobs={"fairway", "vllm"})
                oa = client(base)

                async def load(client: str) -> None:
                    for i in range(40):
                        await oa.completions.create(
                            model="tiny",
                            prompt=f"doc {i % 3} " * 150,
                            max_tokens=8,
                            extra_headers={"X-Client-Id": client},
                            stream=i % 2 == 0,
                        )
                        await asyncio.sleep(0.1)

                loaders = [asyncio.create_task(load(c)) for c in ("team-a", "team-b")]
                # A failed request gives the error and retry panels something to show.
                async with aiohttp.ClientSession() as s:
                    await s.post(f"{base}/v1/completions", json={"model": "tiny"})
                await asyncio.gather(*loaders)
                empty = await panels_without_data(prom_url, patience=60)
                assert not empty, (
                    "panels without data:\n" + "\n".join(empty) + "\ntargets:\n"
                    + "\n".join(await target_states(prom_url))
                )  # fmt: skip
                assert await alert_rules_healthy(prom_url) == {
                    "FairwayPrefixPredictionDrift", "FairwayRoutingFellBack",
                    "FairwayReplicaOutOfSync", "FairwayInteractiveAttainmentLow",
                    "FairwayRayGcsLost", "FairwayAutoscaleBehind", "FairwayPolicyHookErrors",
                }  # fmt: skip
            finally:
                prom.terminate()
                prom.wait(10)
                shutil.rmtree(scratch, ignore_errors=True)

    run(go, timeout=180)


async def target_states(prom_url: str) -> list[str]:
    async with aiohttp.ClientSession() as s, s.get(f"{prom_url}/api/v1/targets") as r:
        targets = (await r.json())["data"]["activeTargets"]
    return [
        f"{t['labels']['job']} {t['scrapeUrl']} {t['health']} {t.get('lastError', '')}"
        for t in targets
    ]


async def wait_until_scraping(prom_url: str, jobs: set[str], patience: float = 60) -> None:
    """Wait until Prometheus answers and every job has a target scraped successfully."""
    deadline = asyncio.get_running_loop().time() + patience
    states: list[str] = []
    while asyncio.get_running_loop().time() < deadline:
        try:
            states = await target_states(prom_url)
        except (aiohttp.ClientError, KeyError):
            states = []
        if jobs <= {line.split()[0] for line in states if line.split()[2] == "up"}:
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"Prometheus never scraped every job {sorted(jobs)}: {states}")


async def alert_rules_healthy(prom_url: str, patience: float = 30) -> set[str]:
    """The alerting rules Prometheus loaded and evaluated without error."""
    deadline = asyncio.get_running_loop().time() + patience
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(f"{prom_url}/api/v1/rules") as r:
                groups = (await r.json())["data"]["groups"]
            rules = [rule for g in groups for rule in g["rules"]]
            healthy = {r["name"] for r in rules if r.get("health") == "ok"}
            if len(healthy) == len(rules) > 0 or asyncio.get_running_loop().time() > deadline:
                return healthy
            await asyncio.sleep(1)


async def panels_without_data(prom_url: str, patience: float) -> list[str]:
    """Query every panel until all return series; a query that fails to parse fails at once."""
    deadline = asyncio.get_running_loop().time() + patience
    async with aiohttp.ClientSession() as s:
        while True:
            empty = []
            for panel in grafana.PANELS:
                for expr, _ in panel.exprs:
                    async with s.get(f"{prom_url}/api/v1/query", params={"query": expr}) as r:
                        answer = await r.json()
                    assert answer["status"] == "success", (panel.title, expr, answer)
                    if not answer["data"]["result"]:
                        empty.append(f"{panel.title}: {expr}")
            if not empty or asyncio.get_running_loop().time() > deadline:
                return empty
            await asyncio.sleep(1)
