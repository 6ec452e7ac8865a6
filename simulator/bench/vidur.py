"""`fairway bench-vidur`: Fairway and Vidur side by side on the same requests and hardware model.

Vidur (the `vidur` package, in .venv-vidur: its pins must not touch Fairway's) runs in its own
interpreter through simulator/bench/vidur_side.py. Both simulate llama-3-8b on 8 A100-80G
replicas, round robin, chunked prefill with the same token budget and batch cap:

- Vidur's synthetic generator (Poisson arrivals, Zipf lengths) makes the requests; they are
  exported to Fairway's native trace and fed back to Vidur through its trace-replay generator, so
  both read the very same table;
- the whole Mooncake conversation trace, its lengths and arrivals handed to Vidur the same way.
  Vidur has no prefix cache, so Fairway replays it twice: lengths only, as Vidur sees it, and
  with its block hashes, as `fairway bench` does. Without the cache, 8 A100s fall behind that
  trace (KV runs out, sequences are preempted and recomputed): the simulated spans differ,
  and the preemptions column says how much of Fairway's work is recomputation.

Vidur's step times come from prediction tables it would download; here they are written from
Fairway's roofline (`prediction_tables`), so the two price a step alike. Each side is timed in
a fresh process: the event loop's CPU seconds, the output's after it (what each makes of its
records: Fairway's run summary, Vidur's metrics), and the whole process's (start-up, reading,
setup, writing), figures from one run, printed, never asserted.
"""

from __future__ import annotations

import csv
import lzma
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dashboards.tables import format_table
from router.cost_model import RooflineCost, StepShape, prefill_pairs, roofline
from router.request import Request
from router.runtime import native
from simulator.bench.speed import run_json
from simulator.progress import current
from traces.loaders import load_trace
from traces.schema import Trace, write_native

VIDUR_VENV = Path(".venv-vidur")
SIDE = Path(__file__).with_name("vidur_side.py")
TRACE_DATE = "2023-08-21"  # the day vidur_side.py stamps on rows; trace_replay keeps one day
WORKERS, MAX_NUM_SEQS, TOKEN_BUDGET = 8, 256, 8192  # Fairway's EngineConfig defaults
KV_GRANULARITY, CHUNK_GRANULARITY = 256, 32  # how Vidur rounds a lookup's context and chunk
# The per-layer operations Vidur adds up besides mlp_up_proj and attention: priced at nothing.
FREE_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_down_proj", "mlp_act", "attn_rope",
            "attn_kv_cache_save", "input_layernorm", "post_attention_layernorm", "add")  # fmt: skip
VIDUR_MODEL, VIDUR_DEVICE, VIDUR_NODE = "meta-llama/Llama-3-8B", "a100", "a100_dgx"


def read_vidur_requests(path: Path) -> Trace:
    """A trace-replay table (Time, PromptTokenCount, CompletionTokenCount) as Fairway's trace:
    ids in row order, arrivals rebased to the first, no prompt blocks (Vidur has no tokens)."""
    with path.open(newline="") as f:
        rows = [(float(r["Time"]), int(r["PromptTokenCount"]), int(r["CompletionTokenCount"]))
                for r in csv.DictReader(f)]  # fmt: skip
    start = min((t for t, _, _ in rows), default=0.0)
    requests = [Request(i, t - start, p, o) for i, (t, p, o) in enumerate(rows)]
    requests.sort(key=lambda r: r.arrival)
    return Trace(requests, source=str(path))


