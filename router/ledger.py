"""Counters that several router replicas share, changed only by operations any replica may repeat.

A fairness policy's counters (VTC's service, DLPM's and D²LPM's deficits) are a map from a key
(client, or client and worker) to a number. Kept in a Ledger, every change is recorded as an
operation, and replicas share a ledger through a store that applies each replica's operations
in the order they reach it. What the store holds is then what one router applying every
replica's operations in that order would hold: the one authority. After a sync a replica's
values are the store's, with what it did since its last send replayed on top.

    operation                 written by                                 at the store
    ledger[k] = v             a charge (VTC, DLPM, D²LPM)                add v - old
    raise_to(k, level)        VTC's lift of a client that arrives idle   k := max(k, level)
    lower_to(k, level)        DLPM's: a client leaving keeps its debt,   k := min(k, level)
                              not its unused credit
    refill(ks, quantum)       DLPM's and D²LPM's refill                  if no k in ks is
                                                                         positive, each gets
                                                                         the multiple of the
                                                                         quantum that makes
                                                                         the richest positive
    adjust(k, delta)          D²LPM's activation quantum (and its        never sent
                              refund): this replica's own

Charges are sums, which commute. A lift, a clamp and a refill are idempotent: a client lifted
to L at two replicas between two syncs is lifted to L once (sent as a difference, it would be
lifted twice), and a refill repeated finds a client in credit and does nothing. Kept as each
replica's own instead, lifts made the replicas disagree for good: seconds after the load, 8-16 %
apart on the same counter, the store at about half of either, clients ranked differently.

D²LPM's activation is the exception. A client that becomes active on a worker gets its debt
there plus one quantum; active means outstanding requests through this replica, which only this
replica knows, and a second activation is a second grant, not the same one repeated: no form of
it is idempotent. So it stays this replica's own (`adjust`, kept in `local` and added back after
each sync), as does its refund when the activating request is withdrawn. D²LPM's ledgers agree
across replicas up to those grants; the store decides D²LPM's refills on its values, which
hold none.

Per key, adds, raises and lowers between two refills compose into one function
x -> min(max(x, lo), hi) + add (`Segment`); a refill spans keys and closes the segment. `take`
returns the steps since the last take, `apply_steps` applies them to a store's values (the
simulator's `LedgerStore`; the Redis script in router/proxy/service/shared_state.py does the same
arithmetic in Lua, to the bit), and `rebase` sets a replica's values from the store's.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass

NONE_BELOW, NONE_ABOVE = -math.inf, math.inf


@dataclass(frozen=True, slots=True)
class Segment:
    """Per key, x -> min(max(x, lo), hi) + add: (lo, hi, add), infinite bounds for none."""

    ops: dict[Hashable, tuple[float, float, float]]


@dataclass(frozen=True, slots=True)
class Refill:
    """If none of `keys` is positive, add to each the multiple of `quantum` that makes the
    richest of them positive."""

    keys: tuple[Hashable, ...]
    quantum: float


Step = Segment | Refill


def bounded(x: float, lo: float, hi: float, add: float) -> float:
    """One key's segment function: the store's and the replicas' one arithmetic."""
    if x < lo:
        x = lo
    if x > hi:
        x = hi
    return x + add


def refill_amount(values: Iterable[float], quantum: float) -> float:
    """What a refill adds to each of `values`: 0 if one is positive."""
    richest = max(values, default=1.0)
    if richest > 0:
        return 0.0
    return (math.floor(-richest / quantum) + 1) * quantum


def apply_steps(values: MutableMapping[Hashable, float], steps: Iterable[Step]) -> None:
    """Apply a replica's steps to `values` (a missing key is 0), in order."""
    for step in steps:
        if isinstance(step, Refill):
            add = refill_amount((values.get(k, 0.0) for k in step.keys), step.quantum)
            if add:
                for k in step.keys:
                    values[k] = values.get(k, 0.0) + add
        else:
            for k, (lo, hi, add) in step.ops.items():
                values[k] = bounded(values.get(k, 0.0), lo, hi, add)


