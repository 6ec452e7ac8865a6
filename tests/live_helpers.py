"""Starting proxies and workers inside a test, on free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from aiohttp import web
from openai import AsyncOpenAI

from router.live import LiveCluster
from router.prompts import PromptEncoder
from router.proxy import ProxySettings, create_app
from router.serve import ClusterConfig, build_cluster, ensure_tiny_model
from workers import emulated

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = ROOT / "build" / "tiny-tokenizer"
BLOCK = 128


def tokenizer_dir() -> Path:
    return ensure_tiny_model(TOKENIZER_DIR, weights=False)


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def emulated_workers(n: int, speed: float = 1.0, **kw) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(
            serving(emulated.create_app(tokenizer_dir(), "tiny", BLOCK, speed=speed, **kw)))
            for _ in range(n)]  # fmt: skip
        yield urls


@contextlib.asynccontextmanager
async def proxy(
    worker_urls: list[str], policy: str = "round_robin", window: int = 8, **settings
) -> AsyncIterator[tuple[str, LiveCluster]]:
    config = ClusterConfig(policy={"name": policy}, window=window, block_size=BLOCK)
    cluster = build_cluster(config)
    for url in worker_urls:
        cluster.add_worker(url)
    s = ProxySettings(model_name="tiny", policy_name=policy, health_interval=0.2, **settings)
    app = create_app(cluster, PromptEncoder(tokenizer_dir(), BLOCK), s)
    async with serving(app) as url:
        yield url, cluster


def client(base: str, **kw) -> AsyncOpenAI:
    """The OpenAI client as a user would point it at the proxy (no client-side retries)."""
    return AsyncOpenAI(base_url=f"{base}/v1", api_key="test-key-1234", max_retries=0, **kw)


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 120.0) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), timeout))
