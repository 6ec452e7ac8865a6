"""`fairway serve --autoscale` on emulated workers, as a user starts it: a load past one
worker's planned rate adds workers, and once it stops they are drained and stopped, down to
the minimum; every request sent is answered (count in = count out).

The planner's TPOT target is set below one decode step of the router's cost model, so that a
worker's planned rate is a batch of one (a few requests per second): a short, light load is
enough to need three."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import yaml

from router.proxy.ports import free_ports
from router.runtime.processes import process, wait_healthy_async
from tests.live_helpers import ROOT, assert_every_request_ended, run, tokenizer_dir
from traces.load import LoadSpec, run_load

AUTOSCALE = "min=1,max=3,startup=2,interval=1,cooldown=2,tpot=0.001"
SERVING = re.compile(r'^fairway_pool_workers\{phase="serving",pool="mixed"\} (\S+)$', re.M)
TARGET = re.compile(r'^fairway_pool_target_workers\{pool="mixed"\} (\S+)$', re.M)


async def gauges(session: aiohttp.ClientSession, admin: str) -> tuple[int, int]:
    """(serving, target) as the proxy exports them."""
    async with session.get(f"{admin}/metrics") as resp:
        text = await resp.text()
    serving, target = SERVING.search(text), TARGET.search(text)
    assert serving and target, "the autoscaling gauges are exported"
    return int(float(serving.group(1))), int(float(target.group(1)))


def test_load_adds_workers_and_its_end_drains_them(tmp_path: Path) -> None:
    port, admin_port, first_port = free_ports(3)
    config = {
        "model": str(tokenizer_dir()),
        "port": port,
        "admin_port": admin_port,
        "health_interval": 0.2,
        "workers": {"backend": "emulated", "first_port": first_port},
    }
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(path),
            "--autoscale", AUTOSCALE]  # fmt: skip
    base, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    # The load comes in rounds of 10 s, two at least and six at most: a machine busy with other
    # tests can take longer than usual to start a worker (a Ray actor and its server), and the
    # load must still be on when it comes up.
    spec = LoadSpec(num_requests=500, concurrency=12, duration=10.0, max_tokens=16, timeout=30.0)
    min_rounds, max_rounds = 2, 6

    async def go() -> None:
        await wait_healthy_async(base, 90)
        async with aiohttp.ClientSession() as session:
            assert await gauges(session, admin) == (1, 1), "the minimum serves at the start"
            most = 0
            for round_ in range(max_rounds):
                load = asyncio.create_task(run_load(base, replace(spec, seed=round_)))
                while not load.done():  # bounded: the load ends by its duration and timeout
                    most = max(most, (await gauges(session, admin))[0])
                    await asyncio.sleep(0.25)
                result = await load
                assert_every_request_ended(result)
                assert result.counts["ok"] == len(result.outcomes), result.summary()
                if most >= 2 and round_ + 1 >= min_rounds:
                    break
            assert most >= 2, f"the load added workers (at most {most} served)"
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and await gauges(session, admin) != (1, 1):
                await asyncio.sleep(0.25)
            assert await gauges(session, admin) == (1, 1), "drained back to the minimum"

    with process(argv, None, tmp_path / "serve.log", {"PYTHONPATH": str(ROOT)}):
        run(go, timeout=150)
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert re.search(r"autoscale: slot [12] serves as worker", log), "a worker was started"
