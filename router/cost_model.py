"""How long one engine step takes: a roofline model from model and hardware specs, or a linear
model fitted to a real worker's measurements (`fairway profile`).

A step processes some prefill chunks and some decode tokens together (continuous batching). Its
time is the larger of the compute time (FLOPs over achievable peak) and the memory time (weights
plus the KV cache read, over achievable HBM bandwidth), plus a fixed per-step overhead (scheduler,
sampling, kernel launches) and, under tensor parallelism, two all-reduces per layer.

The engine describes a step by a `StepShape`, which is all a cost model may look at. The fitted
model is the sum of a per-step overhead, one cost per prefill token, one per decoding sequence,
one per attention pair and one per KV entry read, with non-negative coefficients; how well it
predicts a real worker is the simulator's error against that worker.
"""

from __future__ import annotations

import itertools
import json
import statistics
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final, Protocol

import numpy as np

from router.runtime.native import rebuilt


def prefill_pairs(num_new: int, num_context: int) -> float:
    """Attention (query, key) pairs of a prefill of `num_new` tokens after `num_context`."""
    return num_new * num_context + num_new * (num_new + 1) / 2


class StepShape:
    """What one step computes (a value: read, never changed).

    num_tokens: tokens run through the model (prefill chunk tokens + one per decoding sequence).
    attention_pairs: (query, key) pairs attended over, summed over sequences; a chunk of q tokens
        after c cached/computed ones contributes q*c + q*(q+1)/2, a decode token its context.
    kv_read_tokens: KV cache entries read (each sequence's context once).
    num_decode_seqs: of `num_tokens`, the sequences that decode (one token after the last one
        they sampled); the rest are prefill tokens. 0, the default, counts every token as
        prefill: a cost model that prices all tokens alike (the roofline) need not tell them.

    A plain class, not a dataclass: compiled, a dataclass's generated __init__ stays
    interpreted, and the engine describes a step or two each time it plans a run.
    """

    __slots__ = ("num_tokens", "attention_pairs", "kv_read_tokens", "num_decode_seqs")

    def __init__(
        self,
        num_tokens: int,
        attention_pairs: float,
        kv_read_tokens: int,
        num_decode_seqs: int = 0,
    ) -> None:
        self.num_tokens = num_tokens
        self.attention_pairs = attention_pairs
        self.kv_read_tokens = kv_read_tokens
        self.num_decode_seqs = num_decode_seqs

    def as_tuple(self) -> tuple[int, float, int, int]:
        return self.num_tokens, self.attention_pairs, self.kv_read_tokens, self.num_decode_seqs

    def as_dict(self) -> dict[str, float]:
        return {
            "num_tokens": self.num_tokens,
            "attention_pairs": self.attention_pairs,
            "kv_read_tokens": self.kv_read_tokens,
            "num_decode_seqs": self.num_decode_seqs,
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepShape) and self.as_tuple() == other.as_tuple()

    def __hash__(self) -> int:
        return hash(self.as_tuple())

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"StepShape({fields})"

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_seqs

    @staticmethod
    def prefill(num_new: int, num_context: int) -> StepShape:
        return StepShape(num_new, prefill_pairs(num_new, num_context), num_context + num_new)

    @staticmethod
    def decode(num_seqs: int, context_tokens: int) -> StepShape:
        """`num_seqs` sequences decoding one token each, over `context_tokens` in all (each
        one's context, its new token included)."""
        return StepShape(num_seqs, context_tokens, context_tokens, num_seqs)


class CostModel(Protocol):
    name: str
    kv_capacity_tokens: int
    # Seconds from a request reaching the server to reaching its engine (HTTP, tokenizing): a
    # delay before the engine sees it, not engine time.
    request_overhead: float

    def step_time(self, shape: StepShape) -> float: ...

    def decode_step_times(self, num_seqs: int, context_tokens: int, num_steps: int) -> list[float]:
        """Durations of `num_steps` decode-only steps of `num_seqs` sequences whose summed
        context starts at `context_tokens` and grows by `num_seqs` each step. Must equal
        `step_time` called step by step (the engine's fast-forward relies on it)."""
        ...

    def run_ends(
        self, start: float, first: float, num_seqs: int, context_tokens: int, num_decodes: int
    ) -> StepEnds:
        """When each step of an engine run from `start` ends: step 1 taking `first` seconds,
        then `num_decodes` of those decode steps. Equal to summing the durations in order."""
        ...

    def prefill_time(self, num_new_tokens: int, num_cached_tokens: int) -> float: ...

    def decode_time(self, num_seqs: int, context_tokens: int) -> float: ...


