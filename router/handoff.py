"""A split request's second stage: its prompt computed, it moves to a decode worker.

The core ends the prefill stage (the prefill worker's slot freed, its queue told, the hit it
reports scored); `hand_off` then chooses the decode worker (router.decode) and moves the flight
there, as the decode worker's work and queued request. The core releases what that queue lets
go, as for any routed request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from router.decode import choose_decode
from router.dispatch import DispatchQueue
from router.flight import Flight
from router.indexes import Indexes
from router.load import Load
from router.pools import Pools
from router.prefix_index import WorkerId
from router.view import ClusterView


class DecodeHandoff:
    def __init__(
        self,
        slack: int,
        view: ClusterView,
        pools: Pools,
        queues: dict[WorkerId, DispatchQueue],
        indexes: Indexes,
        load: Load,
    ) -> None:
        self.slack = slack  # router.decode.choose_decode's
        self.view = view
        self.pools = pools
        self.queues = queues
        self.indexes = indexes
        self.load = load
        self.handoffs: Counter[WorkerId] = Counter()  # by decode worker

    def hand_off(self, flight: Flight, now: float, exclude: Iterable[WorkerId]) -> WorkerId | None:
        """Queue `flight`'s request on a decode worker (not in `exclude`): the one it returns,
        or None if none is healthy (the flight is then left as it was)."""
        request = flight.request
        among = self.pools.decode_pool(request, exclude)
        if among is None:
            return None
        among.now = now
        wid = choose_decode(request, among, self.slack)
        flight.prefill_queue = flight.queue
        flight.worker, flight.queue = wid, self.queues[wid]
        flight.split, flight.handed_off, flight.released = False, True, False
        flight.remaining = request.output_len
        self.load.add(wid, request.output_len)
        self.handoffs[wid] += 1
        # It holds the prompt's KV from now on: a later turn's decode may reuse it, and its
        # queue discipline sees it as computed.
        self.indexes.believe(request.prompt_blocks(self.view.block_size), wid, now)
        self.indexes.computed(request, wid, now)
        flight.queue.push(request)
        return wid
