"""First come, first served: vLLM's default queue discipline."""

from __future__ import annotations

from policies.queues import FifoQueue
from router.registry import local_policies
from router.traits import DisciplineTraits, ReordersOn


@local_policies.register("fcfs")
class FCFS(FifoQueue):
    """Arrival order; a preempted request goes back to the front."""

    traits = DisciplineTraits(counts_tokens=False, reorders_on=ReordersOn.NOTHING)
