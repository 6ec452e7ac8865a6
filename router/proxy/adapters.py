"""Loading LoRA adapters onto vLLM workers when routing places a request for one there.

vLLM serves an adapter by name once it is registered (`POST /v1/load_lora_adapter`, allowed by
VLLM_ALLOW_RUNTIME_LORA_UPDATING): the fleet needs no static placement. The proxy registers an
adapter on a worker before sending it the first request for it; concurrent requests wait for the
one load. What a worker has registered is learned from the loads and from its /v1/models
(the monitor's polls), and forgotten when the worker goes down.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from router.prefix_index import WorkerId
from router.proxy.driver import LiveWorker
from router.proxy.errors import APIError
from router.proxy.metrics import RouterMetrics

log = logging.getLogger(__name__)
LOAD_TIMEOUT = 60.0  # an adapter of a large model is read from disk and moved to the GPU


class AdapterLoadFailed(APIError):
    """The worker would not load the adapter: try another worker."""


class AdapterLoader:
    def __init__(self, paths: dict[str, str], metrics: RouterMetrics) -> None:
        self.paths = paths
        self.metrics = metrics
        self.registered: dict[WorkerId, set[str]] = {}
        self._loading: dict[tuple[WorkerId, str], asyncio.Future[None]] = {}

    def learn(self, wid: WorkerId, adapters: set[str]) -> None:
        """What the worker lists (its /v1/models), replacing what was believed."""
        self.registered[wid] = {a for a in adapters if a in self.paths}

    def forget(self, wid: WorkerId) -> None:
        self.registered.pop(wid, None)

    async def ensure(
        self, session: aiohttp.ClientSession, worker: LiveWorker, adapter: str
    ) -> None:
        """Return once `adapter` is registered on the worker; AdapterLoadFailed if it cannot be."""
        wid, url = worker.id, worker.url
        if adapter in self.registered.get(wid, ()):
            return
        key = (wid, adapter)
        pending = self._loading.get(key)
        if pending is None:
            pending = self._loading[key] = asyncio.ensure_future(
                self._load(session, wid, url, adapter)
            )
            pending.add_done_callback(lambda _: self._loading.pop(key, None))
        await asyncio.shield(pending)  # a client leaving does not abandon the others' load

    async def _load(
        self, session: aiohttp.ClientSession, wid: WorkerId, url: str, adapter: str
    ) -> None:
        body = {"lora_name": adapter, "lora_path": self.paths[adapter]}
        try:
            async with session.post(
                f"{url}/v1/load_lora_adapter",
                json=body,
                timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT),
            ) as resp:
                text = await resp.text(errors="replace")
                # vLLM answers 400 for a name it has registered already: as good as loaded.
                ok = resp.status == 200 or (resp.status == 400 and "already been loaded" in text)
        except (aiohttp.ClientError, TimeoutError) as e:
            ok, text = False, type(e).__name__
        if not ok:
            self.metrics.adapter_loads.labels(str(wid), "failed").inc()
            # The worker's text stays in the log: it names paths on the worker.
            log.warning("worker %s could not load adapter %r: %s", wid, adapter, text[:300])
            raise AdapterLoadFailed(
                502,
                f"worker {wid} could not load the adapter",
                "APIError",
                "model",
                "adapter_load_failed",
            )
        self.registered.setdefault(wid, set()).add(adapter)
        self.metrics.adapter_loads.labels(str(wid), "loaded").inc()


ADAPTERS = web.AppKey("adapters", AdapterLoader)
