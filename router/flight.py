"""What the router core keeps of a routed request, and what its calls return to a driver."""

from __future__ import annotations

from dataclasses import dataclass

from router.dispatch import DispatchQueue
from router.policy import Decision
from router.prefix_index import WorkerId
from router.request import Request


class Flight:
    """A routed request until it finishes or is withdrawn.

    Flight and Routed are plain classes, not dataclasses: compiled, a dataclass's generated
    __init__ stays interpreted, and each routed request makes one of each."""

    __slots__ = (
        "request", "worker", "queue", "remaining", "predicted", "best", "charged_to", "split",
        "handed_off", "prefill_queue", "prefill", "prefill_pairs", "predicted_ttft", "released",
    )  # fmt: skip

    def __init__(
        self,
        request: Request,
        worker: WorkerId,
        queue: DispatchQueue,
        remaining: int,
        predicted: dict[str, int],
        best: int,
        charged_to: WorkerId,
        split: bool = False,
    ) -> None:
        self.request = request
        self.worker = worker
        # Kept even if the worker is removed: its slot is freed on finish.
        self.queue = queue
        # Tokens of work not yet done: the prompt until its first token, then output.
        self.remaining = remaining
        self.predicted = predicted  # hit tokens each index expected, for the drift guard
        # Hit tokens the best index kept expected (scored even while not routed by).
        self.best = best
        # The worker the global policy chose, which its hooks name: `worker` until a split
        # request is handed to its decode worker, the prefill worker after.
        self.charged_to = charged_to
        self.split = split  # on a prefill worker, to be handed to a decode worker (`prefilled`)
        self.handed_off = False  # on its decode worker: its prompt was computed elsewhere
        # Handed off: the prefill worker's queue, whose discipline is charged its output too.
        self.prefill_queue: DispatchQueue | None = None
        self.prefill = 0  # prompt tokens it will compute, until its first token (ahead of others)
        self.prefill_pairs = 0.0  # their attention pairs, after its cached prefix
        self.predicted_ttft: float | None = None  # at routing, with classes on
        self.released = False


class Routed:
    """What `Router.route` returns to a driver."""

    __slots__ = (
        "decision", "hit_blocks", "approximate_hit_blocks", "released", "adapter_load",
        "predicted_ttft", "split",
    )  # fmt: skip

    def __init__(
        self,
        decision: Decision,
        hit_blocks: int,
        approximate_hit_blocks: int,
        released: list[Request],
        adapter_load: bool = False,
        predicted_ttft: float | None = None,
        split: bool = False,
    ) -> None:
        self.decision = decision
        self.hit_blocks = hit_blocks  # the routing index's expected hit on the chosen worker
        # The approximate index's, when both are kept (else the same).
        self.approximate_hit_blocks = approximate_hit_blocks
        # What the chosen worker's queue lets go now (this one, or others).
        self.released = released
        self.adapter_load = adapter_load  # the worker was not believed to hold its adapter
        self.predicted_ttft = predicted_ttft  # seconds from now, on the chosen worker (classes on)
        self.split = split  # a prefill worker: the request goes on to a decode worker after


@dataclass(slots=True)
class Handoff:
    """A split request's prompt is computed: where it decodes, and what the queues release."""

    decode: WorkerId | None  # None: no decode worker is healthy, and the request has ended
    released_prefill: list[Request]  # what the prefill worker's queue lets go now
    released: list[Request]  # what the decode worker's queue lets go now (this one, or others)
