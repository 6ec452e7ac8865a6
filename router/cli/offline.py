"""Offline commands: simulate a trace, compare policies, run the paper experiments, the demo,
and list what the simulator knows (policies, models, generators)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from dashboards.tables import class_rows, format_table, pool_rows, summary_row
from router.cli.args import (
    add_sim_args,
    add_trace_args,
    key_values,
    load_workload,
    print_config,
    run_simulation,
    sim_setup,
)
from router.cli.plan import add_plan_args, cmd_plan
from router.registry import call_with_params


def cmd_simulate(args: argparse.Namespace) -> int:
    from simulator.results import write_results

    autoscale = parse_autoscale(args.autoscale)  # a bad setting stops the run before it starts
    trace = load_workload(args)
    if args.print_config:
        from simulator.driver import SimCluster

        cluster = SimCluster(trace, *sim_setup(args, trace))
        print_config(cluster.policy.name, cluster.local_name, cluster.router_config)
        return 0
    if autoscale is None:
        result = run_simulation(args, trace)
    else:
        from simulator.driver import simulate

        cost, config = sim_setup(args, trace)
        try:
            config = replace(config, autoscale=autoscale)
        except ValueError as e:
            raise SystemExit(f"fairway: --autoscale: {e}") from None
        result = simulate(trace, cost, config)
    print(format_table([summary_row(args.policy, result.summary)]))
    if autoscale is not None:
        print(_gpu_hours(result.summary))
    classes = class_rows(args.policy, result.summary)
    if classes:
        print(format_table(classes))
    pools = pool_rows(args.policy, result.summary)
    if pools:
        print(format_table(pools))
    if args.fleet:
        print(format_table(group_rows(result.summary)))
        print(f"adapter loads (all engines): {result.summary['adapter_loads']}")
    if args.out:
        out = Path(args.out)
        write_results(out, result.summary, result.records)
        print(f"wrote {out / 'summary.json'} and {out / 'requests.csv'}")
    return 0


def parse_autoscale(spec: str | None):  # -> PlannerConfig | None
    """`--autoscale min=N,max=N,startup=S[,...]`; an error names the field."""
    if spec is None:
        return None
    from router.planner import PlannerConfig

    try:
        return PlannerConfig.parse(spec)
    except ValueError as e:
        raise SystemExit(f"fairway: --autoscale: {e}") from None


def _gpu_hours(summary: dict) -> str:
    """The autoscaled fleet's GPU-hours and the range of workers it served with."""
    serving = [active for _, active, _ in summary["workers_over_time"]]
    return (
        f"GPU-hours: {summary['gpu_seconds'] / 3600:.3f} "
        f"(serving {min(serving)} to {max(serving)} workers)"
    )


def group_rows(summary: dict) -> list[dict[str, object]]:
    """Per model group: its workers, requests and TTFT."""
    return [
        {
            "model group": name,
            "workers": group["workers"],
            "requests": group["requests"],
            "TTFT p50 s": group["ttft"]["p50"],
            "TTFT p99 s": group["ttft"]["p99"],
        }
        for name, group in summary["model_groups"].items()
    ]


def _simulate_one(args: argparse.Namespace, policy: str, out: str) -> tuple[str, dict]:
    """One policy of `fairway compare` (runs in a worker process or a Ray task): its folder,
    and its summary (for the command's progress bar)."""
    from simulator.driver import simulate
    from simulator.results import write_results

    trace = load_workload(args)
    cost, config = sim_setup(args, trace, policy)
    # The command's one bar counts this run as it returns; a worker draws none of its own.
    result = simulate(trace, cost, replace(config, show_progress=False))
    write_results(Path(out), result.summary, result.records)
    return out, result.summary


