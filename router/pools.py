"""Which workers a request may go to: model groups, and a split fleet's prefill and decode pools.

    view (every worker)
      ├─ routing pools, by model group (None: the fleet's one model)   route() starts here
      │    a split fleet's: the workers that prefill (mixed and prefill ones)
      └─ decode pools, by model group                                   prefilled() picks here

Each pool is a tracked part of the view (ClusterView.new_part): its orders (least loaded, ...)
are kept as workers change, never rescanned per request. A fleet of one model whose workers
are all mixed has no pools: every request is routed over the whole view.
"""

from __future__ import annotations

from collections.abc import Iterable

from mypy_extensions import mypyc_attr

from router.prefix_index import WorkerId
from router.request import Request
from router.traits import Role
from router.view import ClusterView, WorkerState


@mypyc_attr(native_class=False)  # compiled, a class may not extend a builtin exception
class UnknownModel(LookupError):
    """The request names a model group no worker serves."""


class Pools:
    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.is_split = False  # some worker prefills or decodes only
        self._routing: dict[str | None, ClusterView] = {}
        self._decode: dict[str | None, ClusterView] = {}

    def add(self, state: WorkerState) -> None:
        """A new worker joins its model group's pool by its role."""
        role = Role(state.role)
        if role is not Role.MIXED and not self.is_split:
            self.is_split = True
            for other in self.view.workers.values():  # the one model's workers join a pool
                if other.model is None and other.id != state.id:
                    self.view.join_part(other.id, self._pool(self._routing, None))
        if role is Role.DECODE:
            self.view.join_part(state.id, self._pool(self._decode, state.model))
        elif state.model is not None or self.is_split:
            self.view.join_part(state.id, self._pool(self._routing, state.model))

    def remove(self, wid: WorkerId) -> None:
        self.view.leave_part(wid)

    def routing_pool(self, request: Request) -> ClusterView:
        """The tracked view routing starts from for `request`: its model group's workers, and
        of them the ones that prefill in a split fleet (the whole fleet otherwise)."""
        if self._routing and (request.model is not None or self.is_split):
            group = self._routing.get(request.model)
            if group is None or not group.workers:
                raise UnknownModel(f"no worker serves model {request.model!r}")
            return group
        return self.view

    def has_decode(self, request: Request) -> bool:
        """Some decode worker of `request`'s model group is healthy."""
        pool = self._decode.get(request.model)
        return pool is not None and bool(pool.healthy_set())

    def decode_pool(self, request: Request, exclude: Iterable[WorkerId]) -> ClusterView | None:
        """The decode workers `request` may be handed to (not in `exclude`); None if no healthy
        one is left. The tracked pool keeps its orders over its healthy workers, so a handoff
        costs the same on any fleet; exclusions (a decode worker that failed it) take a pass."""
        pool = self._decode.get(request.model)
        if pool is None:
            return None
        excluded = set(exclude)
        if excluded:
            pool = pool.among({w: s for w, s in pool.workers.items() if w not in excluded})
        return pool if pool.healthy_set() else None

    def models(self) -> list[str]:
        """The model groups some worker serves (known workers, healthy or not)."""
        pools = [*self._routing.items(), *self._decode.items()]
        return sorted({m for m, pool in pools if m is not None and pool.workers})

    def _pool(self, pools: dict[str | None, ClusterView], model: str | None) -> ClusterView:
        pool = pools.get(model)
        if pool is None:
            pool = pools[model] = self.view.new_part()
        return pool
