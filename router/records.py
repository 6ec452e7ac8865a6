"""One request's outcome, as the simulator and the live proxy both record it, and the service
it counts as (the fairness definitions every layer shares)."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

# Service a client received, in weighted tokens: input x W_IN + output x W_OUT (VTC's default).
W_IN, W_OUT = 1.0, 2.0


@dataclass(slots=True)
class RequestRecord:
    id: int
    client: str
    session: str | None
    worker: int
    arrival: float
    admitted: float
    first_token: float
    finish: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    preemptions: int
    weight: float = 1.0
    priority: int = 0
    predicted_ttft: float | None = None  # the router's, at routing (classes on)
    # Split fleets: where its prompt was computed (`worker` decoded it), and the seconds its
    # KV took from the prefill worker to the decode worker.
    prefill_worker: int | None = None
    kv_transfer: float | None = None
    api: str | None = None  # the client API that sent it (router.request.APIS); None: unknown

    @property
    def queue_time(self) -> float:
        return self.admitted - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request admission control or a tenant budget turned away (router.classes reasons)."""

    id: int
    client: str
    priority: int
    reason: str
    at: float


def weighted_tokens(prompt_tokens: int, output_tokens: int) -> float:
    return W_IN * prompt_tokens + W_OUT * output_tokens


def service(record: RequestRecord) -> float:
    return weighted_tokens(record.prompt_tokens, record.output_tokens)


# Columns written after the derived ones (queue_time ... e2e): added later, so a reader that
# takes the earlier columns by position finds them where they were.
TRAILING = ("api",)
DERIVED = ("queue_time", "ttft", "tpot", "e2e")  # RequestRecord's properties of those names
CSV_COLUMNS = (
    *(f.name for f in fields(RequestRecord) if f.name not in TRAILING),
    *DERIVED,
    *TRAILING,
)


class RecordWriter:
    """requests.csv, one row per request as it completes (the simulator and the live proxy
    write the same columns, so one report reads both)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w", newline="")  # noqa: SIM115 - closed by close()
        self._csv = csv.writer(self._file)
        self._csv.writerow(CSV_COLUMNS)

    def write(self, r: RequestRecord, flush: bool = False) -> None:
        self._csv.writerow([getattr(r, name) for name in CSV_COLUMNS])
        if flush:
            self._file.flush()

    def write_rows(self, rows: Iterable[Sequence[object]]) -> None:
        """Rows of values already in `CSV_COLUMNS` order."""
        self._csv.writerows(rows)

    def close(self) -> None:
        self._file.close()
