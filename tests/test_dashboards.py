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
from router.bench_proxy import free_port
from tests.live_helpers import client, emulated_workers, proxy, run

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"


def test_committed_files_match_the_generator() -> None:
    assert json.loads((DASHBOARDS / "fairway-dashboard.json").read_text()) == grafana.dashboard()
    committed = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    assert committed == grafana.prometheus_config()


@pytest.mark.slow
def test_every_panel_query_parses_and_returns_data() -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus is not installed (make test installs it)")

    async def go() -> None:
        async with emulated_workers(2, speed=20) as urls, proxy(urls, "lpm") as (base, _):
            scratch = Path(tempfile.mkdtemp(prefix="fairway-prom-"))
            config = grafana.prometheus_config(
                proxy=base.removeprefix("http://"),
                workers=tuple(u.removeprefix("http://") for u in urls),
                interval="1s",
            )
            (scratch / "prometheus.yml").write_text(yaml.safe_dump(config))
            port = free_port()
            prom = subprocess.Popen(
                [binary, f"--config.file={scratch / 'prometheus.yml'}",
                 f"--storage.tsdb.path={scratch / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
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
                await asyncio.sleep(2.5)  # two more scrapes after the load
                api = f"http://127.0.0.1:{port}/api/v1/query"
                empty = []
                async with aiohttp.ClientSession() as s:
                    for panel in grafana.PANELS:
                        for expr, _ in panel.exprs:
                            async with s.get(api, params={"query": expr}) as r:
                                answer = await r.json()
                            assert answer["status"] == "success", (panel.title, expr, answer)
                            if not answer["data"]["result"]:
                                empty.append(f"{panel.title}: {expr}")
                assert not empty, "panels without data:\n" + "\n".join(empty)
            finally:
                prom.terminate()
                prom.wait(10)
                shutil.rmtree(scratch, ignore_errors=True)

    run(go, timeout=180)
