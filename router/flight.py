"""What the router core keeps of a routed request, and what its calls return to a driver."""

from __future__ import annotations

from dataclasses import dataclass

from router.dispatch import DispatchQueue
from router.policy import Decision
from router.prefix_index import WorkerId
from router.request import Request


@dataclass(slots=True)
class Flight:
    """A routed request until it finishes or is withdrawn."""

    request: Request
    worker: WorkerId
    queue: DispatchQueue  # kept even if the worker is removed: its slot is freed on finish
    remaining: int  # tokens of work not yet done: the prompt until its first token, then output
    predicted: dict[str, int]  # hit tokens each index expected, for the drift guard
    best: int  # hit tokens the best index kept expected (scored even while not routed by)
    # The worker the global policy chose, which its hooks name: `worker` until a split
    # request is handed to its decode worker, the prefill worker after.
    charged_to: WorkerId
    split: bool = False  # on a prefill worker, to be handed to a decode worker (`prefilled`)
    handed_off: bool = False  # on its decode worker: its prompt was computed elsewhere
    # Handed off: the prefill worker's queue, whose discipline is charged its output too.
    prefill_queue: DispatchQueue | None = None
    prefill: int = 0  # prompt tokens it will compute, until its first token (ahead of others)
    prefill_pairs: float = 0.0  # their attention pairs, after its cached prefix
    predicted_ttft: float | None = None  # at routing, with classes on
    released: bool = False


@dataclass(slots=True)
class Routed:
    decision: Decision
    hit_blocks: int  # the routing index's expected hit on the chosen worker
    approximate_hit_blocks: int  # the approximate index's, when both are kept (else the same)
    released: list[Request]  # what the chosen worker's queue lets go now (this one, or others)
    adapter_load: bool = False  # the worker was not believed to hold the request's adapter
    predicted_ttft: float | None = None  # seconds from now, on the chosen worker (classes on)
    split: bool = False  # a prefill worker: the request goes on to a decode worker after


@dataclass(slots=True)
class Handoff:
    """A split request's prompt is computed: where it decodes, and what the queues release."""

    decode: WorkerId | None  # None: no decode worker is healthy, and the request has ended
    released_prefill: list[Request]  # what the prefill worker's queue lets go now
    released: list[Request]  # what the decode worker's queue lets go now (this one, or others)