class Ledger(dict[Hashable, float]):
    """A dict of floats whose changes are recorded as operations until `take`.

    The open segment is kept as each touched key's value before its first change in it
    (`_base`, without this replica's own adjustments) and its bounds: a charge costs a dict
    lookup, and the recorded add is exactly the change in value.
    """

    __slots__ = ("_base", "_bounds", "_steps", "local")

    def __init__(self) -> None:
        super().__init__()
        self._base: dict[Hashable, float] = {}
        self._bounds: dict[Hashable, tuple[float, float]] = {}
        self._steps: list[Step] = []
        self.local: dict[Hashable, float] = {}  # this replica's own adjustments, never sent

    def __setitem__(self, key: Hashable, value: float) -> None:
        if key not in self._base:
            self._base[key] = self._shared(key)
        dict.__setitem__(self, key, value)

    def setdefault(self, key: Hashable, default: float = 0.0) -> float:  # type: ignore[override]
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def raise_to(self, key: Hashable, level: float) -> None:
        """`key` becomes at least `level` (VTC's lift), here and at the store."""
        self._bound(key, level, max)

    def lower_to(self, key: Hashable, level: float) -> None:
        """`key` becomes at most `level`, here and at the store."""
        self._bound(key, level, min)

    def refill(self, keys: Iterable[Hashable], quantum: float) -> None:
        """If none of `keys` is positive, give each the multiple of `quantum` that makes the
        richest positive; the store repeats it on its values, and does nothing if one is."""
        keys = tuple(keys)
        add = refill_amount((dict.get(self, k, 0.0) for k in keys), quantum)
        if not add:
            return
        self._close()
        self._steps.append(Refill(keys, quantum))
        for k in keys:
            dict.__setitem__(self, k, dict.get(self, k, 0.0) + add)

    def adjust(self, key: Hashable, delta: float) -> None:
        """Change `key` by `delta` here only: never sent, and kept across syncs."""
        if delta:
            self.local[key] = self.local.get(key, 0.0) + delta
            dict.__setitem__(self, key, dict.get(self, key, 0.0) + delta)

    def take(self) -> list[Step]:
        """The steps done here since the last call, for the store."""
        self._close()
        steps, self._steps = self._steps, []
        return steps

    def rebase(self, stored: Mapping[Hashable, float]) -> None:
        """Values := the store's (`stored`), then the steps done here since the last `take`
        (still to send), then this replica's own adjustments."""
        values = {k: stored.get(k, 0.0) for k in (*stored, *self)}
        apply_steps(values, self._steps)
        ops = self._open()
        for k in self._base:  # the open segment now starts from the store's values
            self._base[k] = x = values[k]
            if k in ops:
                values[k] = bounded(x, *ops[k])
        for k, v in values.items():
            dict.__setitem__(self, k, v + self.local.get(k, 0.0))

    # ------------------------------------------------------------------ internals

    def _shared(self, key: Hashable) -> float:
        """`key`'s value without this replica's own adjustments."""
        return dict.get(self, key, 0.0) - self.local.get(key, 0.0)

    def _bound(self, key: Hashable, level: float, side) -> None:
        if key not in self._base:
            self._base[key] = self._shared(key)
        lo, hi = self._bounds.get(key, (NONE_BELOW, NONE_ABOVE))
        base = bounded(self._base[key], lo, hi, 0.0)
        at = level - self.local.get(key, 0.0) - (self._shared(key) - base)  # in the base's terms
        self._bounds[key] = (side(lo, at), side(hi, at))
        dict.__setitem__(self, key, side(dict.get(self, key, 0.0), level))

    def _open(self) -> dict[Hashable, tuple[float, float, float]]:
        """The open segment's function per key."""
        ops = {}
        for k, base in self._base.items():
            lo, hi = self._bounds.get(k, (NONE_BELOW, NONE_ABOVE))
            add = self._shared(k) - bounded(base, lo, hi, 0.0)
            if add or lo != NONE_BELOW or hi != NONE_ABOVE:
                ops[k] = (lo, hi, add)
        return ops

    def _close(self) -> None:
        ops = self._open()
        if ops:
            self._steps.append(Segment(ops))
        self._base, self._bounds = {}, {}


class LedgerStore:
    """The replicas' shared values in memory (the simulator's store): each replica's steps
    applied as they arrive, as the Redis script applies them live."""

    def __init__(self) -> None:
        self.values: dict[Hashable, dict[Hashable, float]] = {}

    def apply(self, ledger: Hashable, steps: Iterable[Step]) -> dict[Hashable, float]:
        """Apply one replica's steps to `ledger`'s values; returns them."""
        values = self.values.setdefault(ledger, {})
        apply_steps(values, steps)
        return values


def ledgers_of(obj: object) -> dict[str, Ledger]:
    """The ledgers an object (a policy or a queue discipline) keeps, by attribute name."""
    return {k: v for k, v in vars(obj).items() if isinstance(v, Ledger)}
