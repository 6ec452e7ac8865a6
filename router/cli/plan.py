"""`fairway plan`: the fewest workers that serve a trace within latency targets, and how to
split them, found by simulating candidate fleets (simulator.plan)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from dashboards.tables import format_table
from router.cli.args import load_workload, sim_setup

# Options of `fairway simulate` that name the fleet the search chooses.
FLEET_OPTIONS = (("workers", None), ("prefill_workers", 0), ("decode_workers", 0), ("fleet", None))


def _number(text: str, kind: type[float] | type[int]) -> float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None


def attainment_share(text: str) -> float:
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def positive_seconds(text: str) -> float:
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive seconds, got {text}")
    return value


def at_least_one(text: str) -> int:
    value = int(_number(text, int))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def policy_names(text: str) -> list[str]:
    import policies

    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in policies.global_policies]
    if unknown or not names:
        known = ", ".join(policies.global_policies.names())
        raise argparse.ArgumentTypeError(f"unknown {unknown or text!r}; choose from: {known}")
    return names


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("goal and search")
    g.add_argument("--ttft", type=positive_seconds, required=True, help="TTFT target, seconds")
    g.add_argument("--tpot", type=positive_seconds, required=True, help="TPOT target, seconds")
    g.add_argument(
        "--attainment",
        type=attainment_share,
        default=0.99,
        help="the share of requests that must meet both targets (default 0.99)",
    )
    g.add_argument(
        "--max-workers", type=at_least_one, default=64, help="largest fleet tried (default 64)"
    )
    g.add_argument(
        "--policies",
        type=policy_names,
        help="comma-separated global policies, each searched (default: --policy)",
    )
    g.add_argument(
        "--split", action="store_true", help="also search prefill:decode splits of the fleet"
    )
    g.add_argument(
        "--jobs",
        type=at_least_one,
        help="candidates simulated side by side (default: the CPU count, or the Ray cluster's)",
    )
    g.add_argument(
        "--ray-address",
        help="simulate the candidates as Ray tasks on this cluster (default: the one running "
        "on this machine, if any; else local processes)",
    )
    g.add_argument("--json", metavar="FILE", help="write the answer and every candidate here")


def lone_request_times(cost, prompt_len: int, step_tokens: int) -> tuple[float, float]:
    """A request alone on a worker: its prompt's prefill (in chunks of the engine's step
    budget, after the server's overhead), and one decode step after it."""
    prefill, done = cost.request_overhead, 0
    while done < prompt_len:
        chunk = min(step_tokens, prompt_len - done)
        prefill += cost.prefill_time(chunk, done)
        done += chunk
    return prefill, cost.decode_time(1, prompt_len + 1)


def check_reachable(args: argparse.Namespace, trace, cost) -> None:
    """Targets no fleet can meet: below what the trace's median prompt takes alone."""
    median = int(statistics.median(trace.column("prompt_len")))
    prefill, step = lone_request_times(cost, median, args.max_num_batched_tokens)
    gpu = cost.name if args.cost else args.gpu
    if args.ttft < prefill:
        raise ValueError(
            f"ttft: {args.ttft:g} s is below the {prefill:.3g} s a lone request's prefill takes "
            f"on {gpu} (the trace's median prompt, {median} tokens)"
        )
    if args.tpot < step:
        raise ValueError(
            f"tpot: {args.tpot:g} s is below the {step:.3g} s a lone request's decode step "
            f"takes on {gpu} (after the trace's median prompt, {median} tokens)"
        )


def candidate_rows(plan) -> list[dict[str, object]]:  # plan: simulator.plan.Plan
    rank = {a.policy: i for i, a in reversed(list(enumerate(plan.answers)))}  # as given
    order = sorted(plan.outcomes, key=lambda o: (rank[o.policy], o.fleet.split, o.fleet))
    return [
        {
            "workers": o.fleet.workers,
            "prefill": o.fleet.prefill,
            "decode": o.fleet.decode,
            "policy": o.policy,
            "attainment %": 100 * o.attainment,
            "goodput/GPU req/s": o.goodput_per_gpu,
            "GPU-hours": o.gpu_hours,
        }
        for o in order
    ]


def search_lines(plan) -> list[str]:
    lines = []
    for a in plan.answers:
        kind = "split" if a.split else "mixed"
        found = "none" if a.outcome is None else f"{a.outcome.fleet.workers} ({a.outcome.fleet})"
        lines.append(f"{a.policy}, {kind}: {found}")
        for smaller, larger in a.search.violations:
            lines.append(
                f"  not monotone: {smaller} workers meet the goal but {larger} do not; a "
                "smaller fleet than the answer may meet it where the search did not look"
            )
    return lines


def cmd_plan(args: argparse.Namespace) -> int:
    from router.runtime.ray_tasks import ray_if_wanted
    from simulator.plan import Candidates, Goal, plan
    from simulator.progress import command_bar

    for name, unset in FLEET_OPTIONS:
        if getattr(args, name) != unset:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}: plan searches the fleet; give --max-workers instead")
    goal = Goal(args.ttft, args.tpot, args.attainment)
    trace = load_workload(args)
    cost, base = sim_setup(args, trace)
    check_reachable(args, trace, cost)
    from router.cost_model import MODELS

    tp = args.tp or (1 if args.cost else MODELS[args.model].default_tp)
    policies = args.policies or [args.policy]
    with ray_if_wanted(args.ray_address) as ray:
        if ray is not None:
            print(f"plan: runs as Ray tasks on the cluster at {ray.address}", file=sys.stderr)
        jobs = args.jobs or (ray.cpus() if ray is not None else os.cpu_count() or 1)
        with command_bar("plan"):
            found = plan(
                Candidates(trace, cost, base, goal, tp),
                policies,
                args.max_workers,
                split=args.split,
                jobs=jobs,
                ray=ray,
            )
    print(format_table(candidate_rows(found)))
    print("\n".join(search_lines(found)))
    if args.json:
        Path(args.json).write_text(json.dumps(found.to_json(), indent=2) + "\n")
    answer = found.answer
    target = f"TTFT <= {goal.ttft:g} s and TPOT <= {goal.tpot:g} s for {100 * goal.attainment:g} %"
    if answer is None or answer.outcome is None:
        best = found.closest
        print(
            f"no fleet up to {args.max_workers} workers meets it ({target}); the best reaches "
            f"{100 * best.attainment:.1f} % at {best.fleet.workers} ({best.fleet}, {best.policy})"
        )
        return 1
    o = answer.outcome
    below = answer.search.meets.get(o.fleet.workers - 1)
    fewer = "" if below is None else f"; {o.fleet.workers - 1} do not"
    print(
        f"answer: {o.fleet.workers} workers ({o.fleet}, {o.policy}) meet {target}: "
        f"{100 * o.attainment:.1f} %{fewer}"
    )
    return 0
