"""What drivers need to know besides the contract: a policy's speed hints, and a run's modes.

A policy's decisions are its hooks (router/policy.py). Its traits only let a driver skip work
that would change nothing: token hooks that do nothing, decode steps applied one by one where
a sum would do. A policy that declares no traits gets the defaults, which are always right and
at worst slower. Traits that are wrong (a discipline that says FCFS and reorders) make a
simulation wrong, so declare one only when the policy's definition guarantees it.

The modes are what a user picks on the command line or in cluster.yaml. They are `str` enums:
each member equals the string a user types, so configuration parses and compares as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Mode(str, Enum):
    """A choice a user spells as a string: prints and formats as that string."""

    def __str__(self) -> str:
        return str(self.value)


class ReordersOn(Mode):
    """What besides requests joining or leaving can change which request a queue releases next.

    A simulated engine whose head request waits for memory runs decode steps back to back, as
    one event, only while they cannot move the head.
    """

    NOTHING = "nothing"  # arrival order (FCFS)
    CACHE = "cache"  # the blocks the worker holds: a step that evicts can reorder
    TOKENS = "tokens"  # service counted as tokens stream: any step can reorder


class IndexMode(Mode):
    """How the router learns what each worker holds (`--index`, cluster.yaml `index_mode`)."""

    APPROXIMATE = "approximate"  # believe each routed prompt is cached there, within capacity
    PRECISE = "precise"  # hear the workers' KV events


class IndexLevel(Mode):
    """What routing reads now: the drift guard falls back down this list, best first."""

    PRECISE = "precise"  # the KV-event index
    APPROXIMATE = "approximate"  # the index of what was routed
    LOAD = "load"  # no index: every match is empty


class Placement(Mode):
    """Where a simulated worker's queue discipline runs (`--placement`)."""

    ENGINE = "engine"  # inside each engine's scheduler
    ROUTER = "router"  # in the router's dispatch queue, in front of FCFS engines (as live)


class Role(Mode):
    """What a worker does with a request (`--prefill-workers`, cluster.yaml `role`)."""

    MIXED = "mixed"  # prefill and decode, as one server always has
    PREFILL = "prefill"  # computes a prompt's KV (max_tokens 1) and hands it on
    DECODE = "decode"  # receives a prompt's KV and generates its output


@dataclass(frozen=True, slots=True)
class PolicyTraits:
    """Speed hints of a global policy (`GlobalPolicy.traits`).

    counts_tokens: `on_token` (or `on_tokens`) does something. False lets drivers skip token
        hooks, which run per sequence per decode step. A class that says False and defines
        either hook is refused when it is defined.
    tokens_read_at_finish: what `on_token` keeps is read only by `on_finish` (a time per output
        token), never by `route` or `on_dispatch`. A driver may then deliver a request's tokens
        late and summed, stamped with the last one's time, as long as it does before the finish.
    reads_prefixes: `route` or `on_dispatch` reads what workers hold (`view.index`). False lets
        a router keep no index of what it routed when nothing else reads it either (its hit
        estimates are then not made); a policy saying False may find that index empty.
    """

    counts_tokens: bool = True
    tokens_read_at_finish: bool = False
    reads_prefixes: bool = True


@dataclass(frozen=True, slots=True)
class DisciplineTraits:
    """Speed hints of a queue discipline (`LocalPolicy.traits`).

    counts_tokens: `on_token` (or `on_tokens`) does something; as for `PolicyTraits`.
    reorders_on: what besides requests joining or leaving can change the head of the queue.
        A string is taken as the `ReordersOn` it names.
    """

    counts_tokens: bool = True
    reorders_on: ReordersOn = ReordersOn.TOKENS

    def __post_init__(self) -> None:
        object.__setattr__(self, "reorders_on", ReordersOn(self.reorders_on))