@dataclass(slots=True, frozen=True)
class ModelSpec:
    name: str
    num_params: float
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    bytes_per_param: int = 2  # bf16
    default_tp: int = 1

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param

    def __reduce__(self) -> tuple[type, tuple]:
        return rebuilt(self)


@dataclass(slots=True, frozen=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense bf16, FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory_bytes: float
    link_bandwidth: float  # GPU-to-GPU, bytes/s per direction (NVLink, or PCIe on L40S)

    def __reduce__(self) -> tuple[type, tuple]:
        return rebuilt(self)


GB = 1e9
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("llama-3-8b", 8.03e9, 32, 4096, 32, 8, 128, 8192),
        ModelSpec("mistral-7b", 7.24e9, 32, 4096, 32, 8, 128, 32768),
        ModelSpec("llama-2-13b", 13.0e9, 40, 5120, 40, 40, 128, 4096),
        ModelSpec("llama-3-70b", 70.6e9, 80, 8192, 64, 8, 128, 8192, default_tp=4),
    ]
}
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        GPUSpec("a100-80g", 312e12, 2039 * GB, 80 * GB, 300 * GB),
        GPUSpec("h100", 989e12, 3350 * GB, 80 * GB, 450 * GB),
        GPUSpec("h200", 989e12, 4800 * GB, 141 * GB, 450 * GB),
        GPUSpec("l40s", 362e12, 864 * GB, 48 * GB, 32 * GB),
    ]
}


PREFILL_MEMO_SIZE = 1 << 16
_INF: Final = float("inf")


class StepEnds:
    """When each step of a planned engine run ends, step 0 first: what the engine looks up as
    the run goes on, and cuts short when something arrives. `count` steps, the last ending at
    `last`; none shorter than `shortest`."""

    def __init__(self, ends: list[float], shortest: float) -> None:
        self._ends = ends
        self.count = len(ends)
        self.last = ends[-1]
        self.shortest = shortest

    def end(self, i: int) -> float:
        """When step `i` ends (0 <= i < count)."""
        return self._ends[i]

    def ended_by(self, now: float, lo: int, hi: int) -> int:
        """`lo` plus how many of steps lo..hi-1 have ended by `now` (bisect_right)."""
        return bisect_right(self._ends, now, lo, hi)

    def cut(self, count: int) -> None:
        """Only the first `count` steps run."""
        del self._ends[count:]
        self.count, self.last = count, self._ends[-1]


class StepCost:
    """What every cost model derives from its `step_time`."""

    name: str
    kv_capacity_tokens: int
    request_overhead: float = 0.0
    _prefill_memo: dict[tuple[int, int], float] | None = None

    def step_time(self, shape: StepShape) -> float:
        raise NotImplementedError

    def decode_step_times(self, num_seqs: int, context_tokens: int, num_steps: int) -> list[float]:
        end = context_tokens + num_seqs * num_steps
        return [
            self.step_time(StepShape.decode(num_seqs, ctx))
            for ctx in range(context_tokens, end, num_seqs)
        ]

    def run_ends(
        self, start: float, first: float, num_seqs: int, context_tokens: int, num_decodes: int
    ) -> StepEnds:
        durations = [first, *self.decode_step_times(num_seqs, context_tokens, num_decodes)]
        return StepEnds(list(itertools.accumulate(durations, initial=start))[1:], min(durations))

    def prefill_time(self, num_new_tokens: int, num_cached_tokens: int) -> float:
        # Policies price the same prefixes again and again (Preble: each LRU victim of each
        # worker it weighs, per request), and a cost model does not change once built.
        key = (num_new_tokens, num_cached_tokens)
        memo = self._prefill_memo
        if memo is None:
            memo = self._prefill_memo = {}
        seconds = memo.get(key)
        if seconds is None:
            if len(memo) >= PREFILL_MEMO_SIZE:
                memo.clear()
            seconds = memo[key] = (
                self.step_time(StepShape.prefill(num_new_tokens, num_cached_tokens))
                if num_new_tokens > 0
                else 0.0
            )
        return seconds

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        return self.step_time(StepShape.decode(num_seqs, context_tokens))


