"""A run's request records as columns: each field an array (or a list, for strings).

The summary's figures and the fairness curves are array operations over the same fields; a
Python pass over the records for each of them took longer than the last simulated seconds of a
large run, and reading each field once per use still took a tenth of a whole replay's time.

A simulated run keeps its records this way from the start (`RecordLog`): a record's fields in
arrays take about 150 bytes, where a `RequestRecord` with its boxed numbers takes about 360, and
a million-request replay keeps a million of them. `RecordColumns.records` makes the records
again, the same values, for those who read them one by one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import fields
from functools import cached_property
from operator import attrgetter

import numpy as np

from router.records import CSV_COLUMNS, RequestRecord

_CHUNK = 4096

# RequestRecord's fields, in its order (a row is a record's fields in this order), by kind.
FIELDS = tuple(f.name for f in fields(RequestRecord))
_FLOATS = frozenset({"arrival", "admitted", "first_token", "finish", "weight"})
_INTS = frozenset(
    {"id", "worker", "prompt_tokens", "cached_tokens", "output_tokens", "preemptions", "priority"}
)
_OPTIONAL_FLOATS = frozenset({"predicted_ttft", "kv_transfer"})  # NaN for None
_OPTIONAL_INTS = frozenset({"prefill_worker"})  # -1 for None
_STRINGS = frozenset({"client", "session", "api"})  # lists, None kept
assert set(FIELDS) == _FLOATS | _INTS | _OPTIONAL_FLOATS | _OPTIONAL_INTS | _STRINGS, (
    "every RequestRecord field has a column kind"
)


def _column(name: str, values: Sequence[object]) -> np.ndarray | list[object]:
    # fromiter, not np.array: told the type and length, numpy does not first discover the
    # shape and type of a sequence of Python numbers (half the time for floats). A column a
    # simulation leaves all None (no classes, no split fleet) is filled without a pass.
    if name in _FLOATS:
        return np.fromiter(values, np.float64, len(values))
    if name in _INTS:
        return np.fromiter(values, np.int64, len(values))
    if name in _OPTIONAL_FLOATS or name in _OPTIONAL_INTS:
        missing = math.nan if name in _OPTIONAL_FLOATS else -1
        dtype = np.float64 if name in _OPTIONAL_FLOATS else np.int64
        if values.count(None) == len(values):
            return np.full(len(values), missing, dtype)
        return np.fromiter((missing if v is None else v for v in values), dtype, len(values))
    return list(values)


def _values(name: str, column: np.ndarray | list[object]) -> list[object]:
    """A column as the record's values (None where the record had none)."""
    if isinstance(column, list):
        return column
    values = column.tolist()
    if name in _OPTIONAL_FLOATS:
        return [None if v != v else v for v in values]  # NaN is not equal to itself
    if name in _OPTIONAL_INTS:
        return [None if v == -1 else v for v in values]
    return values


