"""Arguments several commands share: a trace to load and a simulated cluster to run it on."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from router.registry import call_with_params
from router.traits import IndexMode, Placement


def key_values(items: Sequence[str], what: str) -> dict[str, object]:
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
    from router.cost_model import GPUS, MODELS

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
    g.add_argument(
        "--workers",
        type=int,
        help="mixed workers, each prefilling and decoding (default 8, or 0 beside "
        "--prefill-workers and --decode-workers)",
    )
    g.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        metavar="P",
        help="workers that only prefill, handing each prompt's KV to a decode worker",
    )
    g.add_argument(
        "--decode-workers", type=int, default=0, metavar="D", help="workers that only decode"
    )
    g.add_argument(
        "--topology",
        default="dgx-h100",
        metavar="PRESET|FILE.yaml",
        help="the network a split fleet's KV crosses, worker i on GPU i: a preset (dgx-h100, "
        "h100-1nic, pcie-ethernet, single-host) or a YAML file (simulator/topology.py)",
    )
    g.add_argument(
        "--kv-bytes-per-token",
        type=int,
        metavar="BYTES",
        help="a token's KV on the wire (default: the --model's; needed with --cost)",
    )
    g.add_argument(
        "--fleet",
        metavar="FLEET.yaml",
        help="model groups, each with its workers, model, gpu, tp or profile and LoRA adapter "
        "slots (see simulator/fleet.py); replaces --workers, --model, --gpu, --tp and --cost. "
        "With several groups every request must name its group (the trace's `model` field)",
    )
    g.add_argument(
        "--index",
        choices=[mode.value for mode in IndexMode],
        default=IndexMode.APPROXIMATE.value,
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
        choices=[place.value for place in Placement],
        default=Placement.ENGINE.value,
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
    g.add_argument(
        "--no-load-floors",
        action="store_true",
        help="bring every engine up to date before each least-load decision, not only those "
        "that could be least (slower on large fleets; for checking)",
    )
    g.add_argument("--seed", type=int, default=0)

    c = p.add_argument_group("traffic classes")
    c.add_argument(
        "--class",
        dest="classes",
        action="append",
        default=[],
        metavar="NAME:K=V,...",
        help="a traffic class found by its priority (lower served first), with optional "
        "targets: e.g. interactive:priority=0,ttft=1,tpot=0.1,max_queue_time=5",
    )
    c.add_argument(
        "--latency-routing",
        action="store_true",
        help="route a class with a TTFT target among the workers predicted to meet it",
    )
    c.add_argument(
        "--admission",
        action="store_true",
        help="refuse requests no worker is predicted to serve within their class's TTFT "
        "target, and those waiting past its max_queue_time",
    )
    c.add_argument(
        "--rate-limit",
        action="append",
        default=[],
        metavar="CLIENT:K=V,...",
        help="a tenant's budget, e.g. team-a:requests_per_s=2,burst=4,input_tokens_per_min="
        "60000,output_tokens_per_min=20000; requests past it are refused (429 live)",
    )
    c.add_argument(
        "--no-priority-scheduling",
        action="store_true",
        help="engines preempt the latest admitted, not the lowest priority (vLLM's fcfs)",
    )


def traffic_classes(items: Sequence[str]):  # -> tuple[TrafficClass, ...]
    """`--class NAME:K=V,...` as traffic classes; errors name the class and field."""
    from router.classes import ClassTable

    raw: dict[str, dict[str, object]] = {}
    for item in items:
        name, _, fields = item.partition(":")
        if not name:
            raise SystemExit(f"fairway: --class: expected NAME:K=V,..., got {item!r}")
        raw[name] = key_values([f for f in fields.split(",") if f], f"--class {name}")
    try:
        return tuple(ClassTable.of(raw))
    except (TypeError, ValueError) as e:
        raise SystemExit(f"fairway: --class: {e}") from None


def rate_limits(items: Sequence[str]):  # -> dict[str, RateLimit]
    """`--rate-limit CLIENT:K=V,...` as tenant budgets; errors name the client and field."""
    from router.budgets import RateLimit

    out = {}
    for item in items:
        client, _, fields = item.partition(":")
        if not client:
            raise SystemExit(f"fairway: --rate-limit: expected CLIENT:K=V,..., got {item!r}")
        params = key_values([f for f in fields.split(",") if f], f"--rate-limit {client}")
        try:
            out[client] = RateLimit(**params)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise SystemExit(f"fairway: --rate-limit {client}: {e}") from None
    return out


def load_workload(args: argparse.Namespace):  # -> Trace
    """The trace the arguments name, transformed as they ask."""
    from router.runtime.collector import paced_for_throughput

    # A trace is millions of objects that all live on (a million requests tiled: a third of
    # the time building it went to the collector walking them again and again).
    with paced_for_throughput():
        return _workload(args)


def _workload(args: argparse.Namespace):  # -> Trace
    from traces import transform
    from traces.generators import GENERATORS
    from traces.loaders import load_trace

    if args.trace.startswith("gen:"):
        name = args.trace[4:]
        if name not in GENERATORS:
            raise SystemExit(f"fairway: unknown generator {name!r}; one of {sorted(GENERATORS)}")
        params = key_values(args.gen, "--gen")
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
    from simulator.driver import simulate

    return simulate(trace, *sim_setup(args, trace, policy))


def sim_setup(args: argparse.Namespace, trace, policy: str | None = None):
    """The cost model and SimConfig the command line describes for `trace`."""
    from router.cost_model import FittedCost, roofline
    from simulator.config import SimConfig
    from simulator.engine import EngineConfig
    from simulator.fleet import load_fleet

    if args.fleet:  # each group brings its own cost model
        cost, groups = None, load_fleet(args.fleet).groups
    else:
        cost = FittedCost.load(args.cost) if args.cost else roofline(args.model, args.gpu, args.tp)
        groups = ()
    prefill, decode = args.prefill_workers, args.decode_workers
    recorded = trace.meta.get("roles")
    if recorded and not (prefill or decode or args.workers is not None or args.fleet):
        # A split fleet's recording replays on the same pools (ids run mixed, prefill, decode
        # live as here).
        prefill, decode = recorded.count("prefill"), recorded.count("decode")
        mixed = recorded.count("mixed")
    else:
        mixed = args.workers if args.workers is not None else 0 if prefill + decode else 8
    config = SimConfig(
        num_workers=mixed + prefill + decode,
        prefill_workers=prefill,
        decode_workers=decode,
        topology=args.topology,
        kv_bytes_per_token=args.kv_bytes_per_token,
        groups=groups,
        policy=policy or args.policy,
        local_policy=args.local_policy,
        policy_params=key_values(args.param, "--param"),
        local_params=key_values(args.local_param, "--local-param"),
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
        classes=traffic_classes(args.classes),
        latency_routing=args.latency_routing,
        admission=args.admission,
        priority_scheduling=not args.no_priority_scheduling,
        rate_limits=rate_limits(args.rate_limit),
        load_floors=not args.no_load_floors,
        seed=args.seed,
        show_progress=sys.stderr.isatty() and len(trace) > 5000,
    )
    return cost, config


def print_config(policy: str, local_policy: str, config) -> None:  # config: RouterConfig
    """The router core's effective settings, one `name: value` a line, the same for
    `fairway simulate` and `fairway serve`: diff the two to see where they differ."""
    rows = {"policy": policy, "local_policy": local_policy, **config.describe()}
    width = max(map(len, rows)) + 1
    for name, value in rows.items():
        print(f"{name + ':':<{width}} {value}")
