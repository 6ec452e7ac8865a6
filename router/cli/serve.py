"""Live commands: serve a fleet behind the proxy, replay a trace against it, profile a worker."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dashboards.tables import format_table, summary_row
from router.cli.args import add_trace_args, load_workload
from router.cli.offline import parse_autoscale


def cmd_serve(args: argparse.Namespace) -> int:
    """The composition root of a live fleet: config, router, workers, then the proxy."""
    import logging
    import shutil
    import tempfile

    from router.proxy.overload import raise_fd_limit
    from router.proxy.service.config import ClusterConfig
    from router.proxy.service.gcs_grace import GcsGrace
    from router.proxy.service.serve import add_workers, build_cluster, run_proxy
    from router.proxy.settings import SHUTDOWN_GRACE
    from workers.launch import model_dir_of, running_workers
    from workers.pool import outlast_gcs

    autoscale = parse_autoscale(args.autoscale)  # a bad setting stops the command before any work
    config: ClusterConfig = serve_config(args).with_salt()  # one salt, shared by replicas
    if autoscale is not None:
        from workers.scaled import check_scalable

        try:
            check_scalable(config)
        except ValueError as e:
            raise SystemExit(f"fairway: --autoscale: {e}") from None
    if args.print_config:
        from router.cli.args import print_config

        cluster = build_cluster(config)
        local = cluster.router.local_factory().name
        print_config(config.policy.name, local, cluster.router.config)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    raise_fd_limit()  # before the workers and replicas start: they inherit it
    cluster = build_cluster(config)  # first: a bad policy parameter fails before any work
    model_dirs = {g.served_model_name: model_dir_of(config, g) for g in config.groups}
    scratch = Path(tempfile.mkdtemp(prefix="fairway-"))
    gcs = GcsGrace(config.ray_gcs_grace)
    # Ray must not end this process before the grace and the stop after it are over.
    outlast_gcs(config.ray_gcs_grace + SHUTDOWN_GRACE + 30)
    try:
        if autoscale is not None:
            return _serve_scaled(config, autoscale, cluster, model_dirs, scratch, gcs)
        with running_workers(config, scratch, on_lost=gcs) as workers:
            if config.routers > 1:  # N proxy processes on one port
                from router.proxy.service.replicas import run_replicas

                return run_replicas(config, model_dirs, workers, scratch)
            add_workers(cluster, workers)
            return run_proxy(config, cluster, model_dirs, gcs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _serve_scaled(config, autoscale, cluster, model_dirs, scratch, gcs) -> int:
    """Serve with the planner sizing the fleet: its first workers started here, the others
    started and drained as it decides (router/proxy/autoscale.py)."""
    from router.planner import Planner
    from router.proxy.autoscale import LiveScaler
    from router.proxy.service.serve import add_workers, max_num_seqs_of, run_proxy
    from workers.scaled import scaled_workers

    with scaled_workers(config, autoscale, scratch, on_lost=gcs) as (workers, launcher):
        add_workers(cluster, workers)
        slots = {slot: wid for slot, wid in enumerate(sorted(cluster.workers))}
        planner = Planner(autoscale, cluster.router.config.cost, max_num_seqs_of(config))
        scaler = LiveScaler(cluster, planner, launcher, slots)
        return run_proxy(config, cluster, model_dirs, gcs, autoscaler=scaler)


def serve_config(args: argparse.Namespace):  # -> ClusterConfig
    """cluster.yaml (if given) with the command line's flags over it."""
    from router.proxy.service.config import load_config, validate_config

    overrides: dict[str, object] = {}
    if args.port is not None:
        overrides["port"] = args.port
    if args.routers is not None:
        overrides["routers"] = args.routers
    if args.ray_gcs_grace is not None:
        overrides["ray_gcs_grace"] = args.ray_gcs_grace
    if args.model:
        overrides["model"] = args.model
    workers: dict[str, object] = {}
    if args.backend:
        workers["backend"] = args.backend
    if args.workers is not None:
        workers["count"] = args.workers
    for role in ("prefill", "decode"):
        if (n := getattr(args, f"{role}_workers")) is not None:
            workers[role] = n
    if ("prefill" in workers or "decode" in workers) and "count" not in workers:
        workers["count"] = 0  # the roles' flags describe the fleet: mixed ones only by --workers
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
        return config
    policy = {"name": args.policy or "lpm"}
    if args.local_policy:
        policy["local"] = args.local_policy
    raw = {**overrides, "policy": policy, "workers": workers}
    if args.precise:
        raw["index_mode"] = "precise"
    return validate_config(raw, source="command line")