def write_vidur_requests(trace: Trace, path: Path) -> None:
    """Fairway's trace as the table Vidur's trace-replay generator reads (arrival, lengths)."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for r in trace.requests:
            out.writerow([TRACE_DATE, repr(r.arrival), r.prompt_len, r.output_len])


def prediction_tables(cost: RooflineCost, folder: Path, max_context: int) -> None:
    """Vidur's per-layer execution-time tables (milliseconds) from Fairway's roofline.

    Vidur adds per-operation times and multiplies by the layers; the roofline takes the larger of
    compute and memory. So one linear op carries the whole step of `n` tokens (weights or FLOPs,
    and the per-step overhead), and attention carries only what it adds on top of that: the same
    step with and without its (query, key) pairs and KV reads. The other ops cost nothing."""
    layers = cost.model.num_layers
    ms = 1000 / layers
    compute, network = folder / "compute", folder / "network"
    compute.mkdir(parents=True, exist_ok=True)
    network.mkdir(parents=True, exist_ok=True)
    tokens = range(1, TOKEN_BUDGET + MAX_NUM_SEQS + 1)
    tables: dict[str, dict[tuple[int, ...], float]] = {
        "mlp_up_proj": {(n,): cost.step_time(StepShape(n, 0, 0)) * ms for n in tokens}
    }
    for op in FREE_OPS:
        tables[op] = dict.fromkeys(((n,) for n in tokens), 0.0)
    contexts = range(0, max_context + KV_GRANULARITY, KV_GRANULARITY)
    prefill, decode = {}, {}
    for kv in contexts:
        for q in range(CHUNK_GRANULARITY, TOKEN_BUDGET + 1, CHUNK_GRANULARITY):
            with_pairs = cost.step_time(StepShape(q, prefill_pairs(q, kv), kv + q))
            prefill[(kv, q)] = (with_pairs - cost.step_time(StepShape(q, 0, 0))) * ms
        for b in range(1, MAX_NUM_SEQS + 1):
            with_reads = cost.step_time(StepShape(b, b * kv, b * kv, b))
            decode[(b, kv)] = (with_reads - cost.step_time(StepShape(b, 0, 0))) * ms
    tables["attn_prefill"], tables["attn_decode"] = prefill, decode
    for op, table in tables.items():
        width = len(next(iter(table)))
        with lzma.open(compute / f"{op}.csv.xz", "wt") as f:
            f.write(",".join(f"X_{i}" for i in range(width)) + ",prediction\n")
            f.writelines(",".join(map(str, k)) + f",{v!r}\n" for k, v in table.items())


def vidur_args(out: Path, max_tokens: int) -> list[str]:
    """Vidur's command line for the comparison's fleet: 8 replicas of one A100 each, round robin,
    Sarathi's chunked prefill with Fairway's token budget and batch cap. Its metrics are off
    (on the Mooncake replay they doubled its loop's time): Vidur runs its leanest."""
    predictor = "random_forrest_execution_time_predictor_config"
    return [
        "--replica_config_model_name", VIDUR_MODEL,
        "--replica_config_device", VIDUR_DEVICE,
        "--replica_config_network_device", VIDUR_NODE,
        "--replica_config_tensor_parallel_size", "1",
        "--replica_config_num_pipeline_stages", "1",
        "--replica_config_gpu_memory_utilization", "0.9",
        "--cluster_config_num_replicas", str(WORKERS),
        "--global_scheduler_config_type", "round_robin",
        "--replica_scheduler_config_type", "sarathi",
        "--sarathi_scheduler_config_chunk_size", str(TOKEN_BUDGET),
        "--sarathi_scheduler_config_batch_size_cap", str(MAX_NUM_SEQS),
        f"--{predictor}_prediction_max_batch_size", str(MAX_NUM_SEQS),
        f"--{predictor}_prediction_max_prefill_chunk_size", str(TOKEN_BUDGET),
        f"--{predictor}_prediction_max_tokens_per_request", str(max_tokens),
        f"--{predictor}_attention_decode_batching_overhead_fraction", "0",
        f"--{predictor}_cache_dir", str(out / "cache"),
        "--metrics_config_output_dir", str(out / "metrics"),
        "--no-metrics_config_write_metrics",
        "--no-metrics_config_enable_chrome_trace",
        "--no-metrics_config_store_plots",
    ]  # fmt: skip


FAIRWAY_RUN = """\
import json, os, sys, time
started = time.process_time()
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the fairway command runs
from router.runtime.arenas import use_huge_page_arenas
use_huge_page_arenas()  # as the fairway command does before it reads a trace
from router.cost_model import roofline
from simulator.config import SimConfig
from simulator.driver import simulate
from traces.loaders import load_trace
trace = load_trace(sys.argv[1])
config = SimConfig(num_workers=8, policy="round_robin")
cost = roofline("llama-3-8b", "a100-80g")
setup = time.process_time() - started
started = time.process_time()
s = simulate(trace, cost, config).summary
# The event loop, as Vidur's is timed: what the run then makes of its records (Fairway's summary,
# Vidur's metrics output) is output, not the loop.
loop = s["cpu_seconds"]
print(json.dumps({"requests": s["completed"], "loop_cpu": loop, "setup_cpu": setup,
                  "output_cpu": time.process_time() - started - loop,
                  "simulated_s": s["simulated_seconds"], "preemptions": s["preemptions"]}))
"""


def _fairway(trace: Trace, path: Path) -> tuple[dict, float]:
    """The simulator replaying `trace`, in a fresh process, from its native file."""
    write_native(trace, path)
    summary, cpu = run_json([sys.executable, "-c", FAIRWAY_RUN, str(path)])
    bar = current()
    if bar is not None:
        bar.run_done(summary["requests"], summary["simulated_s"])
    return summary, cpu


def _vidur(table: Path, work: Path, max_tokens: int) -> tuple[dict, float]:
    """Vidur replaying `table` through its trace-replay generator, lengths and times as given."""
    predictions = work / "predictions"
    prediction_tables(roofline("llama-3-8b", "a100-80g"), predictions, max_tokens)
    replay = [
        "--request_generator_config_type", "trace_replay",
        "--trace_request_generator_config_trace_file", str(table),
        "--trace_request_generator_config_date", TRACE_DATE,
        "--trace_request_generator_config_max_tokens", str(max_tokens),
        "--trace_request_generator_config_prefill_scale_factor", "1",
        "--trace_request_generator_config_decode_scale_factor", "1",
        "--trace_request_generator_config_time_scale_factor", "1",
    ]  # fmt: skip
    command = [str(VIDUR_VENV / "bin" / "python"), "-P", str(SIDE), "run", str(predictions),
               "--", *vidur_args(work / table.stem, max_tokens), *replay]  # fmt: skip
    return run_json(command, env={**os.environ, "WANDB_MODE": "disabled"})


def _row(name: str, fairway: tuple[dict, float], vidur: tuple[dict, float]) -> dict[str, object]:
    (f, f_cpu), (v, v_cpu) = fairway, vidur
    return {
        "workload": name,
        "requests": f"{f['requests']} / {v['requests']}",
        "loop CPU s": f"{f['loop_cpu']:.2f} / {v['loop_cpu']:.1f}",
        "loop x Vidur": v["loop_cpu"] / f["loop_cpu"],
        "output CPU s": f"{f['output_cpu']:.3f} / {v['output_cpu']:.3f}",
        "process CPU s": f"{f_cpu:.2f} / {v_cpu:.1f}",
        "process x Vidur": v_cpu / f_cpu,
        "simulated s": f"{f['simulated_s']:.0f} / {v['simulated_s']:.0f}",
        "Fairway preemptions": f["preemptions"],
    }


def _synthetic(work: Path, num_requests: int) -> Path:
    """Vidur's own synthetic requests (Poisson arrivals, Zipf lengths), as a trace-replay table."""
    table = work / "synthetic.csv"
    generator = [
        "--request_generator_config_type", "synthetic",
        "--synthetic_request_generator_config_num_requests", str(num_requests),
        "--length_generator_config_type", "zipf",
        "--zipf_request_length_generator_config_max_tokens", "8192",
        "--zipf_request_length_generator_config_min_tokens", "256",
        "--interval_generator_config_type", "poisson",
        "--poisson_request_interval_generator_config_qps", "40",
    ]  # fmt: skip
    command = [str(VIDUR_VENV / "bin" / "python"), "-P", str(SIDE), "generate", str(table),
               "--", *vidur_args(work / "generate", 8192), *generator]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"Vidur's generator failed:\n{done.stderr[-3000:]}")
    return table


