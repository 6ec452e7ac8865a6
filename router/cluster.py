"""What a policy may see of the cluster: a snapshot-like view, never a clock or a socket."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from router.prefix_index import PrefixIndex, WorkerId


@dataclass(slots=True)
class WorkerState:
    """One worker as the router believes it is.

    `tokens_in_flight` counts work not yet done: prompt tokens not yet prefilled plus output
    tokens not yet generated, over the worker's waiting and running requests.
    """

    id: WorkerId
    healthy: bool = True
    num_waiting: int = 0
    num_running: int = 0
    tokens_in_flight: int = 0
    kv_used_blocks: int = 0
    kv_capacity_blocks: int = 0

    @property
    def num_outstanding(self) -> int:
        return self.num_waiting + self.num_running

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / self.kv_capacity_blocks if self.kv_capacity_blocks else 0.0


class CostEstimates(Protocol):
    """Time estimates policies may use (Preble's prefill-time terms); see simulator.cost_model."""

    def prefill_time(self, num_new_tokens: int, num_cached_tokens: int) -> float: ...

    def decode_time(self, num_seqs: int, context_tokens: int) -> float: ...


@dataclass(slots=True)
class ClusterView:
    """The router's state as handed to a policy.

    The backend (simulator or proxy) owns and mutates it; policies read it and keep their own
    counters through the hooks. `now` is the backend's clock: simulated or monotonic seconds.
    """

    now: float
    workers: dict[WorkerId, WorkerState]
    index: PrefixIndex
    block_size: int
    cost: CostEstimates | None = None

    def healthy_workers(self) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.healthy]

    def routable_workers(self) -> list[WorkerState]:
        """The healthy workers; a policy's `route` starts here, so none means an error."""
        workers = self.healthy_workers()
        if not workers:
            raise RuntimeError("no healthy worker to route to")
        return workers
