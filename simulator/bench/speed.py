"""`make bench`: how fast the simulator replays, and where its time goes.

Figures are ratios and rates measured in one run on this machine; they are printed, never
asserted (the machines are shared and noisy).
"""

from __future__ import annotations

import contextlib
import cProfile
import json
import os
import pstats
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from dashboards.tables import format_table
from router.config import RouterConfig
from router.cost_model import roofline
from router.prefix_index import PrefixIndex
from router.request import Request
from router.runtime import native
from router.runtime.arenas import OFF
from router.runtime.processes import memory_mib
from router.view import ClusterView, WorkerState
from simulator.config import SimConfig
from simulator.driver import SimResult, simulate
from simulator.engine import EngineConfig
from traces.loaders import load_trace

DEFAULT_TRACE = Path("../shared/traces/mooncake/conversation_trace.jsonl")

# Where a profiled function's time is booked, by the file it lives in.
AREAS = {
    "simulator/engine.py": "engine (scheduling, stepping)",
    "simulator/block_manager.py": "KV block manager",
    "router/cost_model.py": "cost model",
    "simulator/driver.py": "router loop (view, dispatch)",
    "router/prefix_index.py": "prefix index",
    "router/": "router core (route, dispatch, load)",
    "policies/": "policies",
    "simpy/": "SimPy event loop",
    "simulator/environment.py": "SimPy event loop",  # its calls beside SimPy's events
}


def _replay(
    path: Path, policy: str = "least_load", limit: int | None = None, fast_forward: bool = True
) -> SimResult:
    trace = load_trace(path)
    if limit:
        trace.requests = trace.requests[:limit]
    config = SimConfig(num_workers=8, policy=policy, engine=EngineConfig(fast_forward=fast_forward))
    return simulate(trace, roofline("llama-3-8b", "a100-80g"), config)


def run_json(command: list[str], env: dict[str, str] | None = None) -> tuple[Any, float]:
    """What `command` prints last (JSON), and the CPU seconds its process took in all."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise RuntimeError(f"{command[:3]} failed:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(done.stdout.strip().splitlines()[-1]), cpu


def _in_subprocess(code: str, pure: bool, huge_pages: bool = True) -> object:
    """What `code` prints (JSON), run in a fresh interpreter: compiled, or plain Python; with
    the huge-page arenas the `fairway` command installs before a simulation, or without."""
    env = {k: v for k, v in os.environ.items() if k not in ("FAIRWAY_PURE", OFF)}
    if pure:
        env["FAIRWAY_PURE"] = "1"
    if not huge_pages:
        env[OFF] = "0"
    prologue = "from router.runtime.arenas import use_huge_page_arenas; use_huge_page_arenas()\n"
    return run_json([sys.executable, "-c", prologue + code], env)[0]


def compiled_vs_pure(path: Path, rounds: int) -> list[dict[str, object]]:
    """The whole replay's speed compiled (router.runtime.native) and as plain Python, in turns."""
    code = (
        "import json; from pathlib import Path; from simulator.bench.speed import _replay\n"
        f"s = _replay(Path({str(path)!r})).summary\n"
        "print(json.dumps(s['completed'] / s['wall_seconds']))"
    )
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for pure in (False, True):
            # Small pages on both sides: the figure is what compiling buys, nothing else.
            rate = _in_subprocess(code, pure, huge_pages=False)
            rates[pure].append(float(rate))  # type: ignore[arg-type]
    compiled, pure = statistics.median(rates[False]), statistics.median(rates[True])
    return [
        {
            "compiled req / wall s": compiled,
            "plain Python req / wall s": pure,
            "speed-up": compiled / pure,
            "rounds": rounds,
        }
    ]


def _profile_areas(path: Path) -> list[dict[str, object]]:
    profiler = cProfile.Profile()
    profiler.enable()
    _replay(path)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    booked: dict[str, float] = {}
    total = 0.0
    for (filename, _, _), (_, _, tottime, _, _) in stats.items():
        total += tottime
        area = next((a for key, a in AREAS.items() if key in filename), "other (python, numpy)")
        booked[area] = booked.get(area, 0.0) + tottime
    return [
        {"where": area, "share %": 100 * t / total}
        for area, t in sorted(booked.items(), key=lambda kv: -kv[1])
    ]


