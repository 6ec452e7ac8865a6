"""The emulated server's engine: one simulated vLLM engine whose simulated seconds track
wall-clock seconds.

The SimPy environment is driven from the asyncio loop: a driver task sleeps until the next
simulated event is due in wall time (`speed` x faster if asked), then steps it; an arriving
request first advances the simulation to "now", so it joins the engine at its real arrival time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from policies.fcfs import FCFS
from router.cost_model import roofline
from router.policy import LocalPolicy
from router.request import Request
from simulator.engine import Engine, EngineConfig, Seq
from simulator.environment import FleetEnvironment
from simulator.listener import ListenerDefaults
from workers.emulated.kv_events import KVEventPublisher
from workers.emulated.metrics import VLLMMetrics
from workers.emulated.split import Incoming


class WallClockEngine(ListenerDefaults):
    """One simulated engine whose simulated seconds track wall-clock seconds (x `speed`), and
    its engine's listener (simulator.engine.EngineListener): every step's tokens, streamed."""

    def __init__(
        self,
        engine_config: EngineConfig,
        preset: str,
        gpu: str,
        speed: float = 1.0,
        kv_events: KVEventPublisher | None = None,
        waiting: LocalPolicy | None = None,
    ):
        """`waiting`: the order of the waiting queue (default FCFS, vLLM's fcfs policy)."""
        self.env = FleetEnvironment()
        self.speed = speed
        cost = roofline(preset, gpu)
        local = waiting if waiting is not None else FCFS()
        self.engine = Engine(self.env, 0, cost, engine_config, local, self, kv_events)
        self.streams: dict[int, asyncio.Queue[int | None]] = {}
        self.cached_tokens: dict[int, int] = {}  # request id -> prefix hit, until answered
        self.incoming: dict[int, Incoming] = {}  # requests whose prompt's KV was sent here
        self.metrics: VLLMMetrics | None = None
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()

    def sim_now(self) -> float:
        return (time.monotonic() - self._t0) * self.speed

    def submit(self, req: Request, incoming: Incoming | None = None) -> asyncio.Queue[int | None]:
        """Queue `req`; `incoming`: its prompt's KV is sent from a prefill server, and it joins
        the engine when the transfer ends, with only the prompt's last token to compute."""
        self._catch_up()
        req.arrival = self.env.now
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.streams[req.id] = queue
        if incoming is None:
            self.engine.submit(req)
        else:
            self.incoming[req.id] = incoming

            def arrived(_: object) -> None:
                if req.id in self.streams:  # not aborted meanwhile
                    self.engine.submit(req, preloaded=True)

            self.env.timeout(incoming.seconds).callbacks.append(arrived)
        self._wake.set()
        return queue

    def cached_prefix(self, req: Request) -> int:
        """Prompt tokens of `req` this engine holds now, as it would reuse them."""
        self._catch_up()
        return self.engine.reusable_tokens(req)

    def abort(self, req: Request) -> None:
        """The client left: stop spending the engine's time on it."""
        self.streams.pop(req.id, None)
        self.incoming.pop(req.id, None)
        self._catch_up()
        self.engine.abort(req.id)
        self._wake.set()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request is using (vLLM's /reset_prefix_cache); how many."""
        self._catch_up()
        return self.engine.blocks.reset_prefix_cache()

    def _catch_up(self) -> None:
        now = self.sim_now()
        if now > self.env.now:
            self.env.run(until=now)

    async def run(self) -> None:
        while True:
            due = self.env.peek()
            if due == math.inf:
                await self._wake.wait()
                self._wake.clear()
                continue
            delay = (due - self.sim_now()) / self.speed
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                self._wake.clear()
                continue
            self.env.step()

    # EngineListener
    def on_first_token(self, seq: Seq, now: float) -> None:
        local = seq.num_cached_tokens or 0
        sent = self.incoming.pop(seq.req.id, None)
        # vLLM counts a prompt's tokens loaded through its connector as cached too.
        self.cached_tokens[seq.req.id] = local if sent is None else max(local, sent.cached)
        if self.metrics:
            m, labels = self.metrics, self.metrics.labels
            m.queries.labels(*labels).inc(seq.req.prompt_len)
            m.hits.labels(*labels).inc(local)
            if sent is not None:
                m.external_queries.labels(*labels).inc(seq.req.prompt_len - local)
                m.external_hits.labels(*labels).inc(sent.tokens)
            m.prompt_tokens.labels(*labels).inc(seq.req.prompt_len)
            m.ttft.labels(*labels).observe((now - seq.req.arrival) / self.speed)

    def on_tokens(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
        for seq in seqs:
            if (queue := self.streams.get(seq.req.id)) is not None:
                queue.put_nowait(num_tokens)
        if self.metrics:
            self.metrics.generation_tokens.labels(*self.metrics.labels).inc(num_tokens * len(seqs))

    def on_finish(self, seq: Seq, now: float) -> None:
        if (queue := self.streams.pop(seq.req.id, None)) is not None:
            queue.put_nowait(None)
        if self.metrics and seq.num_output >= seq.req.output_len:  # not aborted
            m = self.metrics
            m.success.labels(*m.labels).inc()
            m.e2e.labels(*m.labels).observe((now - seq.req.arrival) / self.speed)
            scheduled, first = seq.admitted_at, seq.first_token_at
            if scheduled is not None and first is not None:
                m.queue_time.labels(*m.labels).observe((scheduled - seq.req.arrival) / self.speed)
                m.prefill_time.labels(*m.labels).observe((first - scheduled) / self.speed)
                m.decode_time.labels(*m.labels).observe((now - first) / self.speed)
                m.inference_time.labels(*m.labels).observe((now - scheduled) / self.speed)
            m.preemptions.labels(*m.labels).inc(seq.num_preemptions)
