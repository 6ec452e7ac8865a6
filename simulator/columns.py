"""A run's request records as columns: each field read once into an array.

The summary's figures and the fairness curves are array operations over the same fields; a
Python pass over the records for each of them took longer than the last simulated seconds of a
large run, and reading each field once per use still took a tenth of a whole replay's time.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from router.records import RequestRecord


class RecordColumns:
    """`records`' numeric fields as arrays (in the records' order), and each client's rows."""

    _FLOATS = ("arrival", "admitted", "first_token", "finish", "weight")
    _INTS = ("prompt_tokens", "cached_tokens", "output_tokens", "preemptions")

    def __init__(self, records: Sequence[RequestRecord]) -> None:
        self.records = records
        self.arrival, self.admitted, self.first_token, self.finish, self.weight = (
            self._read(name, np.float64) for name in self._FLOATS
        )
        self.prompt_tokens, self.cached_tokens, self.output_tokens, self.preemptions = (
            self._read(name, np.int64) for name in self._INTS
        )
        # Each client's rows, in the order its requests came.
        self.by_client: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            self.by_client.setdefault(r.client, []).append(i)

    def __len__(self) -> int:
        return len(self.records)

    def _read(self, name: str, dtype: type) -> np.ndarray:
        records = self.records
        return np.fromiter(map(attrgetter(name), records), dtype=dtype, count=len(records))

    def tpot(self) -> np.ndarray:
        """RequestRecord.tpot of those that have one (more than one output token)."""
        more = self.output_tokens > 1
        return (self.finish[more] - self.first_token[more]) / (self.output_tokens[more] - 1)


def columns(records: Sequence[RequestRecord] | RecordColumns) -> RecordColumns:
    """`records` as columns, read now unless they already are."""
    return records if isinstance(records, RecordColumns) else RecordColumns(records)