class RecordColumns:
    """Records' fields as columns, in the records' order: numbers as numpy arrays (optional
    ones NaN or -1 where None), strings as lists."""

    arrival: np.ndarray
    admitted: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    weight: np.ndarray
    id: np.ndarray
    worker: np.ndarray
    prompt_tokens: np.ndarray
    cached_tokens: np.ndarray
    output_tokens: np.ndarray
    preemptions: np.ndarray
    priority: np.ndarray
    predicted_ttft: np.ndarray
    kv_transfer: np.ndarray
    prefill_worker: np.ndarray
    client: list[str]
    session: list[str | None]
    api: list[str | None]

    def __init__(self, records: Sequence[RequestRecord] = ()) -> None:
        for name in FIELDS:
            setattr(self, name, _column(name, list(map(attrgetter(name), records))))

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[object, ...]]) -> RecordColumns:
        """Rows of a record's fields in `FIELDS` order."""
        out = cls.__new__(cls)
        by_field = list(zip(*rows, strict=True)) if rows else [() for _ in FIELDS]
        for name, values in zip(FIELDS, by_field, strict=True):
            setattr(out, name, _column(name, values))
        return out

    @classmethod
    def joined(
        cls, parts: Sequence[RecordColumns], order: np.ndarray | None = None
    ) -> RecordColumns:
        """`parts` one after another, then taken in `order` (row positions) if given."""
        out = cls.__new__(cls)
        for name in FIELDS:
            columns = [getattr(p, name) for p in parts]
            if name in _STRINGS:
                joined: np.ndarray | list[object] = [v for c in columns for v in c]
                if order is not None:
                    joined = [joined[i] for i in order.tolist()]
            else:
                joined = np.concatenate(columns) if columns else np.empty(0)
                if order is not None:
                    joined = joined[order]
            setattr(out, name, joined)
        return out

    def __len__(self) -> int:
        return len(self.client)

    def rows(self) -> Iterator[tuple[object, ...]]:
        """Each record's fields, in `FIELDS` order."""
        for values in self._chunks({}):
            yield from zip(*(values[name] for name in FIELDS), strict=True)

    def csv_rows(self) -> Iterator[tuple[object, ...]]:
        """Each record's requests.csv row (router.records.CSV_COLUMNS), the derived columns
        computed on the arrays with RequestRecord's arithmetic: the same values, without a
        record made for each row."""
        derived = {
            "queue_time": self.admitted - self.arrival,
            "ttft": self.first_token - self.arrival,
            "tpot": self.tpot_or_nan(),
            "e2e": self.finish - self.arrival,
        }
        for values in self._chunks(derived):
            yield from zip(*(values[name] for name in CSV_COLUMNS), strict=True)

    def _chunks(self, more: dict[str, np.ndarray]) -> Iterator[dict[str, list[object]]]:
        """Every field's values and `more`'s (NaN as None), a chunk of rows at a time: a
        million rows' values at once would take more memory than the columns."""
        for at in range(0, len(self), _CHUNK):
            chunk = slice(at, at + _CHUNK)
            values = {name: _values(name, getattr(self, name)[chunk]) for name in FIELDS}
            for name, column in more.items():
                values[name] = [None if v != v else v for v in column[chunk].tolist()]
            yield values

    def records(self) -> list[RequestRecord]:
        """The records, made again from the columns: the same values as were put in."""
        return [RequestRecord(*row) for row in self.rows()]  # type: ignore[arg-type]

    @cached_property
    def by_client(self) -> dict[str, np.ndarray]:
        """Each client's rows, in the order its requests came, as an index array: a list
        indexing a column is made an array again at every use, about twenty a summary."""
        out: dict[str, list[int]] = {}
        for i, client in enumerate(self.client):
            out.setdefault(client, []).append(i)
        return {client: np.array(rows, dtype=np.intp) for client, rows in out.items()}

    def tpot(self) -> np.ndarray:
        """RequestRecord.tpot of those that have one (more than one output token)."""
        more = self.output_tokens > 1
        return (self.finish[more] - self.first_token[more]) / (self.output_tokens[more] - 1)

    def tpot_or_nan(self) -> np.ndarray:
        """RequestRecord.tpot of every record, NaN where it is None."""
        out = np.full(len(self), np.nan)
        out[self.output_tokens > 1] = self.tpot()
        return out


def columns(records: Sequence[RequestRecord] | RecordColumns) -> RecordColumns:
    """`records` as columns, read now unless they already are."""
    return records if isinstance(records, RecordColumns) else RecordColumns(records)


class RecordLog:
    """A run's records as they come, kept as columns a few thousand at a time."""

    def __init__(self) -> None:
        self._rows: list[tuple[object, ...]] = []
        self._parts: list[RecordColumns] = []  # each of _CHUNK records

    def add(self, row: tuple[object, ...]) -> None:
        """One record's fields, in RequestRecord's order (`FIELDS`)."""
        self._rows.append(row)
        if len(self._rows) >= _CHUNK:
            self._parts.append(RecordColumns.from_rows(self._rows))
            self._rows = []

    def __len__(self) -> int:
        return len(self._parts) * _CHUNK + len(self._rows)

    def columns(self) -> RecordColumns:
        """Every record so far, by id."""
        parts = [*self._parts, RecordColumns.from_rows(self._rows)]
        ids = np.concatenate([p.id for p in parts])
        return RecordColumns.joined(parts, np.argsort(ids, kind="stable"))
