"""Counters that several router replicas can share: every change is an addition.

A fairness policy's counters (VTC's service, DLPM's and D²LPM's deficits) are a map from a key
(client, or client and worker) to a number. Kept in a Ledger, each write is recorded as the
difference it made, so replicas share a ledger by exchanging those differences: a replica adds
what it charged locally, and at each sync applies what the others charged since the last one.
Sums commute, so every replica converges on the same totals whatever order the syncs come in.

Only service charges are shared. A lift (VTC), a refill or a clamp (DLPM, D²LPM) is an
adjustment a replica makes from what its own queue looks like; shared, every replica making it
would apply it once for each replica that did. `adjust` makes such a change and keeps it this
replica's own, also across a live sync that resets values to the store's totals (`local`).

Between syncs each replica sees its own charges at once and the others' late: that lag is what
the sync interval trades, in the simulator (`--routers N --router-sync S`) as live.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping


class Ledger(dict[Hashable, float]):
    """A dict of floats that records, per key, the sum of the changes made since `take`."""

    __slots__ = ("_pending", "local")

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict[Hashable, float] = {}
        self.local: dict[Hashable, float] = {}  # this replica's own adjustments, never sent

    def __setitem__(self, key: Hashable, value: float) -> None:
        delta = value - dict.get(self, key, 0.0)
        if delta:
            self._pending[key] = self._pending.get(key, 0.0) + delta
        dict.__setitem__(self, key, value)

    def setdefault(self, key: Hashable, default: float = 0.0) -> float:  # type: ignore[override]
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def adjust(self, key: Hashable, delta: float) -> None:
        """Change `key` by `delta` here only (a lift, a refill, a clamp): not sent to others."""
        if delta:
            self.local[key] = self.local.get(key, 0.0) + delta
            dict.__setitem__(self, key, dict.get(self, key, 0.0) + delta)

    def raise_to(self, key: Hashable, level: float) -> None:
        """`key` becomes at least `level`, here only."""
        self.adjust(key, max(level - dict.get(self, key, 0.0), 0.0))
        if key not in self:
            dict.__setitem__(self, key, 0.0)

    def take(self) -> dict[Hashable, float]:
        """The changes made here since the last call, to send to the other replicas."""
        pending, self._pending = self._pending, {}
        return pending

    def apply(self, changes: Mapping[Hashable, float]) -> None:
        """Add the other replicas' changes (not recorded as this replica's own)."""
        for key, delta in changes.items():
            dict.__setitem__(self, key, dict.get(self, key, 0.0) + delta)


def ledgers_of(obj: object) -> dict[str, Ledger]:
    """The ledgers an object (a policy or a queue discipline) keeps, by attribute name."""
    return {k: v for k, v in vars(obj).items() if isinstance(v, Ledger)}
