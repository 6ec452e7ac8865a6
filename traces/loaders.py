"""Readers for public production traces, and format detection.

- Mooncake (FAST'25): JSONL with `timestamp` (ms), `input_length`, `output_length` and
  `hash_ids`, one id per 512-token block, already prefix-chained (equal id = equal prefix).
- Azure LLM inference 2023 (Splitwise): CSV `TIMESTAMP, ContextTokens, GeneratedTokens`; lengths
  only, so nothing in it can hit a prefix cache.
- ServeGen (Alibaba): a folder of clients, each `chunk-N-trace.csv` (per 600 s window: rate,
  CV and a fitted inter-arrival family) with `chunk-N-dataset.json` (length distributions).
  Arrivals and lengths are drawn per window; each client becomes a tenant.
"""

from __future__ import annotations

import ast
import bisect
import csv
import itertools
import json
import math
import random
import re
from collections.abc import Collection
from datetime import datetime
from pathlib import Path

from router.request import BLOCK_HASH_END, BLOCK_HASH_MIN, Request
from traces.recording import TRACE_FILE, recorded_parts
from traces.schema import (
    DEFAULT_BLOCK_SIZE,
    Trace,
    TraceError,
    finish,
    json_lines,
    load_native,
    read_native,
    renumber,
)

MOONCAKE_BLOCK_SIZE = 512
FORMATS = ("auto", "native", "recording", "mooncake", "azure", "servegen")


def detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "trace.jsonl").exists():
            return "recording"
        if any(path.rglob("chunk-*-trace.csv")):
            return "servegen"
        raise TraceError(
            path,
            None,
            "a folder, but neither a proxy recording (trace.jsonl) nor ServeGen "
            "chunk-N-trace.csv files in it",
        )
    if not path.exists():
        raise TraceError(path, None, "no such file")
    with open(path, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    if path.suffix == ".csv" or first.startswith("TIMESTAMP"):
        return "azure"
    try:
        obj = json.loads(first)
    except json.JSONDecodeError:
        raise TraceError(path, 1, "cannot tell the trace format: not JSON nor CSV") from None
    if isinstance(obj, dict) and "hash_ids" in obj and "timestamp" in obj:
        return "mooncake"
    return "native"


def load_trace(path: str | Path, fmt: str = "auto", seed: int = 0, **options: object) -> Trace:
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "native":
        return load_native(path)
    if fmt == "recording":
        return load_recording(path)
    if fmt == "mooncake":
        return load_mooncake(path)
    if fmt == "azure":
        return load_azure(path)
    if fmt == "servegen":
        return load_servegen(path, seed=seed, **options)  # type: ignore[arg-type]
    raise ValueError(f"unknown trace format {fmt!r}; choose one of: {', '.join(FORMATS)}")


def load_recording(folder: Path) -> Trace:
    """A proxy's record folder: its rotated trace parts and the current one, as one trace."""
    parts = []
    for part in [*recorded_parts(folder), folder / TRACE_FILE]:
        try:
            parts.append(read_native(part))
        except TraceError as e:
            if "no requests" not in str(e):  # a part just rotated in holds only its header
                raise
    if not parts:
        raise TraceError(folder, None, "no requests recorded yet")
    trace = Trace([r for t in parts for r in t.requests], parts[-1].block_size, source=str(folder))
    served = {k: v for t in parts for k, v in t.meta.get("served_by", {}).items()}  # type: ignore[union-attr]
    if served:
        trace.meta = {"served_by": served, "policy": parts[-1].meta.get("policy")}
    if "roles" in parts[-1].meta:  # the fleet as it recorded last
        trace.meta["roles"] = parts[-1].meta["roles"]
    return finish(trace)


# ------------------------------------------------------------------ Mooncake


def load_mooncake(path: Path) -> Trace:
    requests = []
    for lineno, obj in json_lines(path):
        try:
            ts, n_in, n_out, ids = (
                obj["timestamp"],
                obj["input_length"],
                obj["output_length"],
                obj["hash_ids"],
            )
        except KeyError as e:
            raise TraceError(path, lineno, f"missing field {e.args[0]!r}") from None
        if not _is_count(n_in) or not _is_count(n_out):
            raise TraceError(path, lineno, "input_length and output_length must be positive ints")
        if not isinstance(ts, (int, float)) or ts < 0:
            raise TraceError(path, lineno, "timestamp must be a non-negative number of ms")
        if not isinstance(ids, list) or not all(
            isinstance(h, int) and BLOCK_HASH_MIN <= h < BLOCK_HASH_END for h in ids
        ):
            raise TraceError(path, lineno, "hash_ids must be a list of 64-bit ints")
        requests.append(
            Request(
                id=len(requests),
                arrival=ts / 1000.0,
                prompt_len=n_in,
                output_len=n_out,
                block_hashes=ids[: n_in // MOONCAKE_BLOCK_SIZE],  # full blocks only
            )
        )
    if not requests:
        raise TraceError(path, None, "no requests in trace")
    return finish(Trace(requests, MOONCAKE_BLOCK_SIZE, source=str(path)))


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


# --------------------------------------------------------------------- Azure


def load_azure(path: Path) -> Trace:
    requests = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        expected = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header[:3]] != expected:
            raise TraceError(path, 1, f"expected header {','.join(expected)}, got {header}")
        t0: datetime | None = None
        for lineno, row in enumerate(reader, 2):
            if not row:
                continue
            try:
                ts = _parse_azure_time(row[0])
                n_in, n_out = int(row[1]), int(row[2])
            except (ValueError, IndexError):
                raise TraceError(path, lineno, f"cannot read row {row}") from None
            if n_in <= 0 or n_out <= 0:
                raise TraceError(path, lineno, "token counts must be positive")
            t0 = t0 or ts
            arrival = (ts - t0).total_seconds()
            requests.append(Request(len(requests), arrival, n_in, n_out))
    if not requests:
        raise TraceError(path, None, "no requests in trace")
    return finish(Trace(requests, DEFAULT_BLOCK_SIZE, source=str(path)))


def _parse_azure_time(text: str) -> datetime:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, one more than %f takes.
    text = text.strip()
    if "." in text:
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
        return datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f")
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S")


# ------------------------------------------------------------------ ServeGen

SERVEGEN_WINDOW = 600.0


def load_servegen(
    path: Path,
    seed: int = 0,
    start: float | None = None,
    duration: float = SERVEGEN_WINDOW,
    clients: Collection[str] | None = None,
    speedup: float = 1.0,
) -> Trace:
    """Draw one workload from a ServeGen client folder.

    Per client and 600 s window, inter-arrival times follow the fitted family (Gamma or Weibull)
    with its fitted shape, scaled so the mean is 1/rate: the rate is the measured quantity and
    the shape carries the burstiness (an exponential where no family was fitted). Lengths come
    from the window's input/output distributions (the latest dataset window at or before it).
    `start` defaults to the busiest window over all clients. Clients without a dataset file are
    skipped (five of m-small's are missing) and listed in `trace.meta["skipped_clients"]`.
    `clients`: only these (by name, "chunk-N"). `speedup`: the windows played that many times
    faster, each at its own rate (a day's shape in fewer requests).
    """
    if not speedup > 0:
        raise ValueError(f"speedup: must be > 0, got {speedup}")
    csvs = sorted(path.rglob("chunk-*-trace.csv"), key=_chunk_number)
    if clients is not None:
        csvs = [p for p in csvs if p.name.removesuffix("-trace.csv") in clients]
    rates: dict[Path, list[tuple[float, float, float, str, float]]] = {}
    for trace_csv in csvs:
        rates[trace_csv] = _servegen_windows(trace_csv)
    if start is None:
        totals: dict[float, float] = {}
        for windows in rates.values():
            for t, rate, *_ in windows:
                totals[t] = totals.get(t, 0.0) + rate
        start = max(totals, key=lambda t: totals[t]) if totals else 0.0
    end = start + duration

    rng = random.Random(seed)
    requests: list[Request] = []
    skipped: list[str] = []
    for trace_csv in csvs:
        client = trace_csv.name.removesuffix("-trace.csv")
        dataset_path = trace_csv.with_name(f"{client}-dataset.json")
        if not dataset_path.exists():
            skipped.append(client)
            continue
        dataset = _ServeGenDataset(dataset_path)
        for t, rate, cv, family, shape in rates[trace_csv]:
            if rate <= 0 or t + SERVEGEN_WINDOW <= start or t >= end:
                continue
            lengths = dataset.at(t)
            if lengths is None:
                continue
            inputs, outputs = lengths
            now = max(t, start)
            stop = min(t + SERVEGEN_WINDOW, end)
            while True:
                now += speedup * _inter_arrival(rng, rate, cv, family, shape)
                if now >= stop:
                    break
                n_in = max(1, int(inputs.draw(rng)))
                n_out = max(1, int(outputs.draw(rng)))
                requests.append(Request(0, now / speedup, n_in, n_out, client=client))
    if not requests:
        raise TraceError(path, None, f"no requests in window [{start}, {end})")
    requests.sort(key=lambda r: r.arrival)
    trace = Trace(renumber(requests), DEFAULT_BLOCK_SIZE, source=str(path))
    trace.meta.update(start=start, duration=duration, speedup=speedup, skipped_clients=skipped)
    return finish(trace)


def _chunk_number(p: Path) -> int:
    m = re.search(r"chunk-(\d+)", p.name)
    return int(m.group(1)) if m else 0


def _servegen_windows(path: Path) -> list[tuple[float, float, float, str, float]]:
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row:
                continue
            try:
                t, rate = float(row[0]), float(row[1])
                cv = float(row[2]) if row[2] else 1.0
                family = row[3].strip()
                shape = float(row[4]) if family else 1.0
            except (ValueError, IndexError):
                raise TraceError(path, lineno, f"cannot read row {row}") from None
            out.append((t, rate, cv, family, shape))
    return out


class _LengthTable:
    """A discrete length distribution, drawn from by inverse CDF."""

    __slots__ = ("values", "cumulative")

    def __init__(self, pmf: dict[int, float]) -> None:
        self.values = list(pmf)
        self.cumulative = list(itertools.accumulate(pmf.values()))

    def draw(self, rng: random.Random) -> int:
        u = rng.random() * self.cumulative[-1]
        return self.values[min(bisect.bisect_right(self.cumulative, u), len(self.values) - 1)]


class _ServeGenDataset:
    """A client's length distributions per window, parsed only for the windows used."""

    def __init__(self, path: Path) -> None:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise TraceError(path, e.lineno, f"not valid JSON ({e.msg})") from None
        self.path = path
        self._raw = sorted(((float(k), v) for k, v in raw.items()), key=lambda kv: kv[0])
        self._parsed: dict[float, tuple[_LengthTable, _LengthTable] | None] = {}

    def at(self, t: float) -> tuple[_LengthTable, _LengthTable] | None:
        """The latest non-empty window starting at or before `t`."""
        for start, value in reversed(self._raw):
            if start <= t and (tables := self._tables(start, value)) is not None:
                return tables
        return None

    def _tables(self, start: float, value: dict) -> tuple[_LengthTable, _LengthTable] | None:
        if start not in self._parsed:
            try:
                inputs = ast.literal_eval(value["input_tokens"])
                outputs = ast.literal_eval(value["output_tokens"])
            except (KeyError, ValueError, SyntaxError, TypeError):
                raise TraceError(
                    self.path, None, f"window {start:g}: cannot read length distributions"
                ) from None
            ok = inputs and outputs
            self._parsed[start] = (_LengthTable(inputs), _LengthTable(outputs)) if ok else None
        return self._parsed[start]


def _inter_arrival(rng: random.Random, rate: float, cv: float, family: str, shape: float) -> float:
    mean = 1.0 / rate
    if family == "Gamma" and shape > 0:
        return rng.gammavariate(shape, mean / shape)
    if family == "Weibull" and shape > 0:
        return rng.weibullvariate(mean / math.gamma(1 + 1 / shape), shape)
    return rng.expovariate(rate)