def run_vidur_bench(trace: str | None = None, quick: bool = False) -> int:
    from simulator.bench.speed import DEFAULT_TRACE

    if not (VIDUR_VENV / "bin" / "python").exists():
        print(f"bench-vidur: skipped, no Vidur at {VIDUR_VENV} (`make bench` installs it)")
        return 0
    path = Path(trace) if trace else DEFAULT_TRACE
    rows = []
    with tempfile.TemporaryDirectory(prefix="fairway-vidur-") as folder:
        work = Path(folder)
        table = _synthetic(work, 2000 if quick else 10_000)
        requests = read_vidur_requests(table)
        longest = max(r.prompt_len + r.output_len for r in requests.requests)
        vidur = _vidur(table, work, longest)
        rows.append(_row("Vidur synthetic", _fairway(requests, work / "synthetic.jsonl"), vidur))
        if path.exists():
            mooncake = load_trace(path)
            if quick:
                mooncake.requests = mooncake.requests[:2000]
            plain = Trace([Request(r.id, r.arrival, r.prompt_len, r.output_len)
                           for r in mooncake.requests], source=str(path))  # fmt: skip
            table = work / "mooncake.csv"
            write_vidur_requests(plain, table)
            longest = max(r.prompt_len + r.output_len for r in plain.requests)
            vidur = _vidur(table, work, longest)
            lengths = _fairway(plain, work / "mooncake-lengths.jsonl")
            rows.append(_row("Mooncake, lengths only", lengths, vidur))
            cached = _fairway(mooncake, work / "mooncake.jsonl")
            rows.append(_row("Mooncake, Fairway with prefix cache", cached, vidur))
        else:
            print(f"bench-vidur: no trace at {path}; the Mooncake rows are left out")
    built = "compiled" if native.native_root() is not None else "plain Python"
    print("Fairway / Vidur 0.0.26 on the same requests: llama-3-8b on 8 A100-80G, round robin,")
    print(f"step times from one roofline; CPU seconds from one run each (Fairway {built});")
    print("x Vidur: Vidur's CPU seconds over Fairway's. loop: the event loop alone; output:")
    print("what each then makes of its records (Fairway's summary, Vidur's metrics). Vidur has")
    print("no prefix cache, so its Mooncake run is the lengths-only one in both rows.")
    print(format_table(rows))
    return 0
