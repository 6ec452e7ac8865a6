"""The `fairway validate` report: per policy, simulated against measured, the spread of the
error over repeats, whether the policies rank alike, and the issue's targets.

Errors are the simulator's: (simulated - measured) / measured in %, and for the hit rate the
difference in points. A run's error is taken against the replay it simulates (same repeat, its
profile); a policy's figure is the median over repeats, with the min and max beside it.
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Sequence

# key, label, path in summary.json, scale for display, unit
METRICS = (
    ("ttft_mean", "TTFT mean", ("ttft", "mean"), 1.0, "s"),
    ("ttft_p90", "TTFT p90", ("ttft", "p90"), 1.0, "s"),
    ("tpot_mean", "TPOT mean", ("tpot", "mean"), 1000.0, "ms"),
    ("tpot_p90", "TPOT p90", ("tpot", "p90"), 1000.0, "ms"),
    ("e2e_mean", "e2e mean", ("e2e", "mean"), 1.0, "s"),
    ("e2e_p90", "e2e p90", ("e2e", "p90"), 1.0, "s"),
    ("throughput", "throughput", ("throughput", "output_tokens_per_s"), 1.0, "tok/s"),
    ("hit_rate", "hit rate", ("prefix_cache", "hit_rate"), 100.0, "%"),
)
# Ranked by: metric, whether higher is better, and the least difference that is not a tie
# (hit rate in points: one 128-token block more or less is 0.2 points of this trace; e2e as a
# share of the mean of the two).
RANKINGS = (("e2e_mean", False, 0.05), ("hit_rate", True, 1.0))
TARGETS = {"hit_rate": 2.0, "ttft_mean": 10.0, "e2e_mean": 10.0}  # points, %, %


def figures(summary: dict) -> dict[str, float]:
    out = {}
    for key, _, (group, name), scale, _ in METRICS:
        value = (summary.get(group) or {}).get(name)
        out[key] = float("nan") if value is None else scale * float(value)
    return out


def error(key: str, live: float, sim: float) -> float:
    if key == "hit_rate":
        return sim - live  # already in %: points
    return 100.0 * (sim - live) / live if live else float("nan")


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def build(config: dict, trace, repeats: Sequence, seconds: float) -> dict:
    policies = list(config["policies"])
    runs = []
    for rep in repeats:
        for policy, run in rep.runs.items():
            live, sim = figures(run["live"]), figures(run["sim"])
            runs.append(
                {
                    "repeat": rep.index,
                    "policy": policy,
                    "live": live,
                    "sim": sim,
                    "error": {k: error(k, live[k], sim[k]) for k in live},
                    "proxy_overhead": run["proxy_overhead"],
                    "failures": run["failures"],
                    "completed": run["live"]["completed"],
                    "load": run.get("load"),
                }
            )
    per_policy = {}
    for policy in policies:
        mine = [r for r in runs if r["policy"] == policy]
        per_policy[policy] = {
            key: {
                "live": statistics.median(r["live"][key] for r in mine),
                "sim": statistics.median(r["sim"][key] for r in mine),
                "live_range": [
                    min(r["live"][key] for r in mine),
                    max(r["live"][key] for r in mine),
                ],
                "error": spread([r["error"][key] for r in mine]),
            }
            for key, *_ in METRICS
        }
    for policy in policies:
        mine = [rep.runs[policy] for rep in repeats if policy in rep.runs]
        per_policy[policy]["phases"] = {
            key: _median_nan([phase_split(run)[key] for run in mine]) for key in PHASES
        }
    rankings = {
        key: ranking(per_policy, runs, key, higher, margin) for key, higher, margin in RANKINGS
    }
    targets = {
        key: max(abs(per_policy[p][key]["error"]["median"]) for p in policies) for key in TARGETS
    }
    met = {f"{key} within {limit:g}": targets[key] <= limit for key, limit in TARGETS.items()}
    met["same ranking"] = all(r["agrees_up_to_ties"] for r in rankings.values())
    return {
        "fairway_validate": 1,
        "config": config,
        "machine": {"cpu": _cpu(), "cores": _cores(), "python": platform.python_version()},
        "trace": {
            "requests": len(trace),
            "rate": config["rate"],
            "mean_prompt": statistics.mean(r.prompt_len for r in trace.requests),
            "mean_output": statistics.mean(r.output_len for r in trace.requests),
            "duration": max(r.arrival for r in trace.requests),
        },
        "profiles": [
            {
                "repeat": rep.index,
                "coefficients": rep.cost.coefficients,
                "measurements": len(rep.measurements),
                "per_worker": [w.coefficients for w in rep.per_worker],
                "reference_request": [reference_request(w, trace) for w in rep.per_worker],
            }
            for rep in repeats
        ],
        "runs": runs,
        "policies": per_policy,
        "rankings": rankings,
        "worst_median_error": targets,
        "targets": met,
        "met": all(met.values()),
        "seconds": seconds,
    }


# Where a request's time goes before its first token, mean seconds (real), from what the
# client, the proxy (its records) and vLLM (its histograms) each saw:
#   client_proxy  client TTFT - proxy TTFT: HTTP between them, both event loops
#   proxy_queue   the proxy's dispatch queue (the window)
#   proxy_vllm    proxy TTFT - its queue - vLLM's TTFT: HTTP to vLLM, SSE back
#   api           vLLM's TTFT - its queue - its prefill: the API server around the engine
#   queue         waiting inside vLLM
#   prefill       vLLM's first step to first token
# and after it, decode (first token to last, as the client sees it) and vllm_decode (the same
# by the engine's timestamps: what the simulated engine models, without the delivery). The
# simulator's side: sim_before (arrival to the first step: its router queue, the request
# overhead, the engine's queue), sim_prefill, sim_decode.
PHASES = (
    "client_proxy",
    "proxy_queue",
    "proxy_vllm",
    "api",
    "queue",
    "prefill",
    "before",
    "decode",
    "vllm_decode",
    "sim_before",
    "sim_prefill",
    "sim_decode",
)


def phase_split(run: dict) -> dict[str, float]:
    nan = float("nan")
    ph = run["phases"]
    live, sim, seen = ph["live"], ph["sim"], ph.get("proxy") or {}
    server = run.get("server") or {k: nan for k in ("queue", "prefill", "decode", "ttft")}
    proxy_ttft, proxy_queue = seen.get("ttft", nan), seen.get("to_admission", nan)
    return {
        "client_proxy": live["ttft"] - proxy_ttft,
        "proxy_queue": proxy_queue,
        "proxy_vllm": proxy_ttft - proxy_queue - server["ttft"],
        "api": server["ttft"] - server["queue"] - server["prefill"],
        "queue": server["queue"],
        "prefill": server["prefill"],
        "before": live["ttft"] - server["prefill"],
        "decode": live["decode"],
        "vllm_decode": server["decode"],
        "sim_before": sim["to_admission"],
        "sim_prefill": sim["ttft"] - sim["to_admission"],
        "sim_decode": sim["decode"],
    }


def reference_request(cost, trace) -> float:
    """Seconds one average request of the trace takes alone and uncached under `cost`."""
    prompt = round(statistics.mean(r.prompt_len for r in trace.requests))
    output = round(statistics.mean(r.output_len for r in trace.requests))
    decode = sum(cost.decode_step_times(1, prompt, max(0, output - 1)))
    return cost.request_overhead + cost.prefill_time(prompt, 0) + decode


def _median_nan(values: list[float]) -> float:
    kept = [v for v in values if v == v]
    return statistics.median(kept) if kept else float("nan")


def ranking(
    per_policy: dict, runs: list, key: str, higher_better: bool, margin: float = 0.0
) -> dict:
    """Orders by the medians over repeats. Two policies are a tie when their measured values
    overlap across repeats, or their medians are less than `margin` apart (relative to their
    mean for latencies, absolute for the hit rate): their order is the noise's, and
    disagreeing on it is no error."""
    names = list(per_policy)

    def order(side: str) -> list[str]:
        return sorted(names, key=lambda p: per_policy[p][key][side], reverse=higher_better)

    live, sim = order("live"), order("sim")
    pairs, disagree = 0, []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            (lo_a, hi_a), (lo_b, hi_b) = (
                per_policy[a][key]["live_range"],
                per_policy[b][key]["live_range"],
            )
            va, vb = per_policy[a][key]["live"], per_policy[b][key]["live"]
            scale = 1.0 if key == "hit_rate" else (va + vb) / 2
            if (lo_a <= hi_b and lo_b <= hi_a) or abs(va - vb) < margin * scale:
                continue  # a tie
            pairs += 1
            d_live = va - vb
            d_sim = per_policy[a][key]["sim"] - per_policy[b][key]["sim"]
            if d_live * d_sim <= 0:
                disagree.append(f"{a} vs {b}")
    same_per_repeat = 0
    repeats = sorted({r["repeat"] for r in runs})
    for rep in repeats:
        mine = {r["policy"]: r for r in runs if r["repeat"] == rep}
        by = [
            sorted(mine, key=lambda p: mine[p][side][key], reverse=higher_better)
            for side in ("live", "sim")
        ]
        same_per_repeat += by[0] == by[1]
    return {
        "live": live,
        "sim": sim,
        "same_order": live == sim,
        "distinguishable_pairs": pairs,
        "disagreements": disagree,
        "agrees_up_to_ties": not disagree,
        "same_order_repeats": f"{same_per_repeat}/{len(repeats)}",
    }


def run_line(run: dict) -> str:
    live, sim = figures(run["live"]), figures(run["sim"])
    parts = [
        f"{label} {live[key]:.3g}/{sim[key]:.3g} {unit}"
        for key, label, _, _, unit in METRICS
        if key in ("ttft_mean", "e2e_mean", "hit_rate")
    ]
    failed = f"; failed {run['failures']}" if run["failures"] else ""
    return "real/sim: " + ", ".join(parts) + failed


def markdown(result: dict) -> str:
    c, t = result["config"], result["trace"]
    lines = [
        f"# fairway validate: the simulator against {c['workers']} real workers",
        "",
        f"{result['machine']['cpu']} ({result['machine']['cores']} cores). Trace: shared_prefix,"
        f" {t['requests']} requests at {t['rate']:.3g} req/s (mean prompt {t['mean_prompt']:.0f},"
        f" output {t['mean_output']:.0f} tokens), {c['num_tenants'] * c['prefixes_per_tenant']}"
        f" documents; proxy window {c['window']}; {c['repeats']} repeats, each profile followed"
        f" by a replay per policy; {result['seconds'] / 60:.1f} min.",
        "",
        "Per policy: measured and simulated, each the median over repeats, and the simulator's"
        " error, each repeat's simulation against its own replay (% of measured; hit rate in"
        " points): median [min, max] over repeats.",
        "",
        "| policy | metric | real | sim | error median | min | max |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy, by_key in result["policies"].items():
        for key, label, _, _, unit in METRICS:
            f = by_key[key]
            e = f["error"]
            pct = "pt" if key == "hit_rate" else "%"
            lines.append(
                f"| {policy} | {label} {unit} | {f['live']:.3g} | {f['sim']:.3g} | "
                f"{e['median']:+.1f}{pct} | {e['min']:+.1f}{pct} | {e['max']:+.1f}{pct} |"
            )
    lines += [
        "",
        "| ranked by | real | sim | agrees (ties aside) | same order per repeat |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, r in result["rankings"].items():
        note = "yes" if r["agrees_up_to_ties"] else f"no ({', '.join(r['disagreements'])})"
        note += f"; pairs apart: {r['distinguishable_pairs']}"
        lines.append(
            f"| {key} | {' < '.join(r['live']) if key != 'hit_rate' else ' > '.join(r['live'])} "
            f"| {' < '.join(r['sim']) if key != 'hit_rate' else ' > '.join(r['sim'])} | {note} "
            f"| {r['same_order_repeats']} |"
        )
    lines += ["", "| target | reached (worst policy's median) | met |", "| --- | --- | --- |"]
    worst = result["worst_median_error"]
    for name, ok in result["targets"].items():
        key = name.split()[0]
        reached = f"{worst[key]:.1f}{'pt' if key == 'hit_rate' else '%'}" if key in worst else ""
        lines.append(f"| {name} | {reached} | {'yes' if ok else 'no'} |")
    lines += [
        "",
        "Where the time goes (mean seconds, median over repeats). Before the first token,"
        " real: client to proxy and back (client TTFT - the proxy's), the proxy's queue, proxy"
        " to vLLM and back (the proxy's TTFT - its queue - vLLM's TTFT), vLLM's API server"
        " around the engine (vLLM's TTFT - its queue - its prefill), vLLM's queue; their sum"
        " (before) against the simulator's arrival-to-first-step; then prefill (vLLM's own"
        " timing) and decode (first token to last, as the client saw it and by vLLM's own"
        " timing) against the simulator's.",
        "",
        "| policy | client-proxy | proxy queue | proxy-vLLM | vLLM API | vLLM queue | before |"
        " sim | prefill | sim | decode | vLLM decode | sim |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy, by_key in result["policies"].items():
        ph = by_key["phases"]
        cells = [
            ph[k]
            for k in (
                "client_proxy",
                "proxy_queue",
                "proxy_vllm",
                "api",
                "queue",
                "before",
                "sim_before",
                "prefill",
                "sim_prefill",
                "decode",
                "vllm_decode",
                "sim_decode",
            )
        ]
        lines.append(f"| {policy} | " + " | ".join(f"{v:.3g}" for v in cells) + " |")
    lines += [
        "",
        "Profiles (seconds; each worker through a fairway serve of its own, so"
        " request_overhead includes the proxy's hop):",
        "",
    ]
    for p in result["profiles"]:
        terms = ", ".join(f"{k} {v:.3g}" for k, v in p["coefficients"].items())
        each = ", ".join(f"{v:.3g}" for v in p["reference_request"])
        lines.append(
            f"- repeat {p['repeat']}: {terms} ({p['measurements']} measurements); an average"
            f" request alone, uncached, by each worker's own fit: {each} s"
        )
    loads = [x for r in result["runs"] for x in r.get("load") or ()]
    if loads:
        lines += [
            "",
            f"Load average (1 min) on this machine at each replay's start and end: "
            f"median {statistics.median(loads):.1f}, min {min(loads):.1f}, max "
            f"{max(loads):.1f} ({result['machine']['cores']} cores): other work on the"
            f" machine slows the servers unevenly, which a profile measured a minute"
            f" apart cannot know.",
        ]
    overheads = [1000 * r["proxy_overhead"] for r in result["runs"]]
    lines += [
        "",
        f"A tiny request through the proxy minus direct (ms; before each replay, for"
        f" reference: the profile includes it): median "
        f"{statistics.median(overheads):.1f}, min {min(overheads):.1f}, "
        f"max {max(overheads):.1f}.",
        "",
    ]
    return "\n".join(lines)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
