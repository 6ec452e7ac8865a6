"""SimPy's environment with a second queue of plain calls, for the event a simulation schedules
most: each engine run's end.

A run's end as a SimPy Timeout costs an event object made by interpreted code, an interpreted
`schedule`, and an interpreted `step` to pop it: about 6,000 instructions before the engine
hears of it, a tenth of an 8-worker replay of the Mooncake trace. A call here is a time, an id
and a callable in a compiled heap (simulator/time_heap.py), and compiled code schedules it and
reads the time (`CallQueue`) without an interpreted call.

The order is SimPy's own. A call draws its id from the environment's event counter, as the
Timeout in its place would, and `step` takes the earlier of the two queues' heads by (time,
priority, id), a call having NORMAL priority: events and calls run in exactly the order they
would as Timeouts, at the same times. Everything else is SimPy's: processes, Timeouts,
`run(until=...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, cast, final

from mypy_extensions import mypyc_attr
from simpy.core import Environment
from simpy.events import NORMAL

from simulator.time_heap import TimeHeap

_INF: Final = float("inf")


@final
class EventIds:
    """The environment's event counter (SimPy's `_eid`), compiled: SimPy draws an event's id
    with `next()`, a call with `draw()`, a native call. Compiled, `next()` on an iterator is a
    builtins lookup and a call, about 500 instructions a run's end."""

    __slots__ = ("next_id",)

    def __init__(self) -> None:
        self.next_id = 0

    def draw(self) -> int:
        drawn = self.next_id
        self.next_id = drawn + 1
        return drawn

    def __iter__(self) -> EventIds:
        return self

    def __next__(self) -> object:  # object: mypyc puts an int-returning one in the slot raw
        return self.draw()


@final
class CallQueue:
    """The calls, and the environment's time as of the event or call being run (`now`)."""

    __slots__ = ("now", "_times", "_ids")

    def __init__(self, ids: EventIds, now: float) -> None:
        self.now = now
        # (time, id), each carrying its callable: ids are unique, so this is SimPy's order.
        self._times = TimeHeap()
        self._ids = ids  # the environment's event counter

    def call_later(self, delay: float, call: Callable[[int], None]) -> int:
        """Call `call(id)` `delay` from now, where a Timeout scheduled instead would fire; its
        id. A call cannot be taken back: a caller that schedules anew ignores the stale id."""
        call_id = self._ids.draw()
        self._times.push(self.now + delay, call_id, call)
        return call_id

    def first_at(self) -> float:
        """When the first call is due (inf: none)."""
        return self._times.first_at()

    def before(self, head: tuple[float, int, int, object]) -> bool:
        """Whether the first call comes before the SimPy event queued as `head` (there is a
        first call)."""
        at = self._times.first_at()
        return at < head[0] or (
            at == head[0]
            and (head[1] > NORMAL or (head[1] == NORMAL and self._times.first_id() < head[2]))
        )

    def run_first(self) -> None:
        """Take out the first call and make it, at its time."""
        times = self._times
        at = times.first_at()
        call = cast(Callable[[int], None], times.first_payload())
        call_id = times.pop()
        self.now = at
        call(call_id)


@mypyc_attr(native_class=False)  # a subclass of SimPy's (interpreted) Environment
class FleetEnvironment(Environment):
    # A float clock from the start: SimPy's default is the int 0, which compiled code converts
    # where a time is declared float, and plain Python writes to a record as "0".
    def __init__(self, initial_time: float = 0.0) -> None:
        super().__init__(initial_time)
        # In place of SimPy's count(), before any event is made: SimPy only calls next() on it.
        self._eid = ids = EventIds()  # type: ignore[assignment]
        self.calls = CallQueue(ids, initial_time)

    def peek(self) -> float:
        """When the next event or call is due (inf: none)."""
        return min(super().peek(), self.calls.first_at())

    def step(self) -> None:
        """Run the next event or call."""
        calls, queue = self.calls, self._queue
        at = calls.first_at()
        if at < _INF and (not queue or calls.before(queue[0])):
            self._now = at
            calls.run_first()
            return
        if queue:  # the event SimPy's step pops, and the time its callbacks run at
            calls.now = queue[0][0]
        super().step()
