"""`make bench` (replicas part): `fairway serve --routers N` against one router, same load.

- Throughput: streams/s through 1, 2 and 4 replicas on one port, the proxy bench's closed
  loop (workers/bench/proxy.py: fixed concurrency, 16-token streams) for a fixed time.
- Locality: LPM's prefix hit rate (the workers' own cached-token counts) and how many workers
  each document ends on, when rounds of requests return to the same documents: a replica
  learns where another one placed a document only at the next sync.
- Fairness: VTC's maximum service gap between backlogged tenants, and the calm tenants' TTFT,
  when one tenant floods (open loop, as the simulator's `flood`) and the router's queues order:
  each replica orders by counters the others update late. The window in flight per worker is
  split over the replicas, so the total is the same.

Service is measured at the client: prompt tokens at the first byte, output ramped to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from dashboards.tables import format_table
from router.cost_model import CostModel, roofline
from router.proxy.ports import free_port, free_ports
from router.proxy.prompts import PromptEncoder
from router.proxy.service.replicas import REPLICA_HEADER
from router.records import RequestRecord
from router.request import Request
from router.runtime.processes import cpu_seconds, process, wait_healthy
from simulator.config import SimConfig
from simulator.driver import SimCluster, simulate
from simulator.engine import EngineConfig
from traces.schema import Trace, finish
from workers.bench.proxy import measured, throughput
from workers.emulated.cli import emulated_command

ROOT = Path(__file__).resolve().parents[2]
# The emulated workers, as the simulator's replay models them too.
WORKERS, PRESET, GPU, BLOCK_SIZE = 2, "llama-3-8b", "a100-80g", 128
FAST, SLOW = 50.0, 2.0  # x wall time: the throughput and locality workers, the fairness ones
DOC_OUTPUT, FLOOD_OUTPUT = 8, 32  # tokens


@dataclass(frozen=True)
class Setup:
    routers: int
    sync: float = 0.1

    @property
    def label(self) -> str:
        if self.routers == 1:
            return "1 router"
        never = " (none in the run)" if self.sync >= 60 else ""
        return f"{self.routers} routers, sync {self.sync:g} s{never}"


@contextlib.contextmanager
def fairway(scratch: Path, model: Path, workers: list[str], setup: Setup, policy: str, window: int):
    """`fairway serve` with `setup.routers` replicas (its own Redis); yields its URL and pid."""
    # Each router's own port is its admin listener (/metrics); one router has one as well.
    port, *own = free_ports(setup.routers + 1)
    config = {
        "model": str(model),
        "port": port,
        "policy": {"name": policy},
        "window": window,
        "trust_client_headers": True,
        "routers": setup.routers,
        "router_sync": setup.sync,
        "replica_ports": own,
        "workers": {"urls": workers},
    }
    path = scratch / f"fairway-{setup.routers}-{setup.sync:g}-{policy}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    argv = [sys.executable, "-m", "router.cli", "serve", "--config", str(path)]
    with process(argv, None, path.with_suffix(".log"), {"PYTHONPATH": str(ROOT)}) as proc:
        for p in [port, *own]:
            wait_healthy(f"http://127.0.0.1:{p}", 120)
        yield f"http://127.0.0.1:{port}", proc.pid  # its replicas and Redis run below it


@dataclass
class Sent:
    """One request of a load: what the simulator replays, and what came back live."""

    tenant: str
    prompt: str
    max_tokens: int
    tag: int = 0  # the record's id (the document, for the documents load)
    at: float = 0.0  # when the client sent it, seconds after the load's start
    replica: int | None = None  # the replica that answered (None: one router, or no answer)
    record: RequestRecord | None = None  # None: it did not end complete


def records_of(sent: list[Sent]) -> list[RequestRecord]:
    return [s.record for s in sent if s.record is not None]


async def stream_one(session: aiohttp.ClientSession, url: str, sent: Sent, t0: float) -> None:
    """One streamed completion, timed at the client: fills in `sent`."""
    body = {
        "model": "tiny",
        "prompt": sent.prompt,
        "max_tokens": sent.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.monotonic()
    sent.at = start - t0
    first, usage, done = None, None, False
    async with session.post(
        f"{url}/v1/completions", json=body, headers={"X-Client-Id": sent.tenant}
    ) as r:
        if (replica := r.headers.get(REPLICA_HEADER)) is not None:
            sent.replica = int(replica.split("-", 1)[0])
        if r.status != 200:
            await r.read()
            return
        worker = int(r.headers.get("X-Fairway-Worker", -1))
        buf = b""
        async for chunk in r.content.iter_any():
            first = first or time.monotonic()
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    done = True
                elif data.startswith(b"{") and b'"usage"' in data:
                    usage = json.loads(data).get("usage") or usage
    if not done or usage is None or first is None:
        return
    end = time.monotonic()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    sent.record = RequestRecord(
        id=sent.tag,
        client=sent.tenant,
        session=None,
        worker=worker,
        arrival=start - t0,
        admitted=first - t0,
        first_token=first - t0,
        finish=end - t0,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=cached,
        output_tokens=usage["completion_tokens"],
        preemptions=0,
    )


def document_prompt(salt: str, d: int, i: int) -> str:
    return f"{salt} document {d} about subject {d * 7919} " * 60 + f"question {i}"


async def documents_load(
    url: str, num_docs: int, per_doc: int, concurrency: int, salt: str, fresh: bool = False
) -> list[Sent]:
    """Rounds over the documents: request i asks about document i % num_docs. A replica that
    has not yet heard where another sent a document places it anew (often elsewhere). `salt`
    makes the documents new to the workers' caches. `fresh`: a new connection per request, so
    the kernel picks a replica for each (else for each of the client's kept-alive ones)."""
    t0, next_i, out = time.monotonic(), 0, []
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def loop() -> None:
            nonlocal next_i
            while next_i < num_docs * per_doc:
                i, next_i = next_i, next_i + 1
                d = i % num_docs
                sent = Sent("docs", document_prompt(salt, d, i), DOC_OUTPUT, tag=d)
                out.append(sent)
                await stream_one(session, url, sent, t0)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return out


def flood_prompt(salt: str, tenant: str, j: int) -> str:
    return f"{salt} {tenant} shared manual page " * 30 + f"question {j}"


async def flood_load(
    url: str, seconds: float, flood_rate: float, calm_rate: float, num_calm: int, salt: str
) -> list[Sent]:
    """Open loop, as the simulator's `flood`: one tenant sends Poisson arrivals faster than the
    workers serve, `num_calm` others slowly, each over a prompt prefix of its own."""
    rng = random.Random(0)
    arrivals = []
    for tenant, rate in [
        ("flood", flood_rate),
        *((f"calm-{k}", calm_rate) for k in range(num_calm)),
    ]:
        t = rng.expovariate(rate)
        while t < seconds:
            arrivals.append((t, tenant))
            t += rng.expovariate(rate)
    arrivals.sort()
    t0, out = time.monotonic(), []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        for j, (at, tenant) in enumerate(arrivals):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            sent = Sent(tenant, flood_prompt(salt, tenant, j), FLOOD_OUTPUT, tag=j)
            out.append(sent)
            tasks.append(asyncio.create_task(stream_one(session, url, sent, t0)))
        await asyncio.gather(*tasks)
    return out


# ------------------------------------------------------------------ the simulator's replay


class _LiveSplit(SimCluster):
    """The simulator with the live run's balancer: each request goes to the replica that
    answered it live (the kernel's SO_REUSEPORT hash of the client's connections), not round
    robin. A request with no answer keeps the round robin's turn."""

    def __init__(self, trace: Trace, cost: CostModel, config: SimConfig, split: dict[int, int]):
        super().__init__(trace, cost, config)
        self.split = split

    def dispatch(self, req: Request) -> None:
        if (replica := self.split.get(req.id)) is not None:
            self._next_router = replica % len(self.routers)
        super().dispatch(req)


def replay(
    sent: list[Sent],
    encoder: PromptEncoder,
    speed: float,
    setup: Setup,
    policy: str,
    window: int,
    live_split: bool = False,
) -> list[RequestRecord]:
    """The live load replayed by `fairway simulate`'s cluster: the same prompts (tokenized and
    hashed as the proxy does), sent at the same moments, to as many workers as live running the
    emulated workers' engine model and cost model, `setup.routers` replicas syncing every
    `setup.sync` seconds, the router's queues with the same window. The emulated workers run
    `speed` x faster than wall time, so wall seconds (arrivals, the sync) are `speed`
    simulated ones. Records come back in wall seconds, admitted at the first token as the
    live client measures it."""
    requests = []
    for k, s in enumerate(sent):
        ids = encoder.completion_prompts(s.prompt)[0]
        requests.append(
            Request(
                id=k,
                arrival=s.at * speed,
                prompt_len=len(ids),
                output_len=s.max_tokens,
                block_hashes=encoder.block_hashes(ids),
                client=s.tenant,
            )
        )
    trace = finish(Trace(requests, BLOCK_SIZE, source="bench-replicas"))
    config = SimConfig(
        num_workers=WORKERS,
        policy=policy,
        placement="router",
        window=window,
        routers=setup.routers,
        router_sync=setup.sync * speed,
        engine=EngineConfig(fast_forward=False),  # as the emulated workers run it
    )
    cost = roofline(PRESET, GPU)
    if live_split and setup.routers > 1:
        split = {k: s.replica for k, s in enumerate(sent) if s.replica is not None}
        result = _LiveSplit(trace, cost, config, split).run()
    else:
        result = simulate(trace, cost, config)
    return [
        replace(
            r,
            id=sent[r.id].tag,
            arrival=r.arrival / speed,
            admitted=r.first_token / speed,
            first_token=r.first_token / speed,
            finish=r.finish / speed,
        )
        for r in result.records
    ]


def hit_rate(records: list[RequestRecord]) -> float:
    return sum(r.cached_tokens for r in records) / max(1, sum(r.prompt_tokens for r in records))


def service_gap(records: list[RequestRecord]) -> float:
    from simulator.fairness import max_service_gap, service_curves

    return max_service_gap(service_curves(records, step=0.25))


def workers_per_document(records: list[RequestRecord]) -> float:
    return len({(r.id, r.worker) for r in records}) / max(1, len({r.id for r in records}))


def run_replicas_bench(quick: bool = False) -> int:
    from workers.launch import ensure_tiny_model

    if shutil.which("redis-server") is None:
        print("bench-replicas: needs redis-server (`make test` installs it)", file=sys.stderr)
        return 1
    model = ensure_tiny_model(ROOT / "build" / "tiny-tokenizer", weights=False)
    scratch = Path(tempfile.mkdtemp(prefix="fairway-bench-replicas-"))
    seconds, concurrency = (5.0, 32) if quick else (15.0, 64)
    docs, per_doc, fair_seconds = (12, 6, 6.0) if quick else (24, 8, 12.0)
    stream = {"model": "tiny", "prompt": "benchmark " * 100, "max_tokens": 16, "stream": True}
    window = 4  # per worker, over all replicas, for the fairness runs
    compare = [Setup(1), Setup(2, 0.1), Setup(4, 0.1), Setup(4, 1.0), Setup(4, 60.0)]
    throughput_rows, quality_rows, sim_locality, sim_fairness = [], [], [], []
    encoder = PromptEncoder(model, BLOCK_SIZE)
    load_before, started = os.getloadavg()[0], time.monotonic()
    with contextlib.ExitStack() as stack:
        fast, slow = [], []  # workers for throughput (cheap) and for fairness (a backlog)
        for name, speed, out in (("fast", FAST, fast), ("slow", SLOW, slow)):
            for i in range(WORKERS):
                port = free_port()
                argv = emulated_command(
                    port, model, block_size=BLOCK_SIZE, preset=PRESET, gpu=GPU, speed=speed
                )
                log = scratch / f"worker-{name}-{i}.log"
                stack.enter_context(process(argv, None, log, {"PYTHONPATH": str(ROOT)}))
                out.append(f"http://127.0.0.1:{port}")
        for url in fast + slow:
            wait_healthy(url)

        base = None
        for n in (1, 2, 4):
            with fairway(scratch, model, fast, Setup(n), "vtc", 256) as (url, pid):
                load0 = cpu_seconds(os.getpid(), children=False)
                rate = measured(url, pid, seconds, concurrency, stream)
                load = (cpu_seconds(os.getpid(), children=False) - load0) / seconds
            base = base or rate
            throughput_rows.append(
                {
                    "routers": n,
                    "streams/s": rate.streams_per_s,
                    "vs 1 router": rate.streams_per_s / base.streams_per_s,
                    "router cores": rate.router_cores,
                    "streams per router CPU-s": rate.streams_per_cpu_s,
                    "per CPU-s vs 1 router": rate.streams_per_cpu_s / base.streams_per_cpu_s,
                    "load generator cores": load,
                }
            )

        # The flood's rate: 1.5 x what the slow workers serve here (measured, not assumed).
        probe = {
            "model": "tiny",
            "prompt": flood_prompt("probe", "flood", 0),
            "max_tokens": FLOOD_OUTPUT,
            "stream": True,
            "ignore_eos": True,
        }
        with fairway(scratch, model, slow, Setup(1), "vtc", window) as (url, _):
            capacity = asyncio.run(throughput(url, 4.0, 4 * window, probe))
        flood_rate, calm_rate, num_calm = 1.5 * capacity, 0.05 * capacity, 4
        for k, setup in enumerate(compare):
            with fairway(scratch, model, fast, setup, "lpm", 64) as (url, _):
                sent_docs = asyncio.run(documents_load(url, docs, per_doc, 24, f"run {k}"))
            share = max(1, window // setup.routers)
            with fairway(scratch, model, slow, setup, "vtc", share) as (url, _):
                sent_fair = asyncio.run(
                    flood_load(url, fair_seconds, flood_rate, calm_rate, num_calm, f"run {k}")
                )
            hits, fair = records_of(sent_docs), records_of(sent_fair)
            calm = [r.ttft for r in fair if r.client != "flood"]
            quality_rows.append(
                {
                    "setup": setup.label,
                    "LPM hit rate": hit_rate(hits),
                    "workers per document": workers_per_document(hits),
                    "VTC max service gap": service_gap(fair),
                    "calm TTFT mean s": sum(calm) / max(1, len(calm)),
                    "window per replica": share,
                    "requests ok": len(hits) + len(fair),
                }
            )
            locality, fairness = compare_with_simulator(setup, encoder, sent_docs, sent_fair, share)
            sim_locality.append(locality)
            sim_fairness.append(fairness)
    live_wall = time.monotonic() - started
    cpu = platform.processor() or _cpu_model()
    print(
        f"Router replicas on one port (SO_REUSEPORT), this machine: {os.cpu_count()} cores "
        f"({cpu}); replicas, Redis, {WORKERS} emulated workers and the load generator all share "
        f"them; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"{live_wall:.0f} s."
    )
    print(
        f"Throughput: VTC, {WORKERS} workers ({FAST:g}x time), 16-token streams of a ~200-token "
        f"prompt, {concurrency} concurrent for {seconds:.0f} s. Router cores: CPU-seconds per "
        f"second of `fairway serve` and all below it (replicas, Redis; from /proc); the load "
        f"generator's (this process) apart. On {os.cpu_count()} cores shared with the workers and "
        f"the generator, streams/s cannot scale with replicas; streams per router CPU-second "
        f"says what each replica's core costs."
    )
    print(format_table(throughput_rows))
    print(
        f"\nLocality: LPM, {docs} documents of ~530 tokens (4 blocks), asked {per_doc} times "
        f"each in rounds, 24 concurrent (hit rate from the workers' cached-token counts). "
        f"Fairness: VTC with the router's queues ordering (window {window} per worker over all "
        f"replicas), {WORKERS} workers ({SLOW:g}x time) serving about {capacity:.0f} requests/s "
        f"here; for {fair_seconds:.0f} s one tenant floods at {flood_rate:.0f}/s and {num_calm} "
        f"calm ones send {calm_rate:.1f}/s each (Poisson); service gap in weighted tokens "
        f"(in + 2 x out) as the client sees it, and the calm tenants' mean TTFT."
    )
    print(format_table(quality_rows))
    print(
        "\nThe simulator against the live runs above (issue 10 C): each run's requests replayed "
        "by `fairway simulate`'s cluster (the same prompts hashed as the proxy hashes them, sent "
        "at the moments the live client sent them, the emulated workers' engine and cost model, "
        "`routers=N, router_sync=S`, wall seconds x the workers' speed). `sim` is its own "
        "balancer (round robin over arrivals); `sim, live split` sends each request to the "
        "replica that answered it live (the kernel's SO_REUSEPORT hash of the client's "
        "connections); `same, sync 2S` also syncs half as often. Service gap as above, the "
        "simulated first token standing for the first byte."
    )
    print(format_table(sim_locality))
    print(format_table(sim_fairness))
    print(sim_summary(sim_locality, sim_fairness))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def compare_with_simulator(
    setup: Setup, encoder: PromptEncoder, docs: list[Sent], fair: list[Sent], share: int
) -> tuple[dict[str, object], dict[str, object]]:
    """The rows of the simulator-against-live tables (locality, fairness) for `setup`'s runs."""
    live_docs, live_fair = records_of(docs), records_of(fair)
    rr_docs, split_docs = (replay(docs, encoder, FAST, setup, "lpm", 64, s) for s in (0, 1))
    late = replace(setup, sync=2 * setup.sync)
    late_docs = replay(docs, encoder, FAST, late, "lpm", 64, True)
    rr_fair, split_fair = (replay(fair, encoder, SLOW, setup, "vtc", share, s) for s in (0, 1))

    def calm_ttft(records: list[RequestRecord]) -> float:
        calm = [r.ttft for r in records if r.client != "flood"]
        return sum(calm) / max(1, len(calm))

    locality = {
        "setup": setup.label,
        "hit live": hit_rate(live_docs),
        "sim": hit_rate(rr_docs),
        "sim, live split": hit_rate(split_docs),
        "same, sync 2S": hit_rate(late_docs),
        "workers/doc live": workers_per_document(live_docs),
        "sim, live split ": workers_per_document(split_docs),
    }
    fairness = {
        "setup": setup.label,
        "gap live": service_gap(live_fair),
        "sim": service_gap(rr_fair),
        "sim, live split": service_gap(split_fair),
        "calm TTFT live s": calm_ttft(live_fair),
        "sim, live split ": calm_ttft(split_fair),
    }
    return locality, fairness


def sim_summary(locality: list[dict[str, object]], fairness: list[dict[str, object]]) -> str:
    """What the simulator-against-live tables say, in this run's numbers."""

    def off(column: str, rows: list[dict[str, object]]) -> list[float]:
        """Simulated minus live hit rate, in points, for each row."""
        return [100 * (float(r[column]) - float(r["hit live"])) for r in rows]  # type: ignore[arg-type]

    def span(values: list[float]) -> str:
        return f"{min(values):+.1f} to {max(values):+.1f}" if values else "n/a"

    synced = [r for r in locality if "sync" in str(r["setup"]) and "none" not in str(r["setup"])]
    ratios = [
        float(r["sim, live split"]) / float(r["gap live"])  # type: ignore[arg-type]
        for r in fairness
        if float(r["gap live"]) > 0  # type: ignore[arg-type]
    ]
    ratio = f"{min(ratios):.2f}x to {max(ratios):.2f}x live's" if ratios else "not comparable"
    return (
        f"Hit rate, simulated minus live (points): round robin {span(off('sim', locality))}; "
        f"it sends each document to one replica every time (the documents come in rounds of "
        f"a multiple of N), so it cannot show what replicas lose here. With the live split "
        f"{span(off('sim, live split', locality))}, where replicas sync "
        f"{span(off('sim, live split', synced))}, and with the interval doubled "
        f"{span(off('same, sync 2S', synced))}: the simulator syncs every replica at one "
        f"instant (a decision reaches the others at most S later, S/2 on average), live "
        f"replicas each on their own phase, sending and reading in one round trip, so a "
        f"decision waits for its replica's sync and then for the reader's (up to 2S, S on "
        f"average, plus the round trip on a loaded loop). Service gap with the live split: "
        f"{ratio} (a maximum over one run, sampled on a 0.25 s grid while calm tenants wait "
        f"about 0.1 s: compare orders of magnitude). Calm TTFT: the simulator has no proxy, "
        f"HTTP or client cost, and live replicas share two cores."
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"
