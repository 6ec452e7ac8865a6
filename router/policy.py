"""The policy contract shared by the simulator and the live proxy.

A GlobalPolicy picks a worker for each request; a LocalPolicy is one worker's queue discipline.
Both are plain objects: no I/O, no clock, no logging, no `async`. Time and cluster state arrive
through the ClusterView and the hook arguments, so the same object runs under SimPy time, under
the proxy's monotonic clock, or driven by hand in a test.

Call order for one request, in both backends:

    route(req, view) -> Decision        the backend validates decision.worker is healthy
    on_dispatch(req, worker, view)      the request joined that worker's queue
    on_first_token(req, worker, now)
    on_token(req, worker, n, now)       n output tokens were produced (batched)
    on_finish(req, worker, view)        completed or failed; the request is gone
    on_withdraw(req, worker, view)      instead of the three above: the request left the
                                        worker's dispatch queue without ever running there
                                        (queue timeout, worker down); undo what on_dispatch
                                        charged, so a request that never ran costs nothing

Hooks must not raise for a worker that went down or was removed, nor for a request or client a
policy has forgotten: the backends call them from failure paths too.

Speed hints. Nothing below changes a decision, and a new policy may ignore all of it:
- `traits` (router/traits.py) says what a driver may skip: token hooks that do nothing, tokens
  delivered one by one, decode steps that cannot reorder a queue. The defaults skip nothing.
- `on_tokens` is `on_token` for a batch (a simulated engine's step or run); override it to write
  each account once.
- `GlobalPolicy.progress_read` names the workers whose decode progress a decision reads, or
  says it reads only which worker comes first in a load order (`LeastLoaded`), so a simulator
  brings only those up to date before routing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from router.prefix_index import WorkerId
from router.request import Request
from router.traits import DisciplineTraits, PolicyTraits
from router.view import ClusterView, OrderKey


@dataclass(slots=True, frozen=True)
class LeastLoaded:
    """What `progress_read` answers for a decision that reads one thing of the fleet's load:
    the worker that comes first under `key`, a key that starts with the worker's
    `tokens_in_flight` and whose other terms do not move while requests decode. Decode
    progress only lowers that first term, so a simulator can bound every worker's key from
    below and bring up to date only those whose bound could beat the least exact key."""

    key: OrderKey


@dataclass(slots=True, frozen=True)
class Decision:
    worker: WorkerId
    reason: str = ""


_NO_OP_HOOKS = frozenset({"on_dispatch", "on_first_token", "on_finish"})  # GlobalPolicy's
_NO_OP_DISCIPLINE_HOOKS = frozenset({"on_finish"})  # LocalPolicy's


def overridden_hook(policy: GlobalPolicy | LocalPolicy, name: str) -> Callable[..., None] | None:
    """`policy`'s bound hook `name`, or None where it is its base class's own that does
    nothing: GlobalPolicy's on_dispatch, on_first_token and on_finish, a discipline's
    (LocalPolicy's) on_finish. Each is called once a request or more, and a call that does
    nothing still costs a bound method and an interpreted frame."""
    base: type = GlobalPolicy if isinstance(policy, GlobalPolicy) else LocalPolicy
    no_ops = _NO_OP_HOOKS if base is GlobalPolicy else _NO_OP_DISCIPLINE_HOOKS
    if name in no_ops and getattr(type(policy), name) is getattr(base, name):
        return None
    hook: Callable[..., None] = getattr(policy, name)
    return hook


class GlobalPolicy:
    """Base class with no-op hooks; subclasses implement `route`."""

    name = "?"
    traits: ClassVar[PolicyTraits] = PolicyTraits()
    # The queue discipline a worker's queue runs when the user names none: the one the policy's
    # paper pairs it with (LPM's, VTC's, ...), else first come first served.
    default_local: ClassVar[str] = "fcfs"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        counts = cls.on_token is not GlobalPolicy.on_token or (
            cls.on_tokens is not GlobalPolicy.on_tokens
        )
        _check_counts_tokens(cls, cls.traits.counts_tokens, counts)

    def route(self, request: Request, view: ClusterView) -> Decision:
        """Choose a healthy worker for `request`. Must not mutate `view`."""
        raise NotImplementedError

    def on_dispatch(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        pass

    def on_first_token(self, request: Request, worker: WorkerId, now: float) -> None:
        pass

    def on_token(self, request: Request, worker: WorkerId, num_tokens: int, now: float) -> None:
        pass

    def on_finish(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        pass

    def on_withdraw(self, request: Request, worker: WorkerId, view: ClusterView) -> None:
        """`request` was dispatched to `worker` but never ran there; by default, as finished."""
        self.on_finish(request, worker, view)

    # ------------------------------------------------------------ speed hints

    def on_tokens(
        self, requests: Sequence[Request], worker: WorkerId, num_tokens: int, now: float
    ) -> None:
        """`on_token` for each of a batch on one worker (a simulated engine's step or run):
        a policy charging per token may override it to write each account once."""
        for request in requests:
            self.on_token(request, worker, num_tokens, now)

    def progress_read(
        self, request: Request, view: ClusterView
    ) -> Collection[WorkerId] | LeastLoaded | None:
        """The workers whose decode progress `route` and `on_dispatch` may read for `request`
        (`tokens_in_flight`, `kv_used_blocks`, counters kept by `on_token`), or `LeastLoaded`
        when that is only which worker comes first in a load order; None: any worker.
        A simulator applies those workers' finished decode steps before routing and leaves the
        others' for their run's end, so naming few keeps a decision's cost flat in the fleet."""
        return None


class LocalPolicy:
    """One worker's waiting queue and the order it releases requests in.

    The owner (the simulated engine, or the proxy's per-worker dispatch queue) calls `push` when a
    request arrives, asks `peek` for the next one to start whenever it has room, and `pop`s it once
    it has actually admitted it (`num_cached_tokens` is its prefix-cache hit, for disciplines that
    charge only the extend tokens). A preempted request comes back through `push_front`.

    `cached_blocks(req)` given to `peek` tells how many of the request's leading blocks the worker
    holds right now, for locality-aware orders.
    """

    name = "?"
    traits: ClassVar[DisciplineTraits] = DisciplineTraits()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        counts = cls.on_token is not LocalPolicy.on_token or (
            cls.on_tokens is not LocalPolicy.on_tokens
        )
        _check_counts_tokens(cls, cls.traits.counts_tokens, counts)

    def push(self, request: Request) -> None:
        raise NotImplementedError

    def push_front(self, request: Request) -> None:
        raise NotImplementedError

    def peek(self, cached_blocks: Callable[[Request], int]) -> Request | None:
        raise NotImplementedError

    def pop(self, request: Request, num_cached_tokens: int) -> None:
        """Remove `request` (the one `peek` returned) from the queue: it has started."""
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        """Take a waiting request that never started out of the queue (withdrawn: its caller
        gave up, or its worker went down). Charges nothing; a later `on_finish` for it is not
        sent. A request that is not here is ignored."""
        raise NotImplementedError

    def on_token(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` output tokens of a started request. Must not raise for a request or
        client the discipline does not know (it may have been rebuilt under running requests)."""

    def on_finish(self, request: Request) -> None:
        pass

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError

    # ------------------------------------------------------------ speed hints

    def on_tokens(self, requests: Sequence[Request], num_tokens: int) -> None:
        """`on_token` for each of a batch (an engine's step or run); may be overridden to
        write each account once."""
        for request in requests:
            self.on_token(request, num_tokens)


def _check_counts_tokens(cls: type, declared: bool, defines_hooks: bool) -> None:
    """A class whose traits say its token hooks do nothing must not define any: drivers would
    never call them."""
    if defines_hooks and not declared:
        raise TypeError(
            f"{cls.__qualname__} defines on_token or on_tokens but its traits say "
            "counts_tokens=False: drivers would skip them"
        )
