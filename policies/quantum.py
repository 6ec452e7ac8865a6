"""D²LPM's quantum Q^u: the user's, or one adapted to the charges the policy makes.

Deficit round robin (Shreedhar and Varghese) needs a quantum of at least the largest packet:
a smaller one lets a flow send less than one packet a round. D²LPM's packet is a request's
dispatch charge, its extend (uncached) tokens x w_in (with the predicted output under
`charge_output=predicted`); output is charged a token at a time after it. A client that
becomes active on a worker gets its debt there plus one quantum, and more only when every
client active there is in deficit. With a quantum below the charge, a client that arrives at
the holder of its prefix with a little debt is in deficit after one request, and its next one
goes to the shortest queue, away from its cache. A fixed 2,048 tokens is several short
questions, but less than one agent's turn on a long context or one miss on an 8k-token document.

So when the user names no quantum, it follows the charges, as DRR's rule says: the largest
dispatch charge among the last `WINDOW` the policy made, never below `FLOOR` (the fixed
default it replaces, so a workload of small requests runs as before). The charges are those
the policy makes anyway, in its own order, so the simulator and the live proxy adapt alike,
and a replay repeats it exactly. Each router replica keeps its own (a refill carries its
quantum, so replicas that differ still agree on the ledger: router/ledger.py). DRR's bound on
the service gap, a quantum plus a packet, then grows with the largest charge, as VTC's bound
grows with the largest request.

DLPM's local quantum keeps its fixed default. Its refill adds as many quanta as the richest
waiting client needs to pass zero, and a client with nothing waiting drops out, so a quantum
below a request's charge costs no round there: it only sets how finely clients alternate.
"""

from __future__ import annotations

from collections import deque

FLOOR = 2048.0
WINDOW = 512  # admissions: enough to keep the misses among a workload's mostly hits in view


class Quantum:
    """Q^u: `fixed` if given, else the largest of the last `window` charges, at least `floor`.
    `observe` each admission charge; `value` is the quantum now."""

    __slots__ = ("fixed", "floor", "window", "_largest", "_count")

    def __init__(
        self, fixed: float | None = None, floor: float = FLOOR, window: int = WINDOW
    ) -> None:
        if fixed is not None and fixed <= 0:
            raise ValueError(f"quantum: must be positive, got {fixed}")
        self.fixed = fixed
        self.floor, self.window = floor, window
        # A sliding-window maximum: (index, charge) with charges decreasing, so the window's
        # largest is at the front and each charge enters and leaves once.
        self._largest: deque[tuple[int, float]] = deque()
        self._count = 0

    @property
    def value(self) -> float:
        if self.fixed is not None:
            return self.fixed
        largest = self._largest[0][1] if self._largest else 0.0
        return max(self.floor, largest)

    def observe(self, charge: float) -> None:
        if self.fixed is not None:
            return
        largest, i = self._largest, self._count
        self._count += 1
        while largest and largest[-1][1] <= charge:
            largest.pop()
        largest.append((i, charge))
        if largest[0][0] <= i - self.window:
            largest.popleft()
