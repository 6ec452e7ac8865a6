"""A vLLM-like engine on SimPy time: continuous batching, chunked prefill, paged KV, preemption.

One step, as vLLM's (V1) scheduler makes it:
  1. running sequences first, in admission order: a decoding one takes 1 token, a prefilling one
     the rest of its prompt up to the remaining token budget (chunked prefill). If the KV blocks
     for that do not fit, the most recently admitted running sequence (with priority
     scheduling, the lowest-priority one) is preempted (its blocks freed, to be recomputed
     later) until they do. Like vLLM, a waiting request never preempts a running one;
  2. then, unless something was preempted, waiting requests in the local policy's order while
     budget and `max_num_seqs` allow; each starts from its longest cached prefix.
A sequence whose every known token has been computed samples one new token at the end of a step.

Speed: once every sequence in the batch decodes and nothing waiting can be admitted, the next
steps are fully determined, so one SimPy event covers all of them up to the first finish or
block shortage (`_plan_decode_run`); a step that ends every prompt it prefills is the first step
of such a run when nothing waits at all, or waits only for a sequence slot. When nothing waits,
the chunks of a long prompt ahead of that step are known too, and lead the same run
(`_plan_chunks`). An arrival ends such a run at the next step boundary, and `sync(now)` applies
exactly the steps that have ended, so anything that looks at the engine mid-run (the router
building its view) sees what step-by-step simulation would show.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol, final

from mypy_extensions import i64

from router.cost_model import CostModel, StepCost, StepEnds, StepShape
from router.policy import LocalPolicy, overridden_hook
from router.request import Request
from router.runtime.native import rebuilt
from router.traits import ReordersOn
from simulator.block_manager import BlockManager, BlockTable, KVEventSink
from simulator.environment import FleetEnvironment


@dataclass(slots=True, frozen=True)
class EngineConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: what the cost model's memory holds
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    fast_forward: bool = True
    max_run_steps: int = 4096
    check_invariants: bool = False  # tests: verify block accounting after every change
    # LoRA: adapters resident at once (vLLM's --max-loras; 0: adapters are not modelled) and
    # the seconds a step takes longer for each adapter it loads.
    adapter_slots: int = 0
    adapter_load_time: float = 0.0
    # vLLM's --scheduling-policy priority: when running sequences need blocks that are not
    # free, the victim is the lowest-priority one (largest (priority, arrival)), not the last
    # admitted. (The waiting order is the local discipline's: router.bands for priorities.)
    priority_preemption: bool = False

    def __reduce__(self) -> tuple[type, tuple]:
        return rebuilt(self)


class Seq:
    """Engine-side state of one request."""

    __slots__ = (
        "req",
        "prompt_len",
        "output_len",
        "table",
        "hashes",
        "num_computed",
        "num_output",
        "num_cached_tokens",
        "num_preemptions",
        "admitted_at",
        "first_token_at",
        "finished_at",
        "worker",
        "preloaded",
    )

    def __init__(self, req: Request, worker: int, block_size: int, preloaded: bool = False) -> None:
        self.req = req
        # i64, native 64-bit integers once compiled (plain ints otherwise): the per-step passes
        # over the running batch read them, and Python's ints cost a tag check and reference
        # counting at every operation (-15 % of the instructions on Mooncake's lengths-only
        # replay).
        self.prompt_len: i64 = req.prompt_len
        self.output_len: i64 = req.output_len
        self.table = BlockTable()
        # Only full prompt blocks are ever cached.
        self.hashes = req.prompt_blocks(block_size)
        self.num_computed: i64 = 0  # tokens whose KV exists (prompt, then generated ones fed back)
        self.num_output: i64 = 0
        self.num_cached_tokens: int | None = None  # prefix hit at first admission
        self.num_preemptions = 0
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.worker = worker
        # Its prompt's KV came from a prefill worker (a split fleet's decode side): admitted,
        # it computes only the prompt's last token. A preemption drops that: it recomputes.
        self.preloaded = preloaded

    @property
    def total_len(self) -> i64:
        return self.prompt_len + self.num_output


class EngineListener(Protocol):
    """What an engine tells its driver, as it happens: the contract every listener keeps.

    Each call comes from inside the engine, at the simulated time of what it reports (`now`, a
    step's end). `on_first_token`, `on_tokens` and `on_tokens_settled` come while a step is
    being applied: a listener reads the sequences they name and calls nothing on the engine.
    `on_finish` comes once its step is applied: a listener may submit more (what the finish
    freed room for). The engine reads `counts_tokens`, `defers_tokens` and the methods once,
    when it is built: set them before, never after. `simulator.listener.ListenerDefaults` has
    what a listener may leave out."""

    # Whether the listener hears `on_tokens` at all. False: the engine never calls it, and a
    # step costs nothing more per token for it.
    counts_tokens: bool
    # Whether it takes decode progress in sum between run boundaries (`on_progress`, then
    # `on_tokens_settled`) in place of `on_tokens` and `on_engine_changed` for each step.
    # An engine with a KV-event sink ignores it: its evictions are events, at their own time.
    defers_tokens: bool

    def on_first_token(self, seq: Seq, now: float) -> None:
        """`seq` sampled its first token, at the end of the step that computed its prompt's
        last token: once per request (not again after a preemption)."""

    def on_tokens(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
        """Each of `seqs` (one engine's batch, never empty) produced `num_tokens` more: one call
        per step or run of steps applied. Only if `counts_tokens`."""

    def on_finish(self, seq: Seq, now: float) -> None:
        """`seq` ended (its output done, or cut short by `Engine.abort`): its blocks are free
        and it has left the running batch. Not called for a request withdrawn unstarted."""

    def on_engine_changed(self, engine: Engine) -> None:
        """Anything a router would see moved (requests waiting, KV in use, when the next step
        ends): told once per change, so a driver never polls its engines."""

    def on_progress(
        self, engine: Engine, num_tokens: int, kv_used_blocks: int, next_step_end: float
    ) -> None:
        """Only if `defers_tokens`: decode steps applied mid-run, in sum. The engine's
        sequences made `num_tokens` in all and it uses `kv_used_blocks`; its next step ends at
        `next_step_end`. In place of `on_engine_changed`: nothing else moved."""

    def on_tokens_settled(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
        """Only if `defers_tokens`: each of `seqs` made `num_tokens` of the tokens told in sum
        by `on_progress` since the run began (at the run's end, or before anything reads one)."""


class _Cohort:
    """The sequences of a run that decode one token in every one of its steps, advanced as one.

    A router reading every engine's load brings each engine up to date after every arrival,
    mid-run: those steps go to the cohort's shared counter `lag` and to the engine's totals,
    at a cost that does not grow with the batch, while each sequence keeps the fields it had
    when the cohort formed until `catch_up` (at the run's end, or before anything reads one).
    The blocks the lagging steps take are counted, not allocated:

        formed    a sequence at c = q * bs + r computed tokens holds q + 1 blocks (those of
                  the step in progress, allocated)
        lag p     it needs q + ceil((r + p) / bs): floor((r + p - 1) / bs) more, that is
                  (p - 1) // bs, plus one if r >= bs - (p - 1) % bs: one bisection over the
                  sorted residues r counts that for the whole cohort
    """

    __slots__ = ("seqs", "lag", "owed_blocks", "is_caught_up", "_residues", "_block_size")

    def __init__(self, seqs: list[Seq], block_size: int) -> None:
        self.seqs = seqs
        self.lag = 0  # steps applied in sum, to the engine but not yet to each sequence
        self.owed_blocks = 0  # the blocks those steps take, not yet allocated
        # Once caught up, its sequences no longer hold the blocks of a step in progress, so
        # counting from formation no longer holds: no more steps in sum.
        self.is_caught_up = False
        self._block_size = block_size
        # Each sequence's computed tokens modulo the block size when formed, sorted; counted
        # on the first step in sum (a run applied only at its end never needs them).
        self._residues: list[int] | None = None

    def advance(self, num_steps: int) -> None:
        """`num_steps` more steps in sum. Only from formation: never after `catch_up` (the
        engine cuts a run short once its sequences are read mid-run)."""
        bs, residues = self._block_size, self._residues
        assert not self.is_caught_up, "a cohort advances in sum only from its formation"
        if residues is None:
            residues = self._residues = sorted(seq.num_computed % bs for seq in self.seqs)
        self.lag += num_steps
        t = self.lag - 1
        crossed = len(residues) - bisect_left(residues, bs - t % bs)
        self.owed_blocks = len(residues) * (t // bs) + crossed

    def catch_up(self, blocks: BlockManager, num_steps: int) -> int:
        """Each sequence made the steps in sum and `num_steps` more: its tokens and the blocks
        they fill. Returns how many that is for each."""
        bs: i64 = self._block_size
        steps: i64 = self.lag + num_steps
        for seq in self.seqs:
            table = seq.table
            seq.num_computed = computed = seq.num_computed + steps
            seq.num_output += steps
            need = (computed + bs - 1) // bs - len(table.hashed) - table.num_anonymous
            if need > 0:
                blocks.allocate(table, need)
        self.lag = self.owed_blocks = 0
        self.is_caught_up = True
        return steps


@final
class _Step:
    """One step's batch: each of `seqs` computes all it has left when the step starts (the
    rest of its prompt, or the token it sampled last), but the last, which computes
    `last_short` fewer. A token budget cuts at most one sequence short, and nothing is
    scheduled after it.

    No list of each sequence's tokens: compiled, filling one boxed and stored an int per
    sequence per step, and the passes read it back; on Mooncake's lengths-only replay, where a
    step is some 30 decodes beside one prompt chunk, that was 7 % of the instructions.

    The step the engine schedules is also summed into its shape as it is scheduled (`count`),
    not in a pass of its own; steps planned ahead are priced by `_shape_at`."""

    __slots__ = ("seqs", "last_short", "num_tokens", "pairs", "kv_read", "num_decodes")

    def __init__(self, seqs: list[Seq] | None = None, last_short: i64 = 0) -> None:
        self.seqs: list[Seq] = seqs if seqs is not None else []
        self.last_short: i64 = last_short
        self.num_tokens: i64 = 0
        self.pairs: i64 = 0  # summed exactly; as a float, each partial sum was exact too
        self.kv_read: i64 = 0
        self.num_decodes: i64 = 0

    def count(self, seq: Seq, num_new: i64, sign: i64 = 1) -> None:
        """`seq`, at the tokens it has computed, computes `num_new` in this step: into the
        step's shape (`sign` -1: out of it, a victim the scheduling pass took back)."""
        context = seq.num_computed
        self.num_tokens += sign * num_new
        self.pairs += sign * (num_new * context + ((num_new * (num_new + 1)) >> 1))
        self.kv_read += sign * (context + num_new)
        # Decoding: one token after those it sampled. A prompt's last token alone is a
        # prefill; a recomputation left with one token costs as a decode and counts as one.
        if num_new == 1 and seq.num_output > 0:
            self.num_decodes += sign

    def shape(self) -> StepShape:
        return StepShape(self.num_tokens, float(self.pairs), self.kv_read, self.num_decodes)

    def add(self, seq: Seq, short: i64 = 0) -> None:
        """`seq` joins, computing all it has left but `short` tokens (a budget's cut)."""
        self.seqs.append(seq)
        self.last_short = short

    def end_of(self, k: int, total: i64) -> i64:
        """The tokens `seqs[k]` has computed once this step ends, `total` those it knows (its
        prompt and what it sampled): all of them, but the last sequence's cut."""
        return total - self.last_short if k == len(self.seqs) - 1 else total


# A run without a lead (most runs) shares these: read, never changed.
_NO_LEAD: Final[list[_Step]] = []
_NO_LEAD_TOKENS: Final[list[int]] = []


class _Run:
    """Steps planned as one event: `batch` is the step after the `lead` steps' (each a batch
    of its own, usually none); later steps decode.
    (A plain class, not a dataclass: compiled, a dataclass's generated __init__ stays
    interpreted, and a run is planned several times per request.)"""

    __slots__ = (
        "batch", "lead", "lead_tokens", "ends", "cohort", "prefills", "applied", "finishing",
        "end_call",
    )  # fmt: skip

    def __init__(
        self,
        batch: _Step,
        ends: StepEnds,
        cohort: _Cohort | None = None,
        lead: list[_Step] | None = None,
        lead_tokens: list[int] | None = None,
    ) -> None:
        self.batch = batch
        # Prefill steps ahead of `batch`'s: a prompt's chunks up to the step that ends it,
        # when nothing waits to join them (`Engine._plan_chunks`). Each samples a token of
        # `lead_tokens` sequences that decode, or (-1) a prompt's first token.
        self.lead = lead if lead is not None else _NO_LEAD
        self.lead_tokens = lead_tokens if lead_tokens is not None else _NO_LEAD_TOKENS
        self.ends = ends  # when each step ends
        # Every step of the run decodes one token per sequence, step 1 included (its blocks
        # were allocated while planning), or every step after the lead's and `batch`'s, once
        # those are applied and its sequences hold the next step's blocks: one pass (or none,
        # in sum) applies any number.
        self.cohort = cohort
        # The steps applied one at a time, each its batch's: none if every step decodes.
        self.prefills = 0 if cohort is not None else len(self.lead) + 1
        self.applied = 0
        # Whether a sequence ended with the last step applied one at a time: the run's end
        # looks for finished sequences only then, or after decode steps.
        self.finishing = False
        # The id of the call that ends the run (FleetEnvironment.call_later); replaced if the
        # run is cut short.
        self.end_call = -1

    def step_batch(self, i: int) -> _Step:
        """Step `i`'s batch (decode steps: one token each of `batch`'s)."""
        return self.lead[i] if i < len(self.lead) else self.batch

    def decoding_ahead(self) -> tuple[int, int]:
        """(steps, tokens each): the steps from the next one on that only decode, short of
        the next that prefills otherwise or ends the run (heard then)."""
        if self.applied < self.prefills:
            return self.decoding_lead()
        return self.ends.count - 1 - self.applied, len(self.batch.seqs)

    def decoding_lead(self) -> tuple[int, int]:
        """(steps, tokens each): the lead steps from the next one on that sample only the
        tokens of sequences already decoding, as many each step, short of the run's last. To
        a router they are decode steps: nothing starts or finishes, and load falls a token a
        decoding sequence."""
        i, tokens = self.applied, self.lead_tokens
        if i >= len(tokens) or tokens[i] < 0:
            return 0, 0
        each, j = tokens[i], i + 1
        stop = min(len(tokens), self.ends.count - 1)
        while j < stop and tokens[j] == each:
            j += 1
        return max(0, min(j, stop) - i), each

    @property
    def is_multi_step(self) -> bool:
        return self.ends.count - self.applied > 1

    @property
    def lag(self) -> int:
        """Steps applied to the engine in sum, not yet to each sequence."""
        return self.cohort.lag if self.cohort is not None else 0


class _LeadEnds(StepEnds):
    """The ends of a run's lead steps (`lead`, summed as planned), then those of `rest`, the
    run from `batch`'s step on, planned to start at the last of them."""

    def __init__(self, lead: list[float], rest: StepEnds, shortest: float) -> None:
        self._ends = lead
        self._rest = rest
        self.count = len(lead) + rest.count
        self.last = rest.last
        self.shortest = shortest

    def end(self, i: int) -> float:
        lead = self._ends
        return lead[i] if i < len(lead) else self._rest.end(i - len(lead))

    def ended_by(self, now: float, lo: int, hi: int) -> int:
        lead = self._ends
        k = len(lead)
        if lo < k:
            done = bisect_right(lead, now, lo, min(hi, k))
            if done < k or hi <= k:
                return done
            lo = k
        return k + self._rest.ended_by(now, lo - k, hi - k)

    def cut(self, count: int) -> None:
        lead = self._ends
        k = len(lead)
        if count > k:
            self._rest.cut(count - k)
            self.last = self._rest.last
        else:
            del lead[count:]
            self.last = lead[-1]
        self.count = count


_INF: Final = float("inf")


def decode_steps_within(computed: list[int], block_size: int, free: int) -> int:
    """The most decode steps sequences with `computed` tokens each can run, a token each per
    step, taking at most `free` new blocks between them.

    A sequence with `room` tokens left in its last block takes a new block at its room-plus-
    first step, then one every `block_size` steps. So d = q x block_size + t steps (t below
    block_size) take q blocks of every sequence and one more of each whose room is below t:
    with `free` = q x n + left, the most is q full rounds and t up to rooms[left], the rooms
    sorted. One sort, where a search over d would sum every sequence's blocks at each probe."""
    rooms = sorted([-c % block_size for c in computed])
    rounds, left = divmod(free, len(rooms))
    return rounds * block_size + rooms[left]


def _shape_at(batch: _Step, computed: list[int], output: list[int]) -> StepShape:
    """The shape of a step planned ahead (as `_Step.count` sums the step being scheduled),
    the i-th of `batch` the running batch's i-th with `computed` and `output` tokens then."""
    num_tokens: i64 = 0
    kv_read: i64 = 0
    num_decodes: i64 = 0
    pairs: i64 = 0
    last = len(batch.seqs) - 1
    for i, seq in enumerate(batch.seqs):
        context: i64 = computed[i]
        num_new: i64 = seq.prompt_len + output[i] - context
        if i == last:
            num_new -= batch.last_short
        num_tokens += num_new
        pairs += num_new * context + ((num_new * (num_new + 1)) >> 1)
        kv_read += context + num_new
        if num_new == 1 and output[i] > 0:
            num_decodes += 1
    return StepShape(num_tokens, float(pairs), kv_read, num_decodes)


class _ProtocolCost(StepCost):
    """A CostModel that is no StepCost, as the engine prices steps: through the protocol."""

    def __init__(self, cost: CostModel) -> None:
        self._cost = cost

    def step_time(self, shape: StepShape) -> float:
        return self._cost.step_time(shape)

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        return self._cost.decode_time(num_seqs, context_tokens)

    def run_ends(
        self, start: float, first: float, num_seqs: int, context_tokens: int, num_decodes: int
    ) -> StepEnds:
        return self._cost.run_ends(start, first, num_seqs, context_tokens, num_decodes)


def _lowest_priority(seq: Seq) -> tuple[int, float]:
    return seq.req.priority, seq.req.arrival


class Engine:
    def __init__(
        self,
        env: FleetEnvironment,
        worker_id: int,
        cost: CostModel,
        config: EngineConfig,
        local: LocalPolicy,
        listener: EngineListener,
        kv_events: KVEventSink | None = None,
    ) -> None:
        # The time, and the calls that end runs (compiled: no interpreted call for either).
        self._calls = env.calls
        self._run_end_callback: Callable[[int], None] = self._on_run_end  # bound once
        self.id = worker_id
        self.cost = cost
        # Steps are priced through the compiled StepCost the project's cost models derive from:
        # a native call, not a Python method call through the protocol (about 1,000
        # instructions each, two or three a run). Any other CostModel is wrapped as one.
        self._step_cost = cost if isinstance(cost, StepCost) else _ProtocolCost(cost)
        self.config = config
        self.local = local
        self.listener = listener
        # Read once: skip per-token hooks nobody listens to (they run once per sequence per
        # step), and call the listener's hot methods bound.
        self._local_counts_tokens = local.traits.counts_tokens
        # Compared once: an enum member read from compiled code is an attribute lookup.
        self._reorders_on_tokens = local.traits.reorders_on is ReordersOn.TOKENS
        self._reorders_on_cache = local.traits.reorders_on is ReordersOn.CACHE
        self._local_on_finish = overridden_hook(local, "on_finish")  # None: a no-op
        self._listener_counts_tokens = listener.counts_tokens
        # No steps in sum with KV events: the evictions a decode step makes are events, each
        # at its own time.
        self._defers_tokens = listener.defers_tokens and kv_events is None
        self._on_changed = listener.on_engine_changed
        self._on_progress = listener.on_progress
        self._on_first_token = listener.on_first_token
        self._on_tokens = listener.on_tokens
        self._on_finish = listener.on_finish
        num_blocks = config.num_kv_blocks or cost.kv_capacity_tokens // config.block_size
        self.blocks = BlockManager(num_blocks, config.block_size, kv_events)
        # When the block changes being made happen: step start while planning, step end while
        # applying (what a KV-event listener stamps the blocks it hears about with).
        self.event_time = 0.0
        self.running: list[Seq] = []
        self.waiting: dict[int, Seq] = {}  # by request id; the local policy holds the order
        self.clock = 0.0  # exact time of the last step boundary
        self._run: _Run | None = None
        self._start_pending = False
        # Statistics.
        self.num_steps = 0
        self.num_events = 0
        self.num_preemptions = 0
        self.peak_used_blocks = 0
        self.tokens_processed = 0
        # Resident adapters, least recently admitted first, and the running sequences of each.
        self.adapters: dict[str, None] = {}
        self._adapter_users: dict[str, int] = {}
        self._load_due = 0.0  # adapter loads the step being planned waits for
        self.adapter_loads = 0
        # A split fleet's prefill engine whose discipline counts tokens: a request's account
        # stays open past its prefill, charged its output as decoded elsewhere; the driver
        # closes it (`local.on_finish`) when the request ends.
        self.hands_off = False
        # Bound once: what a discipline ordering by locality asks at each admission.
        self._cached_blocks: Callable[[Request], int] = self.cached_blocks

    # ------------------------------------------------------------- interface

    def submit(self, req: Request, preloaded: bool = False) -> None:
        """Queue `req`; `preloaded`: its prompt's KV has arrived from a prefill worker."""
        # First the steps ended by now: a queue discipline may read what they charged (VTC
        # lifts an arriving client to the backlogged ones' counters).
        self.sync(self._calls.now)
        if self._local_counts_tokens:
            self._settle()  # the run is cut below: steps in sum count from its start
        self.waiting[req.id] = Seq(req, self.id, self.config.block_size, preloaded)
        self.local.push(req)
        if self._run is None:
            self._start_soon()
        elif self._run.is_multi_step:
            self._cut_run()  # the arrival may join at the next step boundary
        self._tell()

    def abort(self, request_id: int) -> None:
        """Stop a request (its client left). Waiting: withdrawn from its queue discipline,
        uncharged. Running: it ends with the tokens it has, at the next step boundary."""
        self.sync(self._calls.now)
        seq = self.waiting.get(request_id)
        if seq is not None:
            self._unqueue(seq)
            return
        for seq in self.running:
            if seq.req.id == request_id:
                self._settle()  # its tokens so far, steps applied in sum included
                seq.output_len = seq.num_output
                run = self._run
                if run is not None:
                    run.finishing = True  # even mid-prompt, sampling nothing more
                    if run.is_multi_step:
                        self._cut_run()  # the run assumed it would keep decoding
                return

    def withdraw(self, request_id: int) -> bool:
        """Take back a request that has not started (waiting, never admitted: a preempted one
        has started), as its queue time ran out: withdrawn from its queue discipline,
        uncharged, and the listener hears no more of it. False, and nothing changes, if it
        started, ended or never came here."""
        self.sync(self._calls.now)
        seq = self.waiting.get(request_id)
        if seq is None or seq.admitted_at is not None:
            return False
        self._unqueue(seq)
        return True

    def _unqueue(self, seq: Seq) -> None:
        """`seq` leaves the waiting queue for good, uncharged (withdrawn, or its client left)."""
        del self.waiting[seq.req.id]
        if self._local_counts_tokens and self._run is not None and self._run.lag:
            self._settle()  # the discipline may read its counters (VTC's last departed)
            self._cut_run()
        self.local.remove(seq.req)
        self._tell()

    def cached_blocks(self, req: Request) -> int:
        """Leading prompt blocks of `req` this engine holds now (for locality-aware orders)."""
        seq = self.waiting.get(req.id)
        hashes = seq.hashes if seq else req.block_hashes
        return self.blocks.num_cached_prefix(hashes, len(hashes))

    def reusable_tokens(self, req: Request) -> int:
        """Prompt tokens of `req` this engine holds now and would reuse if it started it: its
        cached whole blocks, short of the prompt's last token, which is always computed."""
        bs = self.config.block_size
        limit = req.reusable_blocks(bs)
        return self.blocks.num_cached_prefix(req.block_hashes, limit) * bs

    def sync(self, now: float) -> None:
        """Apply every planned step that has ended by `now`."""
        if self._apply_ended(now):
            self._tell()

    def _apply_ended(self, now: float) -> bool:
        """Apply every planned step that has ended by `now`. True if the listener has yet to
        hear of it (progress in sum mid-run tells it itself)."""
        run = self._run
        if run is None or run.applied == run.ends.count or run.ends.end(run.applied) > now:
            return False
        done = run.ends.ended_by(now, run.applied, run.ends.count)
        while run.applied < run.prefills and run.applied < done:
            self._apply_prefill_step(run)
        if done > run.applied and done < run.ends.count and self._defers_tokens:
            # Mid-run: nothing starts or finishes, and on_progress tells the listener all.
            if run.cohort is None:
                self._decode_in_sum_from_here(run)
            self._progress_decode_steps(run, done - run.applied)
            if self.config.check_invariants:
                self.check_integrity(between_steps=True)
            return False
        if done > run.applied:
            self._apply_decode_steps(run, done - run.applied)
        self._after_steps(run)
        if self.config.check_invariants:
            # Within the lead, the sequences hold the blocks of the step in progress.
            self.check_integrity(between_steps=run.applied >= run.prefills)
        return True

    @property
    def next_step_end(self) -> float | None:
        """When the next planned step that is not yet applied ends (None: nothing planned)."""
        run = self._run
        if run is None or run.applied == run.ends.count:
            return None
        return run.ends.end(run.applied)

    @property
    def run_end(self) -> float | None:
        """When the planned run ends, its last step applied (None: nothing planned). Requests
        start and finish only at run boundaries; within a run, decode steps only add tokens."""
        run = self._run
        if run is None or run.applied == run.ends.count:
            return None
        return run.ends.last

    @property
    def next_change(self) -> float | None:
        """When this engine next moves by more than decode steps in sum: the end of the
        run's next step that prefills and samples a first token or more than decoding
        sequences' tokens, else of the run (None: nothing planned). Until then what it has
        left to do falls only as `decode_credit` says."""
        run = self._run
        if run is None or run.applied == run.ends.count:
            return None
        if run.applied < run.prefills:
            return run.ends.end(run.applied + run.decoding_lead()[0])
        return run.ends.last

    def decode_bound(self) -> tuple[float, float, int, int]:
        """How the run's steps before `next_change`, not yet applied, will lower what the
        engine has left to do, each sampling a token of every sequence it decodes: (when the
        first of them ends, a duration no step of the run falls below, how many there are,
        the tokens each makes). A listener hears exactly those tokens once the steps are
        applied. (inf, 1, 0, 0) when there are none."""
        run = self._run
        if run is None:
            return _INF, 1.0, 0, 0
        left, each = run.decoding_ahead()
        if left <= 0:
            return _INF, 1.0, 0, 0
        return run.ends.end(run.applied), run.ends.shortest, left, each

    def decode_credit(self, now: float) -> int:
        """The tokens `decode_bound`'s steps ended by `now` make: what applying them would
        take off the engine's outstanding tokens."""
        run = self._run
        if run is None:
            return 0
        left, each = run.decoding_ahead()
        if left <= 0 or each == 0:
            return 0
        done = run.ends.ended_by(now, run.applied, run.applied + left)
        return (done - run.applied) * each

    def _tell(self) -> None:
        self._on_changed(self)

    @property
    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    # ------------------------------------------------------------------ loop
    # Driven by calls on SimPy's time, not a process: a run's end is one call
    # (FleetEnvironment.call_later, in SimPy's order as a Timeout would be). An arrival that
    # cuts a multi-step run short schedules an earlier end, and the superseded call comes later
    # to no effect. That costs less than a process waiting on `timeout | wake`, which builds a
    # Condition and two more events for every run.

    def _start_soon(self) -> None:
        """Idle with work: start at this instant, once every arrival of this instant is in."""
        if not self._start_pending:
            self._start_pending = True
            self._calls.call_later(0.0, self._on_start)

    def _on_start(self, _call: int) -> None:
        self._start_pending = False
        if self._run is None and not self.is_idle:
            self.clock = self._calls.now
            self._begin_run()

    def _begin_run(self) -> None:
        run = self._plan()
        self._run = run
        self._schedule_end(run)
        self._tell()

    def _schedule_end(self, run: _Run) -> None:
        self.num_events += 1
        calls = self._calls
        run.end_call = calls.call_later(run.ends.last - calls.now, self._run_end_callback)

    def _on_run_end(self, call: int) -> None:
        run = self._run
        if run is None or call != run.end_call:
            return  # superseded by an earlier end
        self._apply_ended(run.ends.last)
        self.clock = run.ends.last
        self._run = None
        if self.is_idle:
            self._tell()
        else:
            self._begin_run()  # tells the listener once, what this instant ends with

    def _cut_run(self) -> None:
        """Something arrived or left mid-run: end the run after the step in progress."""
        run, now = self._run, self._calls.now
        if run is None or run.ends.last <= now:
            return
        self.sync(now)
        if run.ends.count > run.applied + 1:
            run.ends.cut(run.applied + 1)
            self._schedule_end(run)
            self._tell()  # the run ends earlier

    # --------------------------------------------------------------- planning

    def _plan(self) -> _Run:
        cfg, blocks = self.config, self.blocks
        self.event_time = self.clock
        batch = _Step()
        budget, preempted = self._schedule_running(batch, cfg.max_num_batched_tokens)
        stopped_by = None
        if not preempted:
            budget, stopped_by = self._admit_waiting(batch, budget)
        # Decode steps free no sequence slot and no memory, so a head blocked for either stays
        # blocked while they run, unless the discipline reorders: as tokens are served (after
        # any step), or by what is cached (after a step that evicts).
        stays_blocked = stopped_by in ("seqs", "adapters") or (
            stopped_by == "memory" and not self._reorders_on_tokens
        )
        free = blocks.num_empty if stopped_by == "memory" and self._reorders_on_cache else None

        if not batch.seqs:
            raise RuntimeError(
                f"worker {self.id}: nothing can run; a request needs more KV blocks than the "
                f"worker has ({blocks.num_blocks} blocks of {cfg.block_size} tokens)"
            )
        self._note_peak(blocks.num_used)
        if cfg.check_invariants:
            self.check_integrity()

        first: float | None = None  # step 1's duration, when known before the rest
        decode_context, decode_steps, decoding = 0, 0, None  # decode steps after step 1
        # Step 1 leaves every sequence decoding (each samples a token), and nothing waiting can
        # join step 2: the steps up to the first finish are known now. Step 1 may prefill if
        # nothing waits at all, or waits only for a sequence slot; one that waits for memory
        # could fit once step 1 caches its prompt blocks. A prompt chunk the budget cuts short
        # of the prompt's end samples nothing, and leaves step 2 unknown.
        if (stays_blocked or not self.waiting) and not batch.last_short:
            decodes = len(batch.seqs) == cfg.max_num_batched_tokens - budget
            context: i64 = 0
            for seq in batch.seqs:  # each computes all it has left, and samples
                total = seq.prompt_len + seq.num_output  # `total_len`, without a call
                # A prompt's last token, or a recomputation, is a prefill (first token, blocks
                # to cache), though only one token long.
                decodes = decodes and total - seq.num_computed == 1 and seq.num_output > 0
                context += total + 1  # what step 2 reads
            if decodes:
                decode_steps = self._plan_decode_run(batch, free) - 1
                first = self._step_cost.decode_time(len(batch.seqs), context - len(batch.seqs))
                decode_context = context
                decoding = batch.seqs.copy()
            elif (
                stopped_by != "memory"
                and len(batch.seqs) == len(self.running)  # step 2 has budget for the rest
                and len(batch.seqs) <= cfg.max_num_batched_tokens
            ):
                decode_steps = self._plan_decode_run(batch) - 1
                decode_context = context
        if first is None:
            shape = batch.shape()
            if cfg.check_invariants:
                seqs = batch.seqs
                summed = _shape_at(
                    batch, [s.num_computed for s in seqs], [s.num_output for s in seqs]
                )
                assert shape.as_tuple() == summed.as_tuple(), "a step's shape as it was scheduled"
            first = self._step_cost.step_time(shape)
        if self._load_due:
            first += self._load_due
            self._load_due = 0.0
        if decode_steps == 0 and decoding is None and not self.waiting and cfg.fast_forward:
            return self._plan_chunks(batch, first)
        ends = self._step_cost.run_ends(
            self.clock, first, len(batch.seqs), decode_context, decode_steps
        )
        cohort = _Cohort(decoding, cfg.block_size) if decoding is not None else None
        return _Run(batch, ends, cohort)

    def _plan_chunks(self, batch: _Step, first: float) -> _Run:
        """Step 1 (`batch`, lasting `first`) leaves a prompt short of its end, or a running
        sequence out, and nothing waits: each step after it is the running batch's alone, as
        `_schedule_running` will plan it when it starts, so it is planned now on the tokens
        each sequence will have by then. The run goes on to the step that starts a decode run
        (and through that run), or ends with the step where a sequence finishes or whose
        blocks are not free (one would be preempted), or before a step of decodes alone:
        those are planned when they come. Each step's blocks are taken as the step before it
        ends (`_apply_prefill_step`), when step-by-step planning takes them."""
        cfg = self.config
        bs, limit = cfg.block_size, cfg.max_num_batched_tokens
        running = self.running
        n = len(running)
        # What each running sequence will have computed and sampled as the next step starts.
        computed = [seq.num_computed for seq in running]
        output = [seq.num_output for seq in running]
        free = self.blocks.num_free
        lead: list[_Step] = []
        lead_ends: list[float] = []
        lead_tokens: list[int] = []
        step, start, length, shortest = batch, self.clock, first, first
        decode_context, decode_steps = 0, 0
        while len(lead) < cfg.max_run_steps:
            # `step` ends. Running nothing new, it is the running batch's first len(step).
            sampled = 0
            for i, seq in enumerate(step.seqs):
                computed[i] = step.end_of(i, seq.prompt_len + output[i])
                if computed[i] == seq.prompt_len + output[i]:
                    sampled = sampled + 1 if output[i] > 0 and sampled >= 0 else -1
                    output[i] += 1
                    if output[i] >= seq.output_len:
                        break
            else:
                nxt = _Step()
                budget, need, whole, decodes = limit, 0, True, True
                for i in range(n):
                    if budget <= 0:
                        break
                    seq, c = running[i], computed[i]
                    num_new = seq.prompt_len + output[i] - c
                    short = 0
                    if num_new > budget:
                        num_new, short, whole = budget, num_new - budget, False
                    need += (c + num_new + bs - 1) // bs - (c + bs - 1) // bs
                    decodes = decodes and num_new == 1 and output[i] > 0
                    nxt.add(seq, short)
                    budget -= num_new
                if need > free or decodes:
                    break
                free -= need
                lead.append(step)
                lead_ends.append(start + length)
                lead_tokens.append(sampled)
                step, start = nxt, start + length
                length = self._step_cost.step_time(_shape_at(nxt, computed, output))
                if length < shortest:
                    shortest = length
                if whole and len(nxt.seqs) == n:  # every sequence samples: a decode run follows
                    left = cfg.max_run_steps
                    # Every sequence computes all it has left: each ends level with its tokens.
                    after = [running[i].prompt_len + output[i] for i in range(n)]
                    for i in range(n):
                        left = min(left, running[i].output_len - output[i])
                        decode_context += after[i] + 1
                    if n * (left // bs + 1) > free:
                        left = min(left, decode_steps_within(after, bs, free) + 1)
                    decode_steps = left - 1
                    break
                continue
            break  # a finish
        rest = self._step_cost.run_ends(start, length, len(step.seqs), decode_context, decode_steps)
        if not lead:
            return _Run(batch, rest)
        ends = _LeadEnds(lead_ends, rest, min(shortest, rest.shortest))
        return _Run(step, ends, None, lead, lead_tokens)

    def _schedule_running(self, batch: _Step, budget: i64) -> tuple[i64, bool]:
        """Step 1: the running batch, in admission order; preempts from its tail for memory.
        Returns the budget left and whether anything was preempted. `batch` is empty: it
        becomes the first sequences of the running list, as many as are scheduled."""
        blocks = self.blocks
        bs: i64 = self.config.block_size
        preempted = False
        running = self.running
        free: i64 = blocks.num_free
        i: i64 = 0
        n: i64 = len(running)
        short: i64 = 0  # what the budget cuts off the last sequence scheduled
        num_tokens: i64 = 0
        pairs: i64 = 0
        kv_read: i64 = 0
        num_decodes: i64 = 0
        # Hot loop: one pass per step over the running batch, so plain arithmetic only. A
        # running sequence holds exactly blocks_for(num_computed) blocks here. What it
        # schedules is always running[:i], the step's batch: a victim ahead of `i` leaves it.
        while i < n and budget > 0:
            seq = running[i]
            computed = seq.num_computed
            left = seq.prompt_len + seq.num_output - computed
            num_new = left
            if num_new == 1:  # decoding: a new block when the last one is full
                need: i64 = 1 if computed % bs == 0 else 0
            else:
                if num_new > budget:
                    num_new = budget
                need = (computed + num_new + bs - 1) // bs - (computed + bs - 1) // bs
            if need:
                if need > free and self.config.priority_preemption:
                    budget, at = self._preempt_by_priority(batch, seq, need, budget, i)
                    preempted, free, n = True, blocks.num_free, len(running)
                    if at < 0:
                        # vLLM ends this step's running pass here and takes up the rest next
                        # step; going on with them now saves a step that would run nothing.
                        continue
                    i = at
                while need > free and running[-1] is not seq:
                    self._preempt(running.pop())
                    preempted, free, n = True, blocks.num_free, n - 1
                if need > free:
                    self._preempt(running.pop())  # seq itself: nothing left to take from
                    preempted = True
                    break
                blocks.allocate(seq.table, need)
                free -= need
            # Its share of the step's shape, as `_Step.count` sums it, here in locals: a method
            # call per sequence cost as much as a pass of its own. (A priority victim taken back
            # is counted out of `batch`'s own sums, which these are added to.)
            num_tokens += num_new
            pairs += num_new * computed + ((num_new * (num_new + 1)) >> 1)
            kv_read += computed + num_new
            if num_new == 1 and seq.num_output > 0:
                num_decodes += 1
            short = left - num_new  # not 0 only if the budget is spent: the loop ends
            budget -= num_new
            i += 1
        batch.seqs = running[:i]
        batch.last_short = short
        batch.num_tokens += num_tokens
        batch.pairs += pairs
        batch.kv_read += kv_read
        batch.num_decodes += num_decodes
        return budget, preempted

    def _preempt_by_priority(
        self, batch: _Step, seq: Seq, need: int, budget: int, i: int
    ) -> tuple[int, int]:
        """vLLM's priority victims for `seq` (at `i` in the running list) needing `need` blocks:
        the lowest-priority running sequence, again while blocks are short. A victim already
        scheduled this step (ahead of `i`, so not cut short) gives its tokens back, and leaves
        `batch`'s shape. Returns the budget and `seq`'s new index, -1 when `seq` itself was the
        victim."""
        running, blocks = self.running, self.blocks
        while need > blocks.num_free:
            victim = max(running, key=_lowest_priority)
            j = running.index(victim)
            del running[j]
            if j < i:
                left = victim.total_len - victim.num_computed
                batch.count(victim, left, -1)
                budget += left
            self._preempt(victim)
            if victim is seq:
                return budget, -1
            if j < i:
                i -= 1
        return budget, i

    def _admit_waiting(self, batch: _Step, budget: int) -> tuple[int, str | None]:
        """Step 2: waiting requests in the local policy's order, each from its longest cached
        prefix. Returns the budget left and what stopped admission with requests still
        waiting: "seqs" (no sequence slot), "memory", or None."""
        cfg, blocks = self.config, self.blocks
        while budget > 0 and self.waiting:
            if len(self.running) >= cfg.max_num_seqs:
                return budget, "seqs"
            req = self.local.peek(self._cached_blocks)
            if req is None:
                break
            seq = self.waiting[req.id]
            limit = min(len(seq.hashes), (seq.total_len - 1) // cfg.block_size)
            hit = blocks.num_cached_prefix(seq.hashes, limit)
            cached = hit * cfg.block_size
            # Tokens whose KV it has: its cached prefix, or all but the last if it was sent.
            computed = seq.total_len - 1 if seq.preloaded else cached
            num_new = min(seq.total_len - computed, budget)
            need = blocks.blocks_for(computed + num_new) - hit
            if need > blocks.num_free_after_hit(seq.hashes, hit):
                return budget, "memory"
            # After the memory check: holding the adapter loads it.
            lora = req.adapter
            if lora is not None and cfg.adapter_slots and not self._hold_adapter(lora):
                return budget, "adapters"
            self.local.pop(req, cached)
            del self.waiting[req.id]
            blocks.pin_prefix(seq.table, seq.hashes, hit)
            blocks.allocate(seq.table, need)
            if seq.preloaded:  # the blocks it received are cached here from now on
                blocks.commit_full_blocks(seq.table, seq.hashes, computed // cfg.block_size)
                seq.preloaded = False
            seq.num_computed = computed
            if seq.admitted_at is None:
                seq.admitted_at = self.clock
                seq.num_cached_tokens = cached
            self.running.append(seq)
            self._use_adapter(seq, 1)
            batch.add(seq, seq.total_len - computed - num_new)  # short of it: a budget's cut
            batch.count(seq, num_new)
            budget -= num_new
        return budget, None

    def _hold_adapter(self, adapter: str) -> bool:
        """Make `adapter` resident for a sequence about to start: loaded into a free slot or
        the least recently used one no running sequence uses (the step waits for the load).
        False if every slot is in use: admission stops until a sequence finishes, where vLLM's
        scheduler would admit later requests of resident adapters past it."""
        resident = self.adapters
        if adapter in resident:
            del resident[adapter]
            resident[adapter] = None
            return True
        if len(resident) >= self.config.adapter_slots:
            victim = next((a for a in resident if not self._adapter_users.get(a)), None)
            if victim is None:
                return False
            del resident[victim]
        resident[adapter] = None
        self._load_due += self.config.adapter_load_time
        self.adapter_loads += 1
        return True

    def _use_adapter(self, seq: Seq, delta: int) -> None:
        adapter = seq.req.adapter
        if adapter is not None and self.config.adapter_slots:
            self._adapter_users[adapter] = self._adapter_users.get(adapter, 0) + delta

    def _plan_decode_run(self, batch: _Step, free: int | None = None) -> int:
        """How many steps, step 1 then decode steps, can run with this batch before something
        must change, taking at most `free` new blocks (default: every free block) beyond step
        1's, which are allocated."""
        if not self.config.fast_forward:
            return 1
        # A loop, not min() over a generator: compiled, that is a call into the interpreter.
        limit: i64 = self.config.max_run_steps
        for seq in batch.seqs:
            left = seq.output_len - seq.num_output
            if left < limit:
                limit = left
        bs: i64 = self.config.block_size
        if free is None:
            free = self.blocks.num_free
        if len(batch.seqs) * (limit // bs + 1) <= free:
            return limit  # even if every sequence crossed a block boundary as often as it can
        computed = [batch.end_of(k, seq.total_len) for k, seq in enumerate(batch.seqs)]
        return min(limit, decode_steps_within(computed, bs, free) + 1)

    # ---------------------------------------------------------------- applying

    def _apply_prefill_step(self, run: _Run) -> None:
        """The run's next step that prefills; within its lead, the next step's blocks too,
        taken as that step starts (as step-by-step planning takes them)."""
        i = run.applied
        now = self.event_time = run.ends.end(i)
        bs: i64 = self.config.block_size
        blocks, local = self.blocks, self.local
        computed_delta: i64 = 0
        step = run.step_batch(i)
        last = len(step.seqs) - 1
        for k, seq in enumerate(step.seqs):
            start = seq.num_computed
            num_new = seq.prompt_len + seq.num_output - start
            if k == last:
                num_new -= step.last_short
            seq.num_computed = computed = start + num_new
            computed_delta += num_new
            # This step computed (part of) the cacheable prompt. Its full blocks end within the
            # prompt: a decoding sequence is ruled out without reading its hashes' list, which
            # at 512 workers is one more miss to memory per sequence and step.
            if start < seq.prompt_len and start < len(seq.hashes) * bs:
                blocks.commit_full_blocks(seq.table, seq.hashes, computed // bs)
            if computed < seq.prompt_len + seq.num_output:
                continue  # the budget's cut, short of the prompt's end: nothing sampled
            seq.num_output += 1
            if seq.num_output >= seq.output_len:
                run.finishing = True
            if seq.first_token_at is None:
                seq.first_token_at = now
                self._on_first_token(seq, now)
        # What sampled a token: the step's sequences, but the last if the budget cut it short.
        sampled = step.seqs[:-1] if step.last_short else step.seqs
        if sampled and self._local_counts_tokens:
            local.on_tokens([seq.req for seq in sampled], 1)
        if sampled and self._listener_counts_tokens:
            self._on_tokens(sampled, 1, now)
        self.tokens_processed += computed_delta
        run.applied = i + 1
        self.num_steps += 1
        if i < len(run.lead) and run.applied < run.ends.count:  # the next step starts
            step = run.step_batch(i + 1)
            for k, seq in enumerate(step.seqs):
                # It holds the blocks of the tokens it computed: only a step into a block past
                # them can need one, and only then is its table read.
                filled = (step.end_of(k, seq.total_len) + bs - 1) // bs  # blocks, once it ends
                if filled > (seq.num_computed + bs - 1) // bs:
                    need = filled - len(seq.table)
                    if need > 0:
                        blocks.allocate(seq.table, need)
            self._note_peak(blocks.num_used)

    def _decode_in_sum_from_here(self, run: _Run) -> None:
        """A run whose first steps prefilled, those applied: each sequence takes the blocks of
        the step in progress, as step 1 of a decode run planned now would, so that its
        sequences form a cohort and the steps from here on can be applied in sum."""
        blocks = self.blocks
        bs: i64 = self.config.block_size
        seqs = run.batch.seqs.copy()
        for seq in seqs:
            if seq.num_computed % bs == 0:  # the next token opens a block (else it holds it)
                need = (seq.num_computed + bs) // bs - len(seq.table)
                if need > 0:
                    blocks.allocate(seq.table, need)
        run.cohort = _Cohort(seqs, bs)

    def _progress_decode_steps(self, run: _Run, num_steps: int) -> None:
        """Apply `num_steps` steps of a decode run that does not end with them, in sum: the
        engine's totals, the KV blocks they take, and the listener's load. The sequences
        themselves catch up when the run ends, or when an abort or an arrival at a queue that
        counts tokens looks at them: nothing reads them before, and this is the step a policy
        reading every worker's load pays on each engine."""
        cohort = run.cohort
        assert cohort is not None, "steps in sum need a cohort"
        run.applied += num_steps
        self.event_time = run.ends.end(run.applied - 1)
        cohort.advance(num_steps)
        tokens = num_steps * len(cohort.seqs)
        self.tokens_processed += tokens
        self.num_steps += num_steps
        used = self.blocks.num_used + cohort.owed_blocks
        self._note_peak(used)
        self._on_progress(self, tokens, used, run.ends.end(run.applied))

    def _note_peak(self, used: int) -> None:
        """`used` KV blocks in use now: the peak so far, if above it."""
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used

    @property
    def kv_used_blocks(self) -> int:
        """KV blocks in use, those of decode steps applied in sum included."""
        run = self._run
        cohort = run.cohort if run is not None else None
        return self.blocks.num_used + (cohort.owed_blocks if cohort is not None else 0)

    def _settle(self) -> None:
        """Bring each sequence up to the steps applied in sum (before anything reads one)."""
        run = self._run
        if run is not None and run.lag:
            self._apply_decode_steps(run, 0)

    def _apply_decode_steps(self, run: _Run, num_steps: int) -> None:
        """`num_steps` more steps of the run, and the ones applied in sum, sequence by
        sequence."""
        now = self.event_time = run.ends.end(run.applied + num_steps - 1)
        blocks = self.blocks
        cohort = run.cohort
        if cohort is None:  # its first steps prefilled, and nothing was applied in sum since
            cohort = _Cohort(run.batch.seqs.copy(), self.config.block_size)
        seqs, settled = cohort.seqs, cohort.lag
        steps = cohort.catch_up(blocks, num_steps)
        if self._local_counts_tokens:
            self.local.on_tokens([seq.req for seq in seqs], steps)
        if settled:
            self.listener.on_tokens_settled(seqs, settled, now)
        if num_steps and self._listener_counts_tokens:
            self._on_tokens(seqs, num_steps, now)
        self.tokens_processed += num_steps * len(seqs)
        self._note_peak(blocks.num_used)
        run.applied += num_steps
        self.num_steps += num_steps

    def _after_steps(self, run: _Run) -> None:
        if run.applied < run.ends.count:  # runs are planned to end at the first finish
            if self.config.check_invariants:
                assert all(s.num_output < s.output_len for s in run.batch.seqs), "finish mid-run"
            return
        if run.applied <= run.prefills and not run.finishing:
            return  # its last step was applied alone and ended nothing
        now = run.ends.last
        finished = [s for s in run.step_batch(run.applied - 1).seqs if s.num_output >= s.output_len]
        for seq in finished:
            self.running.remove(seq)
            self._use_adapter(seq, -1)
            self.blocks.free(seq.table)
            seq.num_computed = 0
            seq.finished_at = now
            if not self.hands_off and self._local_on_finish is not None:
                self._local_on_finish(seq.req)
            self._on_finish(seq, now)

    def _preempt(self, seq: Seq) -> None:
        self._use_adapter(seq, -1)
        self.blocks.free(seq.table)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting[seq.req.id] = seq
        self.local.push_front(seq.req)

    def check_integrity(self, between_steps: bool = False) -> None:
        self.blocks.check_integrity([s.table for s in self.running])
        assert self.blocks.num_used <= self.blocks.num_blocks, "over KV capacity"
        assert len(self.local) == len(self.waiting), "local queue and waiting set disagree"
        run = self._run
        cohort = run.cohort if run is not None else None
        in_sum = set(cohort.seqs) if cohort is not None and cohort.lag else set()
        pending, pending_blocks = (cohort.lag, cohort.owed_blocks) if cohort is not None else (0, 0)
        owed = 0
        for seq in self.running:
            need = self.blocks.blocks_for(seq.num_computed)
            held = len(seq.table)
            if seq in in_sum:  # decode steps applied in sum: it holds step 1's blocks only
                assert held == self.blocks.blocks_for(seq.num_computed + 1), seq.req.id
                owed += self.blocks.blocks_for(seq.num_computed + pending) - held
                continue
            # Between steps a sequence holds exactly its computed tokens' blocks (the planning
            # loop relies on it); once planned, also those of the step about to run.
            assert held == need if between_steps else held >= need, f"request {seq.req.id}"
        assert owed == (pending_blocks if in_sum else 0), "blocks owed to steps in sum"
