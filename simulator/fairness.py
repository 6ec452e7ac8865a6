"""Fairness over time: per-client service curves, backlog, and the maximum service gap.

Service is counted in weighted tokens, as VTC's counters count it: input tokens x w_in at
admission, output tokens x w_out delivered evenly over the decode (first token to finish), both
divided by the request's weight. A client is
backlogged while it has a request waiting (arrived, not yet admitted), as in the VTC paper: a
client whose requests all run at once is served as fast as it asks and cannot be short-changed.

The service gap of two clients over an interval in which both are backlogged is the difference
of the service each received in it; `max_service_gap` is its maximum over every pair of clients
and every such interval, evaluated on a time grid. VTC bounds it by 2 x (w_in x max input +
w_out x the tokens a running batch can hold): requests already running keep being served
whatever the counters say. With one request running at a time that is about the simpler
2 x max(w_in x max input, w_out x max output) that `vtc_bound` reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.records import W_IN, W_OUT, RequestRecord
from simulator.columns import RecordColumns, columns


@dataclass(slots=True)
class ServiceCurves:
    times: np.ndarray  # grid, seconds
    clients: list[str]
    service: np.ndarray  # [client, time]: cumulative weighted tokens
    backlogged: np.ndarray  # [client, time]: bool


def _steps(times: np.ndarray, at: np.ndarray, total: np.ndarray) -> np.ndarray:
    """sum_i total_i * [at_i <= t] at each t."""
    order = np.argsort(at)
    cum = np.concatenate([[0.0], np.cumsum(total[order])])
    return cum[np.searchsorted(at[order], times, side="right")]


def _ramps(times: np.ndarray, start: np.ndarray, end: np.ndarray, total: np.ndarray) -> np.ndarray:
    """sum_i total_i * clip((t - start_i) / (end_i - start_i), 0, 1) at each t, in O((n+T) log n).

    A ramp is slope * (relu(t - start) - relu(t - end)); sum_i k_i relu(t - a_i) is
    t * K(t) - KA(t) with K, KA the prefix sums of k_i and k_i a_i over a_i <= t. Instant
    deliveries are summed as steps: their slopes would drown the rest in rounding.
    """
    instant = end - start < 1e-6
    out = _steps(times, end[instant], total[instant])
    start, end, total = start[~instant], end[~instant], total[~instant]
    slope = total / (end - start)

    def relu_sum(points: np.ndarray, k: np.ndarray) -> np.ndarray:
        order = np.argsort(points)
        p, kk = points[order], k[order]
        k_cum = np.concatenate([[0.0], np.cumsum(kk)])
        ka_cum = np.concatenate([[0.0], np.cumsum(kk * p)])
        n = np.searchsorted(p, times, side="right")
        return times * k_cum[n] - ka_cum[n]

    return out + relu_sum(start, slope) - relu_sum(end, slope)


def service_curves(
    records: Sequence[RequestRecord] | RecordColumns,
    step: float = 1.0,
    w_in: float = W_IN,
    w_out: float = W_OUT,
) -> ServiceCurves:
    cols = columns(records)
    end = float(cols.finish.max()) if len(cols) else 0.0
    times = np.arange(0.0, end + step, step)
    clients = sorted(cols.by_client)
    service = np.zeros((len(clients), len(times)))
    backlogged = np.zeros((len(clients), len(times)), dtype=bool)
    for i, client in enumerate(clients):
        rows = cols.by_client[client]
        arrival, admitted, first, finish = (
            cols.arrival[rows],
            cols.admitted[rows],
            cols.first_token[rows],
            cols.finish[rows],
        )
        weight = cols.weight[rows]
        prompt, output = cols.prompt_tokens[rows], cols.output_tokens[rows]
        service[i] = _steps(times, admitted, w_in * prompt / weight)
        service[i] += _ramps(times, first, finish, w_out * output / weight)
        started = np.searchsorted(np.sort(arrival), times, side="right")
        done = np.searchsorted(np.sort(admitted), times, side="right")
        backlogged[i] = started > done
    return ServiceCurves(times, clients, service, backlogged)


def max_service_gap(curves: ServiceCurves) -> float:
    """Largest |service_f - service_g| over an interval both f and g were backlogged in."""
    worst = 0.0
    k = len(curves.clients)
    for f in range(k):
        for g in range(f + 1, k):
            both = curves.backlogged[f] & curves.backlogged[g]
            if not both.any():
                continue
            diff = curves.service[f] - curves.service[g]
            # Split into maximal runs where both are backlogged; the gap within a run is the
            # range of the difference of their cumulative service.
            edges = np.flatnonzero(np.diff(np.concatenate([[0], both.astype(np.int8), [0]])))
            for start, stop in zip(edges[::2], edges[1::2], strict=True):
                run = diff[start:stop]
                worst = max(worst, float(run.max() - run.min()))
    return worst


def jain_while_backlogged(curves: ServiceCurves) -> float | None:
    """Jain's index over the service of clients backlogged together, averaged over time.

    The time grid splits into runs over which the set of backlogged clients stays the same; in
    each run with two or more of them, Jain's index over what each received in it, weighted by
    the run's length. Service over a whole run is not compared across clients with different
    demand: a client that is waiting wants more than it gets, so fair means equal there. None
    when no two clients ever wait together (nothing to be fair about).
    """
    waiting = curves.backlogged[:, :-1]
    received = np.diff(curves.service, axis=1)
    if waiting.shape[1] == 0:
        return None
    change = np.flatnonzero((waiting[:, 1:] != waiting[:, :-1]).any(axis=0)) + 1
    bounds = np.concatenate([[0], change, [waiting.shape[1]]])
    total = weight = 0.0
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        members = waiting[:, start]
        if members.sum() < 2:
            continue
        got = received[members, start:stop].sum(axis=1)
        if got.sum() <= 0:
            continue
        total += (stop - start) * float(got.sum() ** 2 / (len(got) * (got**2).sum()))
        weight += stop - start
    return total / weight if weight else None


def vtc_bound(
    records: Sequence[RequestRecord] | RecordColumns, w_in: float = W_IN, w_out: float = W_OUT
) -> float:
    """VTC's bound on the service gap: 2 x max(w_in x max input, w_out x max output)."""
    cols = columns(records)
    if not len(cols):
        return 0.0
    max_in = float((cols.prompt_tokens / cols.weight).max())
    max_out = float((cols.output_tokens / cols.weight).max())
    return 2 * max(w_in * max_in, w_out * max_out)


def service_by_window(curves: ServiceCurves, window: float) -> dict[str, list[float]]:
    """Weighted tokens each client received in consecutive windows of `window` seconds."""
    step = curves.times[1] - curves.times[0] if len(curves.times) > 1 else window
    stride = max(1, round(window / step))
    idx = np.arange(0, len(curves.times), stride)
    idx = np.append(idx, len(curves.times) - 1) if idx[-1] != len(curves.times) - 1 else idx
    # Window k ends at idx[k + 1]; service delivered at time 0 belongs to the first window.
    return {
        c: np.diff(curves.service[i, idx[1:]], prepend=0.0).tolist()
        for i, c in enumerate(curves.clients)
    }
