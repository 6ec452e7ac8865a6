"""Routing policies and queue disciplines. Importing this package registers them all."""

from router.runtime.native import prefer_native

prefer_native(__path__, __name__)  # before the policies import what is compiled of theirs

from policies import (  # noqa: E402, F401
    baselines,
    d2lpm,
    dlpm,
    fcfs,
    lcf,
    lpm,
    preble,
    preble_local,
    vtc,
)
from router.registry import global_policies, local_policies  # noqa: E402

__all__ = ["global_policies", "local_policies"]
