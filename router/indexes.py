"""The prefix indexes a router keeps, and which of them routing reads.

Two different facts, so two indexes:
- what routing believes a worker holds, `view.index`: by level (router.drift), the KV-event
  index (precise), the index of what was routed (approximate: each prompt inserted on the
  worker it is routed to, within capacity), or none (load only);
- `held`, what a worker has computed, which a queue discipline orders by and DLPM charges by.
  Precise: the same KV-event index. Approximate: a prompt joins it when its request is sent to
  the worker, not when it is routed, so a waiting request never counts its own prompt as cached.

Replicas of one router share these (`share`), or learn each other's routing (`learn_routed`).
"""

from __future__ import annotations

from router.prefix_index import PrefixIndex, WorkerId
from router.request import BlockHash, Request
from router.traits import IndexLevel
from router.view import ClusterView

# (prompt blocks, worker, when): a routing decision, as replicas exchange them
RoutedBlocks = tuple[list[BlockHash], WorkerId, float]


class Indexes:
    def __init__(
        self,
        view: ClusterView,
        precise: bool,
        keep_approximate: bool,
        tracks_held: bool,
        believes_routed: bool = True,
    ) -> None:
        self.view = view
        self.precise = precise
        # Whether a routed prompt is believed held where it went: off only when nothing reads
        # the approximate index or its estimates (the router knows).
        self.believes_routed = believes_routed
        # Precise: KV events fill view.index; an approximate one is kept beside it on request
        # (the proxy exports both estimates). Approximate: view.index is the approximate one.
        self.approximate: PrefixIndex | None = (
            PrefixIndex() if precise and keep_approximate else None if precise else view.index
        )
        self.held = view.index if precise else PrefixIndex()
        # Engine placement never asks the router's queues what is cached.
        self.tracks_held = tracks_held
        self._by_level = {IndexLevel.LOAD: PrefixIndex()}  # what each fallback level reads
        if precise:
            self._by_level[IndexLevel.PRECISE] = view.index
        if self.approximate is not None:
            self._by_level[IndexLevel.APPROXIMATE] = self.approximate
        self.level = IndexLevel.PRECISE if precise else IndexLevel.APPROXIMATE
        self.level_changes: list[tuple[float, IndexLevel, IndexLevel]] = []  # (time, from, to)
        # A replica among several logs what it routed, for the others' approximate indexes.
        self.routing_log: list[RoutedBlocks] | None = None

    @property
    def estimates(self) -> bool:
        """Whether routing a request estimates its cached prefix (on either index)."""
        return self.precise or self.believes_routed or self.routing_log is not None

    def routed(self, request: Request, wid: WorkerId, now: float) -> tuple[int, int]:
        """`request` is routed to `wid`: the approximate index believes it holds the prompt
        from now on, and a precise one counts the reuse as a hit. Returns the blocks each
        expected `wid` to hold already (precise, approximate); nothing if nothing reads them."""
        if not self.estimates:
            return 0, 0
        hashes = request.prompt_blocks(self.view.block_size)
        approximate = self.believe(hashes, wid, now)
        precise = self._by_level[IndexLevel.PRECISE].touch(hashes, wid, now) if self.precise else 0
        return precise, approximate

    def believe(self, hashes: list[BlockHash], wid: WorkerId, now: float) -> int:
        """What was routed: `wid` holds `hashes` from now on, in the approximate index (and
        the routing log replicas share). Returns the blocks it was believed to hold already."""
        if self.routing_log is not None and self.approximate is not None:
            self.routing_log.append((hashes, wid, now))
        return self._insert(self.approximate, hashes, wid, now)

    def computed(self, request: Request, wid: WorkerId, now: float) -> None:
        """`wid` computes `request`'s prompt from now on (or received its KV)."""
        if self.tracks_held:
            self._insert(self.held, request.prompt_blocks(self.view.block_size), wid, now)

    def learn_routed(self, routed: list[RoutedBlocks]) -> None:
        """Other replicas' routing decisions, into this one's approximate index."""
        if self.approximate is None:
            return
        for hashes, wid, at in routed:
            if wid in self.view.workers:
                self._insert(self.approximate, hashes, wid, at)

    def share(self, other: Indexes) -> None:
        """Route by `other`'s approximate and held indexes (replicas sharing one store)."""
        self.view.index = self.approximate = other.view.index
        self._by_level[IndexLevel.APPROXIMATE] = other.view.index
        self.held = other.held
        self.view.changed_all()

    def remove_worker(self, wid: WorkerId) -> None:
        """Forget everything `wid` was believed or known to hold."""
        for index in self._all():
            index.remove_worker(wid)

    def set_level(self, level: str, now: float) -> None:
        """Route by the precise index, the approximate one, or none (load only); `level` is
        an `IndexLevel` or the string it names."""
        if level not in self._by_level:
            have = sorted(str(lvl) for lvl in self._by_level)
            raise ValueError(f"index level {str(level)!r}: this router has {have}")
        new = IndexLevel(level)
        if new is not self.level:
            self.level_changes.append((now, self.level, new))
            self.level = new
            self.view.index = self._by_level[new]
            self.view.changed_all()

    def levels(self) -> tuple[IndexLevel, ...]:
        """The fallback levels this router has, best first."""
        return tuple(lvl for lvl in IndexLevel if lvl in self._by_level)

    def _insert(
        self, index: PrefixIndex | None, hashes: list[BlockHash], wid: WorkerId, now: float
    ) -> int:
        """Believe `wid` now holds `hashes`, within its capacity; returns the blocks it held
        already (what a worker holds is prefix-closed, so that is its expected hit)."""
        if index is None:
            return 0
        held_before = len(hashes) - index.insert(hashes, wid, now)
        index.evict(wid, self.view.workers[wid].kv_capacity_blocks)
        self.view.changed(wid)
        return held_before

    def _all(self) -> list[PrefixIndex]:
        out: list[PrefixIndex] = []
        for index in (*self._by_level.values(), self.held, self.approximate):
            if index is not None and all(index is not o for o in out):
                out.append(index)
        return out
