"""Routing policies and queue disciplines. Importing this package registers them all."""

from policies import baselines, d2lpm, dlpm, fcfs, lcf, lpm, preble, vtc  # noqa: F401  (registration)
from router.registry import global_policies, local_policies

__all__ = ["global_policies", "local_policies"]
