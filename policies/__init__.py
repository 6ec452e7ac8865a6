"""Routing policies and queue disciplines. Importing this package registers them all."""

from policies import baselines, fcfs  # noqa: F401  (registration side effect)
from router.registry import global_policies, local_policies

__all__ = ["global_policies", "local_policies"]
