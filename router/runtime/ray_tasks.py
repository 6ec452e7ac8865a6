"""Simulations fanned out over a Ray cluster.

`fairway compare` and `fairway plan` run their simulations as Ray tasks when given a cluster's
address, or when a Ray cluster runs on this machine already; else in local processes. Either
way they wait on them through one path (simulator.progress.map_runs: results in the order
asked, the command's progress bar moved as each returns), so `RayTasks` is a
concurrent.futures Executor whose calls are Ray tasks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from typing import Any

CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"  # written by `ray start` on this machine


class RayTasks(Executor):
    """Each `submit` a Ray task on the cluster this process joined (`ray_if_wanted`).
    Shutting it down leaves the cluster and its tasks as they are."""

    def __init__(self) -> None:
        import ray

        self._ray = ray
        self._remote: dict[Callable[..., Any], Any] = {}  # a function's task, made once

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        task = self._remote.get(fn)
        if task is None:
            task = self._remote[fn] = self._ray.remote(fn)
        return task.remote(*args, **kwargs).future()

    def put(self, value: object) -> object:
        """`value` stored once in the cluster: passed to many tasks, it is sent once, not with
        each (each task gets the value itself)."""
        return self._ray.put(value)

    @property
    def address(self) -> str:
        """The cluster's GCS address, host:port."""
        return str(self._ray.get_runtime_context().gcs_address)

    def cpus(self) -> int:
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))


@contextlib.contextmanager
def ray_if_wanted(address: str | None) -> Iterator[RayTasks | None]:
    """Tasks on the Ray cluster at `address`, or on the one running on this machine if there
    is one (None: neither, run locally). A cluster joined here is left when the block ends, so
    that a longer-lived caller can join another later. A process joins one cluster in its life:
    if this one has joined already, that cluster is used (and kept) in place of the machine's,
    and asking for another by address is an error."""
    if address is None and not os.path.exists(CURRENT_CLUSTER):
        yield None
        return
    import ray

    if ray.is_initialized():
        if address is not None:
            joined = RayTasks().address
            raise ValueError(
                f"--ray-address: this process has joined the Ray cluster at {joined} already, "
                "and a process joins one; leave --ray-address out to use that cluster"
            )
        yield RayTasks()
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address or "auto", log_to_driver=False)
    try:
        yield RayTasks()
    finally:
        ray.shutdown()