def cmd_compare(args: argparse.Namespace) -> int:
    from concurrent.futures import ProcessPoolExecutor

    import policies
    from dashboards.report import load_run, write_report
    from router.runtime.ray_tasks import ray_if_wanted
    from simulator.progress import command_bar, map_runs, summary_counts

    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in policies.global_policies]
    if unknown:
        raise ValueError(
            f"--policies: unknown {unknown}; one of {policies.global_policies.names()}"
        )
    out = Path(args.out)
    dirs = [str(out / name) for name in names]
    with ray_if_wanted(args.ray_address) as ray:
        if ray is not None:
            print(f"compare: runs as Ray tasks on the cluster at {ray.address}", file=sys.stderr)
        pool = ray or ProcessPoolExecutor(max_workers=min(len(names), args.jobs))
        with command_bar("compare", num_runs=len(names)), pool:
            map_runs(pool, _simulate_one, [args] * len(names), names, dirs, counts=summary_counts)
    runs = [load_run(d) for d in dirs]
    recording = Path(args.trace)
    if (recording / "trace.jsonl").exists() and (recording / "requests.csv").exists():
        runs.insert(0, load_run(recording))  # the proxy's own run beside what others would do
    print(format_table([summary_row(r.name, r.summary) for r in runs]))
    classes = [row for r in runs for row in class_rows(r.name, r.summary)]
    if classes:
        print(format_table(classes))
    report = write_report(runs, out / "report.html", title=f"Policies on {args.trace}")
    print(f"report: {report} (and {report.with_suffix('.md')})")
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    import policies
    from router.policy import GlobalPolicy

    for name in policies.global_policies.names():
        factory = policies.global_policies.get(name)
        doc = (factory.__doc__ or "").strip().splitlines()[0]
        # A factory is a policy class, or a function that pairs with the default discipline.
        local = getattr(factory, "default_local", GlobalPolicy.default_local)
        print(f"{name:14} {doc}  [local: {local}]")
    print("\nlocal disciplines: " + ", ".join(policies.local_policies.names()))
    return 0


def cmd_kv_transfer(args: argparse.Namespace) -> int:
    """How long a prompt's KV cache takes to move between GPUs on a network: alone on the same
    host and across hosts, and with `--concurrent` prompts leaving one host for another at once
    (sharing its links, as simulator.transfers does)."""
    import simpy

    from dashboards.tables import format_table
    from router.cost_model import MODELS
    from simulator.topology import Topology, kv_bytes
    from simulator.transfers import KVTransfers

    try:
        topology = Topology.named(args.topology, args.gpus)
    except ValueError as e:
        raise SystemExit(f"fairway: --topology: {e}") from None
    n, k = topology.num_gpus, args.concurrent
    # A GPU on another host: the farthest one from GPU 0 (the same host if there is one).
    far = max(range(n), key=lambda g: (len(topology.path(0, g)), g))
    per_token = MODELS[args.model].kv_bytes_per_token
    rows = []
    for tokens in args.tokens:
        nbytes = kv_bytes(tokens, per_token)
        env = simpy.Environment()
        transfers = KVTransfers(env, topology)
        # k flows from GPUs 0, 1, ... towards far, far - 1, ...: from the first host to the last
        pairs = [(i % n, (far - i) % n) for i in range(k)]
        for src, dst in pairs:
            transfers.send(src, dst, nbytes)
        env.run()
        rows.append(
            {
                "prompt tokens": tokens,
                "KV MB": nbytes / 1e6,
                "GPU 0 -> 1 ms": 1000 * topology.transfer_time(0, min(1, n - 1), nbytes),
                f"GPU 0 -> {far} ms": 1000 * topology.transfer_time(0, far, nbytes),
                f"{k} at once, slowest ms": 1000 * max(t.end - t.start for t in transfers.records),
            }
        )
    print(f"{args.model} ({per_token / 1024:.0f} KiB of KV a token) on {args.topology}, {n} GPUs")
    print(format_table(rows))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from router.cost_model import GPUS, MODELS

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

    params = key_values(args.set, "--set")
    params.setdefault("seed", args.seed)
    try:
        trace = call_with_params(GENERATORS[args.name], params, f"generator {args.name!r}")
    except ValueError as e:
        raise SystemExit(f"fairway: {e}") from None
    write_native(trace, Path(args.out))
    print(f"wrote {len(trace)} requests ({len(trace.clients)} clients) to {args.out}")
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from simulator.bench.experiments import NAMES, experiment_tables
    from simulator.progress import command_bar

    names = NAMES if args.name == "all" else [args.name]
    out = Path(args.out) if args.out else None
    with command_bar(f"experiment {args.name}"):
        for name in names:
            for title, rows in experiment_tables(name, seed=args.seed, out=out, quick=args.quick):
                print(f"## {name}: {title}\n")
                print(format_table(rows))
                print()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from simulator.bench.demo import run_demo

    return run_demo(workers=args.workers, out=Path(args.out))