def cmd_replay(args: argparse.Namespace) -> int:
    import asyncio

    from simulator.hit_bound import InfiniteCache
    from simulator.results import summarize, write_results
    from traces.replay import replay

    trace = load_workload(args)
    out = Path(args.out)
    started = time.perf_counter()
    result = asyncio.run(replay(trace, args.url, out, closed_loop=args.closed_loop))
    bound = InfiniteCache(trace.block_size)
    for req in sorted(trace.requests, key=lambda r: r.arrival):
        bound.observe(req)
    records = sorted(result.records, key=lambda r: r.id)
    summary = summarize(
        records,
        [],
        total=len(trace),
        cache_bound=bound.hit_rate,
        simulated_seconds=max((r.finish for r in records), default=0.0),
        wall_seconds=time.perf_counter() - started,
        config={"live": True, "url": args.url, "trace": trace.source, "failures": result.failures},
    )
    write_results(out, summary, records)
    print(format_table([summary_row(out.name, summary)]))
    failed = ", ".join(f"{n} {reason}" for reason, n in sorted(result.failures.items()))
    print(f"{len(records)} of {len(trace)} requests answered; failed: {failed or 'none'}")
    print(f"wrote {out}/summary.json and requests.csv; `fairway report {out} SIM_RUN...`")
    return 0 if not result.failures else 1


def cmd_profile(args: argparse.Namespace) -> int:
    from workers.profiler import profile

    cost, measurements = profile(args.url, args.repeats)
    cost.save(Path(args.out), measurements)
    rows = [
        {
            "measured": (
                "request, prefill"
                if m.request
                else "decode step"
                if m.shape.num_decode_seqs
                else "prefill step"
            ),
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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start workers (through Ray) and the OpenAI proxy")
    p.add_argument("--config", help="cluster.yaml (everything; flags below override it)")
    p.add_argument(
        "--print-config", action="store_true", help="print the router's effective settings and stop"
    )
    p.add_argument("--backend", choices=["vllm", "emulated"])
    p.add_argument("--workers", type=int, help="mixed workers (prefill and decode both)")
    p.add_argument("--prefill-workers", type=int, help="workers that prefill only (a split fleet)")
    p.add_argument("--decode-workers", type=int, help="workers that decode only (a split fleet)")
    p.add_argument("--model", help="model folder (default: build the tiny test model)")
    p.add_argument("--policy")
    p.add_argument("--local-policy")
    p.add_argument("--port", type=int)
    p.add_argument("--precise", action="store_true", help="index from vLLM KV events")
    p.add_argument("--routers", type=int, help="proxy processes on the one port (replicas)")
    p.add_argument(
        "--ray-gcs-grace",
        type=float,
        metavar="SECONDS",
        help="serve on this long, degraded, once Ray's GCS is gone, then stop (default 60)",
    )
    p.add_argument(
        "--autoscale",
        metavar="min=N,max=N,startup=S[,interval=S,...]",
        help="size the fleet with the planner as `simulate --autoscale` does: start workers "
        "(up to max) and drain them (down to min); --workers is ignored",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("replay", help="send a trace to a live endpoint and record the run")
    add_trace_args(p)
    p.add_argument("--url", required=True, help="the proxy (or one OpenAI-compatible server)")
    p.add_argument("--out", required=True, help="folder for requests.csv (`fairway report` it)")
    p.add_argument("--seed", type=int, default=0, help="for generators and tenant assignment")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("profile", help="fit the simulator's step costs to a running server")
    p.add_argument("--url", required=True, help="an OpenAI-compatible vLLM (or emulated) server")
    p.add_argument("--repeats", type=int, default=2, help="rounds of measurements")
    p.add_argument("--out", required=True, help="profile JSON, for `simulate --cost`")
    p.set_defaults(func=cmd_profile)
