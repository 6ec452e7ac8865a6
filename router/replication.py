"""What router replicas share: the indexes they route by, and their policies' counters.

Replicas in front of one fleet (the simulator's `routers`, the proxy's replicas through Redis)
should route as one router would: they can read one approximate index, and the counters each
policy and queue discipline holds (router.ledger) are kept in step between them. A router names
here what it has to share; the drivers do the sharing, each through its own store.
"""

from __future__ import annotations

from router.dispatch import DispatchQueue
from router.indexes import Indexes
from router.ledger import Ledger, ledgers_of
from router.policy import GlobalPolicy
from router.prefix_index import WorkerId


class Replication:
    def __init__(
        self, policy: GlobalPolicy, queues: dict[WorkerId, DispatchQueue], indexes: Indexes
    ) -> None:
        self.policy = policy
        self.queues = queues
        self.indexes = indexes

    def share_indexes(self, other: Replication) -> None:
        """Route by `other`'s approximate and held indexes."""
        self.indexes.share(other.indexes)

    def ledgers(self) -> dict[tuple[object, ...], Ledger]:
        """The global policy's counters, and each worker's queue discipline's, keyed so that
        replicas' keys for the same thing match."""
        out: dict[tuple[object, ...], Ledger] = {
            ("global", name): ledger for name, ledger in ledgers_of(self.policy).items()
        }
        for queue in self.queues.values():
            out.update(queue.ledgers())
        return out
