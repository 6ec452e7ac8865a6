"""Traffic classes: priority bands, latency targets and what admission control may refuse.

A request's class is found by its priority (vLLM's convention: a lower value is served first,
default 0). A class may carry targets, a time to first token and a time per output token, and a
queue-time limit. Priorities no class names still form bands of their own, without targets.

Bands are strict: a waiting request of a higher band (lower value) always starts before any of
a lower band (`router.bands`); inside a band the configured discipline orders requests as it
would without classes, so tenants stay as fair as before within their band.

Admission control refuses early rather than queueing without end:
- `queue_time`: the request waited in a router queue longer than its class allows, never
  having started (it is withdrawn, charged nothing, and answered 503 with Retry-After);
- `unmeetable`: at arrival no worker's predicted time to first token meets the class's target
  (router.latency), so serving it would miss the target and delay the requests behind.
Tenant budgets (`rate_limit`) refuse with 429 before routing (router.budgets).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from router.request import Request

# Why a request was refused; the reasons counted in /metrics and in a run's summary.
QUEUE_TIME = "queue_time"
UNMEETABLE = "unmeetable"
RATE_LIMIT = "rate_limit"
# A split request whose prefill finished when no decode worker was left to take it.
NO_DECODE_WORKER = "no_decode_worker"
REFUSAL_REASONS = (QUEUE_TIME, UNMEETABLE, RATE_LIMIT)  # what a class's table shows


@dataclass(frozen=True, slots=True)
class TrafficClass:
    """`ttft`/`tpot`: latency targets in seconds (None: none); `max_queue_time`: the longest a
    request may wait in a router queue before it is refused (None: no limit)."""

    name: str
    priority: int = 0
    ttft: float | None = None
    tpot: float | None = None
    max_queue_time: float | None = None

    def __post_init__(self) -> None:
        for field in ("ttft", "tpot", "max_queue_time"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"classes.{self.name}.{field}: must be positive, got {value}")

    def meets(self, ttft: float, tpot: float | None) -> bool:
        """Whether a request answered with these latencies met both of the class's targets
        (`tpot` None: one output token, nothing to meet)."""
        if self.ttft is not None and ttft > self.ttft:
            return False
        return self.tpot is None or tpot is None or tpot <= self.tpot


class Refused(RuntimeError):
    """Admission control turned the request away; `retry_after` is a hint in seconds."""

    def __init__(self, reason: str, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class ClassTable:
    """The configured classes by priority; a priority none names gets a class of its own."""

    def __init__(self, classes: Iterable[TrafficClass] = ()) -> None:
        self.by_priority: dict[int, TrafficClass] = {}
        self._unnamed: dict[int, TrafficClass] = {}
        names: set[str] = set()
        for c in classes:
            if c.name in names:
                raise ValueError(f"classes: {c.name!r} is named twice")
            if c.priority in self.by_priority:
                other = self.by_priority[c.priority].name
                raise ValueError(f"classes.{c.name}.priority: {c.priority} is {other!r}'s too")
            names.add(c.name)
            self.by_priority[c.priority] = c

    @classmethod
    def of(cls, raw: Mapping[str, Mapping[str, object]] | None) -> ClassTable:
        """From configuration: {name: {priority, ttft, tpot, max_queue_time}}."""
        out = []
        for name, fields in (raw or {}).items():
            unknown = set(fields) - {"priority", "ttft", "tpot", "max_queue_time"}
            if unknown:
                raise ValueError(f"classes.{name}: unknown field(s) {sorted(unknown)}")
            out.append(TrafficClass(name, **fields))  # type: ignore[arg-type]
        return cls(out)

    def of_request(self, request: Request) -> TrafficClass:
        return self.of_priority(request.priority)

    def of_priority(self, priority: int) -> TrafficClass:
        found = self.by_priority.get(priority) or self._unnamed.get(priority)
        if found is None:
            found = self._unnamed[priority] = TrafficClass(f"priority {priority}", priority)
        return found

    def priorities(self) -> list[int]:
        """The configured classes' priorities, highest band first."""
        return sorted(self.by_priority)

    def __bool__(self) -> bool:
        return bool(self.by_priority)

    def __iter__(self) -> Iterator[TrafficClass]:
        return iter(sorted(self.by_priority.values(), key=lambda c: c.priority))