def register(sub: argparse._SubParsersAction) -> None:
    from simulator.bench.experiments import NAMES
    from traces.generators import GENERATORS

    p = sub.add_parser("simulate", help="replay a trace on a simulated cluster")
    add_trace_args(p)
    add_sim_args(p)
    p.add_argument("--out", help="write summary.json and requests.csv into this folder")
    p.add_argument(
        "--print-config", action="store_true", help="print the router's effective settings and stop"
    )
    p.add_argument(
        "--autoscale",
        metavar="min=N,max=N,startup=S[,interval=S,...]",
        help="grow and shrink the fleet with the planner (replaces --workers): workers serve "
        "`startup` seconds after they start, cold, and drain before they stop; also "
        "interval, cooldown, step_down, history, headroom, high_water, low_water, tpot, initial "
        "(docs/experiments.md, Autoscaling a ramp)",
    )
    p.set_defaults(func=cmd_simulate, simulates=True)

    p = sub.add_parser("compare", help="run several policies on one trace, then a report")
    add_trace_args(p)
    add_sim_args(p)
    p.add_argument("--policies", required=True, help="comma-separated, e.g. lpm,preble,vtc")
    p.add_argument("--out", required=True, help="folder for the runs and report.html")
    p.add_argument("--jobs", type=int, default=2, help="parallel processes (without Ray)")
    p.add_argument("--ray-address", help="run the policies as Ray tasks on this cluster")
    p.set_defaults(func=cmd_compare, simulates=True)

    p = sub.add_parser(
        "plan", help="the fewest workers that serve a trace within TTFT and TPOT targets"
    )
    add_trace_args(p)
    add_sim_args(p)
    add_plan_args(p)
    p.set_defaults(func=cmd_plan, simulates=True)

    sub.add_parser("policies", help="list routing policies").set_defaults(func=cmd_policies)

    sub.add_parser("models", help="list model and GPU presets").set_defaults(func=cmd_models)

    p = sub.add_parser(
        "kv-transfer", help="how long a prompt's KV cache takes to move between GPUs"
    )
    p.add_argument(
        "--topology",
        default="dgx-h100",
        help="a preset (dgx-h100, h100-1nic, pcie-ethernet, single-host) or a topology YAML",
    )
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 6144, 32768])
    p.add_argument("--concurrent", type=int, default=8, help="prompts moving at once")
    p.set_defaults(func=cmd_kv_transfer)

    p = sub.add_parser("generate", help="write a synthetic workload as a native trace")
    p.add_argument("name", choices=sorted(GENERATORS))
    p.add_argument("--out", required=True)
    p.add_argument("--set", action="append", default=[], metavar="K=V")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("experiment", help="run a published-behaviour scenario across policies")
    p.add_argument("name", choices=[*NAMES, "all"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write each run's summary and the table into this folder")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the smallest configuration, where an experiment has one (priority: lpm only, "
        "1x and 10x the capacity, 20 s of arrivals; pd and agents: fewer requests and runs)",
    )
    p.set_defaults(func=cmd_experiment, simulates=True)

    p = sub.add_parser(
        "demo",
        help="every policy on the Mooncake sample and a shared-document workload: "
        "a table and a verdict each, then reports",
    )
    p.add_argument("--workers", type=int, default=8, help="simulated workers (default 8)")
    p.add_argument(
        "--out", default="build/demo", help="folder for the runs and reports (build/demo)"
    )
    p.set_defaults(func=cmd_demo, simulates=True)