@dataclass(frozen=True)
class Measurement:
    """One timed observation of a worker. A whole request's time (`request` true: a prompt
    answered with one token) includes the request's own overhead (HTTP, tokenizing, queueing)
    on top of its step; an inter-token gap of a stream is one step alone."""

    shape: StepShape
    seconds: float
    request: bool


class FittedCost(StepCost):
    """step time = overhead + per_token x prefill tokens + per_decode_seq x decoding sequences
    + per_pair x attention pairs + per_kv_token x KV entries read, least squares with
    non-negative coefficients over a worker's measurements. `request_overhead` (fitted too) is
    what a whole request costs beyond its steps.

    A prefill token and a decoding sequence are priced apart because they cost differently: a
    prefill chunk's tokens go through the weights together, compute-bound, while a decode step
    reads the weights once however many sequences it holds (that is `overhead`), and each
    sequence adds its token's compute, its sampling and its output on the host. Reading its KV
    is `per_kv_token`'s, as for a prefill."""

    COEFFICIENTS: ClassVar[tuple[str, ...]] = (
        "overhead",
        "per_token",
        "per_decode_seq",
        "per_pair",
        "per_kv_token",
        "request_overhead",
    )
    # A coefficient that profiles written before it existed lack, and the one that priced its
    # work then: a decode token cost per_token like any token, so such a profile loads with the
    # predictions it was fitted to make. A fit that measured no decode step prices it so too.
    STANDS_IN: ClassVar[dict[str, str]] = {"per_decode_seq": "per_token"}

    def __init__(self, coefficients: dict[str, float], kv_capacity_tokens: int, name: str) -> None:
        given = dict(coefficients)
        for term, old in self.STANDS_IN.items():
            if term not in given and old in given:
                given[term] = given[old]
        missing = [c for c in self.COEFFICIENTS if c not in given]
        if missing:
            raise ValueError(f"profile: coefficients missing {missing}")
        if any(v < 0 for v in given.values()):
            raise ValueError(f"profile: coefficients must be >= 0, got {given}")
        if kv_capacity_tokens <= 0:
            raise ValueError(f"profile: kv_capacity_tokens must be positive: {kv_capacity_tokens}")
        self.coefficients = {c: float(given[c]) for c in self.COEFFICIENTS}
        self.kv_capacity_tokens = kv_capacity_tokens
        self.name = name
        self.request_overhead = self.coefficients["request_overhead"]
        c = self.coefficients
        self._terms = (
            c["overhead"],
            c["per_token"],
            c["per_decode_seq"],
            c["per_pair"],
            c["per_kv_token"],
        )

    def __reduce__(self) -> tuple[type, tuple]:
        # Compiled, an instance cannot be unpickled attribute by attribute: it is rebuilt.
        return type(self), (self.coefficients, self.kv_capacity_tokens, self.name)

    def step_time(self, shape: StepShape) -> float:
        overhead, per_token, per_decode_seq, per_pair, per_kv = self._terms
        decodes = shape.num_decode_seqs
        return (
            overhead
            + per_token * (shape.num_tokens - decodes)
            + per_decode_seq * decodes
            + per_pair * shape.attention_pairs
            + per_kv * shape.kv_read_tokens
        )

    @classmethod
    def fit(
        cls,
        measurements: list[Measurement],
        kv_capacity_tokens: int,
        name: str,
        scale: Sequence[float] | None = None,
    ) -> FittedCost:
        """Non-negative least squares over the measurements; with `scale`, each measurement's
        error counts relative to its scale (so short steps weigh as much as long ones).

        Each term needs measurements that move it apart from the others: prefill-only steps
        of several lengths, some after a cached prefix (per_token, per_pair, per_kv_token),
        and decode steps at several batch sizes and contexts (per_decode_seq against the
        step's overhead and its KV reads). Without any decode step, per_decode_seq is
        per_token (`STANDS_IN`).

        Where the server timed a request's step itself (vLLM's prefill histogram), the request
        tells only what it costs beyond that step: `request_overhead` is the median of those
        differences, and the step terms are fitted to the rest. A client held off the CPU
        adds its delay to some requests; fitted jointly, those delays bent the per-token term
        (half its value, on a loaded machine), while a median passes over them."""
        timed: dict[StepShape, list[float]] = {}
        for m in measurements:
            if not m.request:
                timed.setdefault(m.shape, []).append(m.seconds)
        beyond = [
            m.seconds - statistics.fmean(timed[m.shape])
            for m in measurements
            if m.request and m.shape in timed
        ]
        known: dict[str, float] = {}
        if beyond:
            known["request_overhead"] = max(0.0, statistics.median(beyond))
            kept = [i for i, m in enumerate(measurements) if not (m.request and m.shape in timed)]
            measurements = [measurements[i] for i in kept]
            if scale is not None:
                scale = [scale[i] for i in kept]
        terms = [
            t
            for t in cls.COEFFICIENTS
            if t not in known
            and (t != "per_decode_seq" or any(m.shape.num_decode_seqs for m in measurements))
        ]
        if len(measurements) < len(terms):
            raise ValueError(
                f"profile: {len(measurements)} measurements cannot fit {len(terms)} terms"
            )
        x = np.array([[_feature(m, t) for t in terms] for m in measurements])
        y = np.array(
            [m.seconds - sum(v * _feature(m, t) for t, v in known.items()) for m in measurements]
        )
        if scale is not None:
            w = 1 / np.array(scale)
            x, y = x * w[:, None], y * w
        fitted = dict(zip(terms, _nonnegative_lstsq(x, y).tolist(), strict=True))
        return cls({**fitted, **known}, kv_capacity_tokens, name)

    def save(self, path: Path, measurements: Sequence[Measurement] = ()) -> None:
        path.write_text(
            json.dumps(
                {
                    "fairway_profile": 1,
                    "name": self.name,
                    "kv_capacity_tokens": self.kv_capacity_tokens,
                    "coefficients": self.coefficients,
                    "measurements": [
                        {**m.shape.as_dict(), "seconds": m.seconds, "request": m.request}
                        for m in measurements
                    ],
                },
                indent=2,
            )
            + "\n"
        )

    @classmethod
    def load(cls, path: str | Path) -> FittedCost:
        try:
            data = json.loads(Path(path).read_text())
            return cls(data["coefficients"], int(data["kv_capacity_tokens"]), data["name"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a Fairway profile ({type(e).__name__}: {e})") from None


def _feature(m: Measurement, term: str) -> float:
    """What `term`'s coefficient multiplies in measurement `m`."""
    shape = m.shape
    if term == "overhead":
        return 1.0
    if term == "per_token":
        return float(shape.num_prefill_tokens)
    if term == "per_decode_seq":
        return float(shape.num_decode_seqs)
    if term == "per_pair":
        return shape.attention_pairs
    if term == "per_kv_token":
        return float(shape.kv_read_tokens)
    if term == "request_overhead":
        return float(m.request)
    raise AssertionError(f"no feature for term {term!r}")


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative term and refit until
    none is negative (enough for a handful of terms; columns scaled so their sizes do not
    matter)."""
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[active] = np.linalg.lstsq(xs[:, active], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef / scale
        active.remove(int(np.argmin(coef)))


class RooflineCost(StepCost):
    """Roofline step time for `model` on `tp` GPUs of kind `gpu`.

    Achievable fractions of peak (`compute_efficiency`, `memory_efficiency`) and the per-step
    overhead are the usual vLLM-on-A100 ballpark (decode of an 8B model at batch 1 comes to about
    12 ms per token); a fitted profile replaces them with measurements.
    """

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        tp: int | None = None,
        compute_efficiency: float = 0.6,
        memory_efficiency: float = 0.8,
        step_overhead: float = 0.002,
        gpu_memory_utilization: float = 0.9,
        allreduce_latency: float = 5e-6,
    ) -> None:
        self.model, self.gpu = model, gpu
        self.tp = tp or model.default_tp
        self._arguments = (
            model, gpu, self.tp, compute_efficiency, memory_efficiency, step_overhead,
            gpu_memory_utilization, allreduce_latency,
        )  # fmt: skip
        self.name = f"roofline:{model.name}@{gpu.name}x{self.tp}"
        weights = model.num_params * model.bytes_per_param
        kv_bytes = gpu.memory_bytes * self.tp * gpu_memory_utilization - weights
        if kv_bytes <= 0:
            raise ValueError(f"{model.name} does not fit on {self.tp} x {gpu.name}; raise --tp")
        self.kv_capacity_tokens = int(kv_bytes // model.kv_bytes_per_token)
        # Per-step constants, precomputed so a step is a handful of multiply-adds.
        flops = gpu.peak_flops * compute_efficiency * self.tp
        bandwidth = gpu.hbm_bandwidth * memory_efficiency * self.tp
        self._sec_per_token_flop = 2 * model.num_params / flops
        self._sec_per_pair = 4 * model.num_layers * model.num_heads * model.head_dim / flops
        self._weights_sec = weights / bandwidth
        self._sec_per_kv_token = model.kv_bytes_per_token / bandwidth
        self._overhead = step_overhead
        if self.tp > 1:
            ring = 2 * (self.tp - 1) / self.tp
            per_token_bytes = 2 * model.num_layers * model.hidden * model.bytes_per_param
            self._comm_per_token = ring * per_token_bytes / gpu.link_bandwidth
            self._overhead += 2 * model.num_layers * allreduce_latency
        else:
            self._comm_per_token = 0.0

    def __reduce__(self) -> tuple[type, tuple]:
        # Compiled, an instance cannot be unpickled attribute by attribute: it is rebuilt.
        return type(self), self._arguments

    def step_time(self, shape: StepShape) -> float:
        compute = shape.num_tokens * self._sec_per_token_flop + (
            shape.attention_pairs * self._sec_per_pair
        )
        memory = self._weights_sec + shape.kv_read_tokens * self._sec_per_kv_token
        comm = shape.num_tokens * self._comm_per_token
        return self._overhead + max(compute, memory) + comm

    def decode_step_times(self, num_seqs: int, context_tokens: int, num_steps: int) -> list[float]:
        # The same arithmetic as step_time, step by step (IEEE ops in the same order, so equal).
        flops, comm = num_seqs * self._sec_per_token_flop, num_seqs * self._comm_per_token
        if num_steps <= 64:  # most runs: below this, numpy's call overhead costs more (measured)
            pair, kv, weights, overhead = (
                self._sec_per_pair,
                self._sec_per_kv_token,
                self._weights_sec,
                self._overhead,
            )
            times = []
            for ctx in range(context_tokens, context_tokens + num_seqs * num_steps, num_seqs):
                compute, memory = flops + ctx * pair, weights + ctx * kv
                times.append(overhead + (compute if compute > memory else memory) + comm)
            return times
        contexts = context_tokens + num_seqs * np.arange(num_steps, dtype=np.float64)
        computes = flops + contexts * self._sec_per_pair
        memories = self._weights_sec + contexts * self._sec_per_kv_token
        return (self._overhead + np.maximum(computes, memories) + comm).tolist()

    def run_ends(
        self, start: float, first: float, num_seqs: int, context_tokens: int, num_decodes: int
    ) -> StepEnds:
        if num_decodes == 0:
            return _OneStepEnds(start + first, first)
        return _RooflineRunEnds(self, start, first, num_seqs, context_tokens, num_decodes)


class _OneStepEnds(StepEnds):
    """A run of one step: most runs while requests keep arriving or prompts are chunked, and
    planning one with no decode steps to sum should cost nothing."""

    def __init__(self, end: float, length: float) -> None:
        self.count = 1
        self.last = end
        self.shortest = length

    def end(self, i: int) -> float:
        return self.last

    def ended_by(self, now: float, lo: int, hi: int) -> int:
        return hi if now >= self.last else lo

    def cut(self, count: int) -> None:
        pass  # one step: nothing after it to cut


class _RooflineRunEnds(StepEnds):
    """A roofline run's step ends, each worked out when first looked up. A run is planned up to
    its first finish, a hundred steps or more, and most are cut short by an arrival long
    before: boxing every step's end up front was most of planning one. Its last end is still
    summed step by step (unboxed, compiled), so every end equals `decode_step_times` summed.

    Reads move forward with time, so a cursor walks the ends: the step it stands on and the one
    before, unboxed. Asking which steps have ended by now, or the ends of the step just applied
    and the one in progress, moves it and stores nothing; an end behind it is summed into `_ends`
    (the ends from step 0, as far as they were asked for) from the last one there. Every sum
    starts from an end summed the same way, so each end is the same float by either path."""

    def __init__(
        self,
        cost: RooflineCost,
        start: float,
        first: float,
        num_seqs: int,
        context_tokens: int,
        num_decodes: int,
    ) -> None:
        self._flops = num_seqs * cost._sec_per_token_flop
        self._comm = num_seqs * cost._comm_per_token
        self._pair, self._kv = cost._sec_per_pair, cost._sec_per_kv_token
        self._weights, self._overhead = cost._weights_sec, cost._overhead
        self._num_seqs, self._context = num_seqs, context_tokens  # of the first decode step
        self._ends = [start + first]
        self.count = 1 + num_decodes
        self.last = self._sum(self._ends[0], context_tokens, num_decodes, None)
        # A step's context only grows, so the first decode step is the shortest of them.
        decode = self._sum(0.0, context_tokens, 1, None) if num_decodes else first
        self.shortest = min(first, decode)
        # The cursor: step `_at` ends at `_at_end`, the step before at `_before` (if `_at`).
        self._at = 0
        self._at_end = self._ends[0]
        self._before = 0.0

    def _sum(
        self,
        end: float,
        context: float,
        num_steps: int,
        ends: list[float] | None,
    ) -> float:
        """`end` plus `num_steps` decode steps from `context`, each end appended to `ends`.
        RooflineCost.decode_step_times' arithmetic, operation for operation, on locals and with
        a range of constant step and a named counter (mypyc boxes `_`): an unboxed loop."""
        flops, comm, pair, kv = self._flops, self._comm, self._pair, self._kv
        # The context grows by the batch each step; as a float once, not converted each step
        # (int to float is exact here, so every sum is as before).
        weights, overhead, num_seqs = self._weights, self._overhead, float(self._num_seqs)
        for _i in range(num_steps):
            compute, memory = flops + context * pair, weights + context * kv
            end = end + (overhead + (compute if compute > memory else memory) + comm)
            if ends is not None:
                ends.append(end)
            context += num_seqs
        return end

    def _advance(self, until: float, to: int) -> None:
        """Move the cursor to step `to`, or to the first step after it ending past `until`
        (never past the last step). `_sum`'s arithmetic, one step at a time."""
        flops, comm, pair, kv = self._flops, self._comm, self._pair, self._kv
        weights, overhead, num_seqs = self._weights, self._overhead, float(self._num_seqs)
        at, end, before, last = self._at, self._at_end, self._before, self.count - 1
        context = float(self._context + self._num_seqs * at)  # of step at + 1
        while at < last and (at < to or end <= until):
            compute, memory = flops + context * pair, weights + context * kv
            before, end = end, end + (overhead + (compute if compute > memory else memory) + comm)
            context += num_seqs
            at += 1
        self._at, self._at_end, self._before = at, end, before

    def _extend(self, count: int) -> None:
        """`_ends` holds the first `count` steps' ends (at most `self.count`)."""
        ends = self._ends
        context = self._context + self._num_seqs * (len(ends) - 1)
        self._sum(ends[-1], context, min(count, self.count) - len(ends), ends)

    def end(self, i: int) -> float:
        at = self._at
        if i == at:
            return self._at_end
        if i == at - 1:
            return self._before
        ends = self._ends
        if i < len(ends):
            return ends[i]
        if i == self.count - 1:
            return self.last  # the same sum: a run applied at its end needs no other
        if i > at:
            self._advance(-_INF, i)
            return self._at_end
        self._extend(i + 1)
        return ends[i]

    def ended_by(self, now: float, lo: int, hi: int) -> int:
        if now >= self.last:
            return hi  # every step has ended: none of the ends between need summing
        if self._at_end <= now:
            self._advance(now, 0)  # stops on the first step ending past now
        elif self._at and self._before > now:
            # Asked of an earlier time than the cursor's: the ends up to it, stored.
            self._extend(self._at + 1)
            return bisect_right(self._ends, now, lo, min(hi, len(self._ends)))
        # Step `_at` is the first to end past now.
        return min(max(self._at, lo), hi)

    def cut(self, count: int) -> None:
        last = self.end(count - 1)
        if self._at >= count:  # the cursor back onto the new last step, from stored ends
            self._extend(count)
            ends = self._ends
            self._at, self._at_end = count - 1, ends[count - 1]
            self._before = ends[count - 2] if count > 1 else 0.0
        del self._ends[count:]
        self.count, self.last = count, last


def roofline(model: str, gpu: str, tp: int | None = None) -> RooflineCost:
    """The roofline model for preset names, with a clear error for unknown ones."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of: {', '.join(MODELS)}")
    if gpu not in GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; choose one of: {', '.join(GPUS)}")
    return RooflineCost(MODELS[model], GPUS[gpu], tp)