def build_index(num_blocks: int, num_workers: int, prompt_blocks: int, seed: int = 0):
    """An index of about `num_blocks` blocks over `num_workers` workers: documents sharing
    system-prompt trunks, each held by one or two workers."""
    rng = random.Random(seed)
    index = PrefixIndex()
    trunks = [[rng.getrandbits(63) for _ in range(rng.randint(8, 64))] for _ in range(64)]
    prompts = []
    while sum(index.num_blocks(w) for w in range(num_workers)) < num_blocks:
        trunk = rng.choice(trunks)
        prompt = trunk + [rng.getrandbits(63) for _ in range(prompt_blocks - len(trunk))]
        for w in rng.sample(range(num_workers), rng.choice((1, 1, 2))):
            index.insert(prompt, w, now=float(len(prompts)))
        prompts.append(prompt)
    return index, prompts, trunks


def decision_times(repeats: int = 2000) -> list[dict[str, object]]:
    """route() latency per policy: an 8k-token prompt against 1M indexed blocks, 16 workers."""
    import policies

    bs, num_workers, prompt_blocks = 16, 16, 8192 // 16
    index, prompts, trunks = build_index(1_000_000, num_workers, prompt_blocks)
    rng = random.Random(1)
    cost = roofline("llama-3-8b", "a100-80g")
    held = [index.num_blocks(w) for w in range(num_workers)]
    # Queues balanced (so LPM matches rather than falling back to the shortest queue); half the
    # workers are full, so Preble's explore step prices evictions.
    workers = {
        w: WorkerState(
            w,
            num_waiting=rng.randint(0, 8),
            num_running=rng.randint(24, 40),
            tokens_in_flight=rng.randint(0, 200_000),
            kv_capacity_blocks=held[w] if w % 2 else 2 * held[w],
        )
        for w in range(num_workers)
    }
    view = ClusterView(float(len(prompts)), workers, index, bs, cost)
    requests = []
    for i in range(repeats):
        if i % 2:  # a cached document plus a new question
            blocks = rng.choice(prompts)[: prompt_blocks - 8] + [rng.getrandbits(63)] * 8
        else:  # a new document on a known trunk: explore territory
            trunk = rng.choice(trunks)
            blocks = trunk + [rng.getrandbits(63) for _ in range(prompt_blocks - len(trunk))]
        requests.append(Request(i, 0.0, 8192 + 7, 128, blocks, client=f"c{i % 8}"))

    rows = []
    for name in policies.global_policies.names():
        policy = policies.global_policies.create(name)
        times = []
        for r in requests:
            started = time.perf_counter_ns()
            policy.route(r, view)
            times.append(time.perf_counter_ns() - started)
        times_us = np.array(times) / 1000
        rows.append(
            {
                "policy": name,
                "p50 us": float(np.percentile(times_us, 50)),
                "p99 us": float(np.percentile(times_us, 99)),
                "max us": float(times_us.max()),
            }
        )
    return rows


