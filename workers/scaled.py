"""An autoscaled fleet's servers: one slot per server the planner may run, each with its port,
log and KV events endpoint fixed up front; the planner's first ones started with the proxy,
the others started and stopped through Ray as it decides (router/proxy/autoscale.py).

    slot:   0       1       ...   max-1
    port:   first_port + slot  (as a fixed fleet of max_workers would number them)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from router.planner import PlannerConfig
from router.proxy.autoscale import Server
from router.proxy.service.config import ClusterConfig, FleetWorker
from workers.launch import model_dir_of, server_specs
from workers.pool import WorkerPool

log = logging.getLogger("fairway.serve")


def check_scalable(config: ClusterConfig) -> None:
    """A ValueError naming the setting if `config`'s fleet is not one autoscaling sizes: one
    model, mixed workers the proxy starts, one router."""
    if config.models:
        raise ValueError("models: --autoscale sizes a fleet of one model (workers:) only")
    w = config.workers
    if w.urls:
        raise ValueError("workers.urls: --autoscale starts its workers; it cannot size given ones")
    if w.is_split:
        raise ValueError("workers.prefill, workers.decode: --autoscale sizes mixed workers only")
    if config.routers > 1:
        raise ValueError("routers: --autoscale runs with one router process")
    if config.groups[0].adapters:
        raise ValueError("adapters: --autoscale sizes a fleet without LoRA adapters")


class PoolLauncher:
    """router.proxy.autoscale.Launcher over a WorkerPool, one slot's calls in the order they
    were asked for (a stop before the start that reuses the slot)."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._slots: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def launch(self, slot: int) -> Server:
        async with self._slots[slot]:
            # Awaited, not waited for in a thread: a proxy that stops meanwhile does not wait
            # for the start (the pool's stop ends the server, started or not).
            self.pool.launched(slot, await self.pool.launch(slot))
        spec = self.pool.specs[slot]
        return Server(spec.url, spec.kv_events)

    async def retire(self, slot: int) -> None:
        async with self._slots[slot]:
            await asyncio.to_thread(self.pool.retire, slot)


@contextlib.contextmanager
def scaled_workers(
    config: ClusterConfig,
    autoscale: PlannerConfig,
    scratch: Path,
    on_lost: Callable[[str], None],
) -> Iterator[tuple[list[FleetWorker], PoolLauncher]]:
    """The planner's first servers started (slots 0..first-1) while the block runs, and the
    launcher for the others; every server still running is stopped at the end."""
    check_scalable(config)
    w = config.workers
    wide = config.model_copy(
        update={"workers": w.model_copy(update={"count": autoscale.max_workers})}
    )
    specs = server_specs(wide, model_dir_of(wide), scratch)
    ordered = w.scheduling_policy == "priority"
    first = [
        FleetWorker(s.url, s.kv_events, priority_scheduling=ordered)
        for s in specs[: autoscale.first]
    ]
    pool = WorkerPool(specs, w.ray_address, w.gpus_per_worker, scratch)
    log.info("starting %d of up to %d workers (logs in %s)", len(first), len(specs), scratch)
    try:
        pool.start(autoscale.first)
        pool.watch(on_lost)
        yield first, PoolLauncher(pool)
    finally:
        pool.stop()  # every server running by then