def fleet_scaling(
    path: Path,
    sizes: tuple[int, ...] = (8, 64, 512),
    method: str = "squeeze",
    limit: int | None = None,
    tile_seconds: float = 120.0,
    rounds: int = 3,
    min_round_cpu: float = 1.0,
    policies: tuple[str, ...] = ("round_robin", "least_load", "vtc", "lpm", "d2lpm", "preble"),
    ratio: tuple[int, int] | None = None,
) -> list[dict[str, object]]:
    """Simulated requests per CPU second as the fleet grows, the request rate scaled with it
    so that each worker's load stays the same (the Mooncake conversation trace).

    The sizes take turns, `rounds` times (8, 64, 512, 8, 64, 512, ...), each turn run until
    it took `min_round_cpu` of CPU (at least once); a size's rate is the median of its turns,
    and the ratio the median of the rounds' ratios. A stall of this shared machine then slows
    one turn of each size rather than every run of one: run size after size, one table
    printed round robin's 512-worker speed at 1.05x its 8-worker speed, the run before 0.76x.

    "squeeze": the whole trace, its time compressed by W / 8. The hour squeezed into a minute
    on 512 workers leaves each engine 23 requests and smaller batches, so it simulates more
    steps per request: the steps column says how much of a slowdown is the engines' own work.
    "tile": the trace's first `tile_seconds`, W / 8 copies side by side (traces.transform.tile):
    each worker sees the same load and history at every size, the steps per request stay
    flat, and what is left of a slowdown is the cost of the fleet itself.

    `ratio` (small, large): the sizes whose speeds are compared (default: the first and last)."""
    from traces.transform import scale_rate, tile, window

    def trace_for(workers: int):  # both rewrite the trace in place: a fresh load each
        trace = load_trace(path)
        if limit:
            trace.requests = trace.requests[:limit]
        if method == "squeeze":
            return scale_rate(trace, workers / sizes[0])
        return tile(window(trace, 0.0, tile_seconds), workers // sizes[0])

    def turn(policy: str, workers: int) -> tuple[float, float]:
        """Requests per CPU second over runs taking `min_round_cpu`, and steps per request."""
        spent, done = 0.0, 0
        while done == 0 or spent < min_round_cpu:
            trace = trace_for(workers)
            started = time.process_time()
            result = simulate(trace, cost, SimConfig(num_workers=workers, policy=policy))
            spent += time.process_time() - started
            done += len(trace)
        return done / spent, sum(w.steps for w in result.workers) / len(trace)

    cost = roofline("llama-3-8b", "a100-80g")
    first, last = ratio or (sizes[0], sizes[-1])
    rows = []
    for policy in policies:
        rates: dict[int, list[float]] = {w: [] for w in sizes}
        steps: dict[int, float] = {}
        for _ in range(rounds):
            for workers in sizes:
                rate, steps[workers] = turn(policy, workers)
                rates[workers].append(rate)
        row: dict[str, object] = {"policy": policy}
        for workers in sizes:
            row[f"{workers} workers req/s"] = statistics.median(rates[workers])
        ratios = [b / a for a, b in zip(rates[first], rates[last], strict=True)]
        row[f"{last} / {first}"] = statistics.median(ratios)
        row[f"{last} / {first} range"] = f"{min(ratios):.2f}-{max(ratios):.2f}"
        row[f"steps per request, {first} -> {last}"] = f"{steps[first]:.0f} -> {steps[last]:.0f}"
        rows.append(row)
    return rows


def tiled_replay(
    workers: int, policy: str, path: Path, seconds: float = 120.0, floors: bool = True
) -> dict:
    """One replay of the trace's first `seconds` tiled to `workers` (llama-3-8b on H100), run
    where this process is: requests, CPU seconds, requests per CPU second, and the process's
    peak resident memory (MB) once it is done. `floors`: SimConfig.load_floors."""
    from traces.transform import tile, window

    trace = tile(window(load_trace(path), 0.0, seconds), workers // 8)
    config = SimConfig(num_workers=workers, policy=policy, load_floors=floors)
    started = time.process_time()
    result = simulate(trace, roofline("llama-3-8b", "h100"), config)
    cpu = time.process_time() - started
    done = result.summary["completed"]
    peak = _peak_rss_mb()
    name = policy if floors else f"{policy}, every engine per decision"
    return {"workers": workers, "policy": name, "requests": done, "CPU s": cpu,
            "req / CPU s": done / cpu, "peak RSS MB": peak}  # fmt: skip


def _peak_rss_mb() -> float:
    """This process's peak resident memory, MB: its own address space's (VmHWM), since the
    rusage peak of a child of a large process keeps the parent's from before exec."""
    peak = memory_mib("VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def large_replays(
    path: Path, runs: tuple[tuple[int, str, bool, bool], ...]
) -> list[dict[str, object]]:
    """`tiled_replay` of each (workers, policy, load floors, huge-page arenas), each in a fresh
    interpreter (so that its peak memory is its own), compiled if a compiled build is in use."""
    pure = native.native_root() is None
    rows = []
    for workers, policy, floors, huge_pages in runs:
        code = (
            "import json; from pathlib import Path; from simulator.bench import speed\n"
            f"print(json.dumps(speed.tiled_replay({workers}, {policy!r}, "
            f"Path({str(path)!r}), floors={floors})))"
        )
        row = _in_subprocess(code, pure, huge_pages)
        if not huge_pages:
            row["policy"] += ", small pages"  # type: ignore[index]
        rows.append(row)
    return rows  # type: ignore[return-value]


def decision_tail(num_requests: int = 20_000) -> list[dict[str, object]]:
    """Router.route end to end (policy, index insert and eviction, hooks) against a 1M-block
    index on 16 workers, each request finished right after: the tail with the collector as it
    is, and paced as the live proxy paces it (router.runtime.collector; freezing every second, not
    ten, so that this run sees it). Per decision, wall time and the thread's CPU time (which a busy
    machine's scheduler does not inflate); per mode, the collector's passes and the longest."""
    import gc

    import policies
    from router.core import Router
    from router.runtime.collector import CollectorPacing

    bs, num_workers, prompt_blocks = 16, 16, 8192 // 16
    rows = []
    for mode in ("default collector", "CollectorPacing"):
        gc.collect()
        index, prompts, trunks = build_index(1_000_000, num_workers, prompt_blocks)
        router = Router(
            policies.global_policies.create("lpm"),
            lambda: policies.local_policies.create("lpm"),
            RouterConfig(block_size=bs, window=4, cost=roofline("llama-3-8b", "a100-80g")),
        )
        router.view.index = router.indexes.approximate = index
        for w in range(num_workers):
            router.add_worker(w, kv_capacity_blocks=index.num_blocks(w))
        pacing = CollectorPacing(every=1.0) if mode == "CollectorPacing" else None
        rng = random.Random(2)
        wall, cpu = np.empty(num_requests), np.empty(num_requests)
        now = float(len(prompts))
        with _collector_passes() as passes:
            for i in range(num_requests):
                doc = rng.choice(prompts)
                shared = _rehashed(doc[: prompt_blocks - 8])
                blocks = shared + [rng.getrandbits(63) for _ in range(8)]
                request = Request(i, now, 8192 + 7, 128, blocks, client=f"c{i % 8}")
                now += 0.001
                started_cpu = time.thread_time_ns()  # a system call: outside the wall time
                started = time.perf_counter_ns()
                if pacing is not None:
                    pacing.tick(time.monotonic())
                routed = router.route(request, now)
                wall[i] = time.perf_counter_ns() - started
                cpu[i] = time.thread_time_ns() - started_cpu
                for r in routed.released:
                    router.finish(r, now)
        if pacing is not None:
            pacing.stop()
        us = wall / 1000
        rows.append(
            {
                "collector": mode,
                "p50 us": float(np.percentile(us, 50)),
                "p99 us": float(np.percentile(us, 99)),
                "p99.9 us": float(np.percentile(us, 99.9)),
                "max us": float(us.max()),
                "p99.9 cpu us": float(np.percentile(cpu, 99.9)) / 1000,
                "passes gen 0/1/2": "/".join(str(len(p)) for p in passes),
                "longest pass cpu us": max(max(p, default=0) for p in passes) / 1000,
            }
        )
        del router, index, prompts
    return rows


def decision_groups(
    num_requests: int = 20_000, groups: int = 8, adapters: int = 1000, workers: int = 64
) -> list[dict[str, object]]:
    """Router.route end to end on one fleet of `workers`: serving `groups` model groups and
    `adapters` LoRA adapters (Zipf popularity, 8 slots a worker) against serving one model,
    each request finished once released. Under adapters the same documents are many more
    distinct prefixes (one per adapter), so the index inserts and evicts more: the middle row
    routes the very same cache keys as one model, which leaves the cost of knowing the groups
    and adapters. Hashing a prompt under its identity is the proxy's work before routing:
    done outside the timed call."""
    import policies
    from router.core import Router
    from router.request import cache_root, rekey_blocks

    bs = 16
    rng = random.Random(3)
    docs = _documents(rng)
    popularity = np.array([1 / (k + 1) for k in range(adapters)])
    popularity /= popularity.sum()
    picks = np.random.default_rng(4).choice(adapters, size=num_requests, p=popularity)
    chosen = [random.Random(5).randrange(len(docs)) for _ in range(num_requests)]
    keyed = [
        rekey_blocks(docs[d], cache_root(f"m{a % groups}", f"a{a}"))
        for d, a in zip(chosen, picks, strict=True)
    ]
    modes = ("one model", "one model, keys as below", f"{groups} groups, {adapters} adapters")
    rows = []
    for policy in ("lpm", "least_load"):
        for mode in modes:
            several = mode == modes[2]
            router = Router(
                policies.global_policies.create(policy),
                lambda: policies.local_policies.create("fcfs"),
                RouterConfig(
                    block_size=bs,
                    window=4,
                    cost=roofline("llama-3-8b", "a100-80g"),
                    adapter_load_time=0.2,
                ),
            )
            for w in range(workers):
                model = f"m{w % groups}" if several else None
                router.add_worker(w, 20_000, model=model, adapter_slots=8 if several else 0)
            wall = np.empty(num_requests)
            for i in range(num_requests):
                now, doc = 0.001 * i, docs[chosen[i]]
                prompt_len, client = len(doc) * bs + 7, f"c{i % 8}"
                if mode == modes[0]:
                    request = Request(i, now, prompt_len, 64, _rehashed(doc), client)
                elif mode == modes[1]:
                    request = Request(i, now, prompt_len, 64, _rehashed(keyed[i]), client)
                else:
                    model, adapter = f"m{picks[i] % groups}", f"a{picks[i]}"
                    request = Request(i, now, prompt_len, 64, _rehashed(keyed[i]), client,
                                      model=model, adapter=adapter)  # fmt: skip
                started = time.perf_counter_ns()
                routed = router.route(request, now)
                wall[i] = time.perf_counter_ns() - started
                for r in routed.released:
                    router.finish(r, now)
            us = wall / 1000
            rows.append(
                {
                    "policy": policy,
                    "fleet": mode,
                    "p50 us": float(np.percentile(us, 50)),
                    "p99 us": float(np.percentile(us, 99)),
                    "adapter loads": router.adapters.loads,
                }
            )
        base, same_keys, grouped = rows[-3:]
        for row in (base, same_keys, grouped):
            row["p99 / one model"] = row["p99 us"] / base["p99 us"]
            row["p99 / same keys"] = row["p99 us"] / same_keys["p99 us"]
    return rows


def decision_classes(num_requests: int = 20_000, workers: int = 64) -> list[dict[str, object]]:
    """Router.route end to end on `workers` with lpm, plain and with traffic classes on: two
    strict bands with a TTFT prediction for every request, then routing by that prediction
    (every healthy worker's predicted TTFT, one index walk), then each request's tenant budget
    checked first (router.budgets, as the proxy does before routing), timed together."""
    import policies
    from router.budgets import Budgets, RateLimit
    from router.classes import ClassTable, TrafficClass
    from router.core import Router

    bs = 16
    rng = random.Random(3)
    docs = _documents(rng)
    chosen = [rng.randrange(len(docs)) for _ in range(num_requests)]
    classes = ClassTable(
        [TrafficClass("interactive", 0, ttft=2.0, tpot=0.1), TrafficClass("batch", 1)]
    )
    limit = RateLimit(requests_per_s=1e6, input_tokens_per_min=1e9, output_tokens_per_min=1e9)
    modes = ("plain lpm", "classes", "classes + latency routing", "... + tenant budgets")
    rows = []
    for mode in modes:
        on = mode != modes[0]
        router = Router(
            policies.global_policies.create("lpm"),
            lambda: policies.local_policies.create("fcfs"),
            RouterConfig(
                block_size=bs,
                window=4,
                cost=roofline("llama-3-8b", "a100-80g"),
                classes=classes if on else None,
                latency_routing=mode in modes[2:],
            ),
        )
        budgets = Budgets({f"c{k}": limit for k in range(8)}) if mode == modes[3] else None
        for w in range(workers):
            router.add_worker(w, 20_000)
        wall = np.empty(num_requests)
        for i in range(num_requests):
            now, doc = 0.001 * i, docs[chosen[i]]
            client = f"c{i % 8}"
            request = Request(i, now, len(doc) * bs + 7, 64, _rehashed(doc), client,
                              priority=int(on and i % 5 == 0))  # fmt: skip
            started = time.perf_counter_ns()
            if budgets is not None:
                budgets.admit(client, request.prompt_len, now)
            routed = router.route(request, now)
            wall[i] = time.perf_counter_ns() - started
            for r in routed.released:
                router.finish(r, now)
        us = wall / 1000
        rows.append({"mode": mode, "p50 us": float(np.percentile(us, 50)),
                     "p99 us": float(np.percentile(us, 99))})  # fmt: skip
    for row in rows:
        row["p99 / plain lpm"] = row["p99 us"] / rows[0]["p99 us"]
    return rows


def replay_classes(path: Path, limit: int | None = None) -> list[dict[str, object]]:
    """The Mooncake replay (8 workers, lpm) with and without traffic classes: every fifth
    request in a batch band, a TTFT target on the other, routed by predicted latency."""
    from router.classes import TrafficClass

    classes = (TrafficClass("interactive", 0, ttft=2.0, tpot=0.1), TrafficClass("batch", 1))
    rows = []
    for mode in ("plain", "classes + latency routing"):
        trace = load_trace(path)
        if limit:
            trace.requests = trace.requests[:limit]
        on = mode != "plain"
        if on:
            for r in trace.requests:
                r.priority = int(r.id % 5 == 0)
        config = SimConfig(num_workers=8, policy="lpm", classes=classes if on else (),
                           latency_routing=on)  # fmt: skip
        started = time.process_time()
        result = simulate(trace, roofline("llama-3-8b", "a100-80g"), config)
        cpu = time.process_time() - started
        rows.append({"mode": mode, "requests": result.summary["completed"],
                     "req / CPU s": result.summary["completed"] / cpu})  # fmt: skip
    rows[1]["x plain"] = rows[1]["req / CPU s"] / rows[0]["req / CPU s"]
    return rows


def replay_split(
    path: Path, sizes: tuple[int, ...] = (8, 64), seconds: float = 120.0, rounds: int = 3
) -> list[dict[str, object]]:
    """Simulated requests per CPU second of a split fleet (a quarter of it prefilling, on
    dgx-h100's network) against the same number of mixed workers, lpm, on the Mooncake
    conversation trace's first `seconds` tiled to the fleet (as `fleet_scaling` does): the
    split run's handoffs and KV transfers against the mixed run's, per request, and whether
    that cost grows with the fleet. Mixed and split take turns; medians of `rounds`."""
    from traces.transform import tile, window

    cost = roofline("llama-3-8b", "h100")
    rates: dict[tuple[int, str], list[float]] = {}
    for _ in range(rounds):
        for workers in sizes:
            for fleet, prefill in (("mixed", 0), ("split", workers // 4)):
                trace = tile(window(load_trace(path), 0.0, seconds), workers // 8)
                config = SimConfig(num_workers=workers, policy="lpm", prefill_workers=prefill,
                                   decode_workers=workers - prefill if prefill else 0)  # fmt: skip
                started = time.process_time()
                result = simulate(trace, cost, config)
                spent = time.process_time() - started
                rates.setdefault((workers, fleet), []).append(result.summary["completed"] / spent)
    rows = []
    for workers in sizes:
        mixed = statistics.median(rates[(workers, "mixed")])
        split = statistics.median(rates[(workers, "split")])
        rows.append({"workers": workers, "split P:D": f"{workers // 4}:{workers - workers // 4}",
                     "mixed req / CPU s": mixed, "split req / CPU s": split,
                     "split / mixed": split / mixed})  # fmt: skip
    return rows


def _documents(rng: random.Random) -> list[list[int]]:
    """512 documents of 256 to 2,048 tokens, as block hashes: what the decision benches route."""
    return [[rng.getrandbits(63) for _ in range(rng.randint(16, 128))] for _ in range(512)]


def _rehashed(hashes: list[int]) -> list[int]:
    """The same hashes as new int objects, as hashing a prompt makes them (hash_token_blocks):
    the index's own objects would let every comparison skip reading its keys."""
    return [int.from_bytes(h.to_bytes(8, "little"), "little") for h in hashes]


@contextlib.contextmanager
def _collector_passes():
    """The collector's passes meanwhile, by generation: the thread's CPU time (ns) each took."""
    import gc

    passes: list[list[int]] = [[], [], []]
    started = 0

    def timed(phase: str, info: dict) -> None:
        nonlocal started
        if phase == "start":
            started = time.thread_time_ns()
        else:
            passes[info["generation"]].append(time.thread_time_ns() - started)

    gc.callbacks.append(timed)
    try:
        yield passes
    finally:
        gc.callbacks.remove(timed)


def run_bench(trace: str | None = None, quick: bool = False) -> int:
    path = Path(trace) if trace else DEFAULT_TRACE
    if not path.exists():
        print(f"bench: no trace at {path} (pass --trace PATH to the Mooncake conversation trace)")
        return 2
    repeats = 1 if quick else 3

    built = "compiled" if native.native_root() is not None else "plain Python"
    print(f"Mooncake conversation replay: {path}, 8 workers, least_load, llama-3-8b on A100-80G")
    print(f"(hot modules {built}; every table below but the profile runs so)")
    rates, result = [], None
    for _ in range(repeats):
        result = _replay(path)
        rates.append(result.summary["completed"] / result.summary["wall_seconds"])
    assert result is not None
    s = result.summary
    events = sum(w.events for w in result.workers)
    steps = sum(w.steps for w in result.workers)
    best = max(rates)
    print(
        format_table(
            [
                {
                    "requests": s["completed"],
                    "simulated s": s["simulated_seconds"],
                    "wall s (best)": s["completed"] / best,
                    "req / wall s (best)": best,
                    "req / wall s (median)": statistics.median(rates),
                    "engine steps": steps,
                    "step events": events,
                    "steps per event": steps / events,
                }
            ]
        )
    )

    print("\nFast-forward against step-by-step (first 1,500 requests, same run):")
    started = time.perf_counter()
    fast = _replay(path, limit=1500)
    t_fast = time.perf_counter() - started
    started = time.perf_counter()
    slow = _replay(path, limit=1500, fast_forward=False)
    t_slow = time.perf_counter() - started
    print(
        format_table(
            [
                {
                    "fast-forward wall s": t_fast,
                    "step-by-step wall s": t_slow,
                    "speed-up": t_slow / t_fast,
                    "identical records": fast.records == slow.records,
                }
            ]
        )
    )

    print(
        "\nCompiled (mypyc, router/runtime/native.py) against plain Python, whole replay, in turns:"
    )
    if native.native_root() is None:
        print("(no compiled build in use: `make bench` builds it; FAIRWAY_PURE unset)")
    else:
        print(format_table(compiled_vs_pure(path, 1 if quick else 3)))

    print("\nWhere the time goes (cProfile over plain Python, own time by area; profiling")
    print("inflates call costs):")
    code = (
        "import json; from pathlib import Path; from simulator.bench.speed import _profile_areas\n"
        f"print(json.dumps(_profile_areas(Path({str(path)!r}))))"
    )
    print(format_table(_in_subprocess(code, pure=True)))  # type: ignore[arg-type]

    seconds, rounds = (30.0, 1) if quick else (120.0, 3)
    print("\nFleet size (Mooncake conversation, rate scaled with the workers; simulated requests")
    print(f"per CPU second, the sizes taking {rounds} turns of 1 s of CPU or more; medians)")
    print("squeezed: the whole trace, time compressed by workers / 8:")
    print(
        format_table(
            fleet_scaling(path, method="squeeze", limit=3000 if quick else None, rounds=rounds)
        )
    )
    print(f"tiled: its first {seconds:.0f} s, workers / 8 copies side by side (--tile):")
    sizes = (8, 64, 512) if quick else (8, 64, 512, 1024)
    tiled = fleet_scaling(path, sizes, method="tile", tile_seconds=seconds, rounds=rounds,
                          policies=("round_robin", "least_load", "lpm", "vtc"),
                          ratio=(8, 512))  # fmt: skip
    print(format_table(tiled))
    print("\nOne large replay each, in a fresh process: the first 120 s tiled to the fleet,")
    print("llama-3-8b on H100 (`fairway simulate --window 0:120 --tile W/8 --workers W`);")
    print("least_load again on pymalloc's own arenas (FAIRWAY_HUGE_PAGES=0), and with every")
    print("engine brought up to date per decision (--no-load-floors):")
    size = 512 if quick else 1024
    runs = (
        (size, "least_load", True, True),
        (size, "least_load", True, False),
        (size, "least_load", False, True),
        (size, "round_robin", True, True),
    )
    print(format_table(large_replays(path, runs)))

    print("\nRouting decision time: 8k-token prompt, index of 1M blocks over 16 workers:")
    print(format_table(decision_times(500 if quick else 2000)))

    print("\nDecision tail through the router core (route + index update + hooks), 1M blocks:")
    print(format_table(decision_tail(5_000 if quick else 20_000)))

    print("\nDecision time with model groups and LoRA adapters, 64 workers (router core):")
    print(format_table(decision_groups(5_000 if quick else 20_000)))

    print("\nDecision time with traffic classes, predicted-latency routing and tenant budgets,")
    print("64 workers, lpm (router core; target: p99 under 1.3x plain lpm's):")
    print(format_table(decision_classes(5_000 if quick else 20_000)))
    print("\nMooncake replay with traffic classes (8 workers, lpm):")
    print(format_table(replay_classes(path, limit=5000 if quick else None)))
    print("\nSplit prefill/decode against mixed, same GPUs, same trace (Mooncake, first")
    print("120 s tiled to the fleet, lpm; target: split within 1.5x of mixed's speed, not")
    print("falling with the fleet):")
    print(format_table(replay_split(path, rounds=1 if quick else 3)))
    return 0
