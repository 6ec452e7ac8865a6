"""A simulated cluster: N engines behind the router core, fed by a trace.

    trace ─▶ arrivals ─▶ Router.route ─▶ released ─▶ engine.submit
                 ▲                                         │ first token, tokens, finish
                 └── closed loop: next turn after finish ◀─┴──▶ Router (hooks, load, release)

This module only drives: SimPy time, the engines' reports, and handing released requests to
engines. The routing sequence itself is router.core.Router, the one the live proxy drives.

Same-time ordering, defined here once: engine steps that end at time t are applied before a
request arriving at t is routed (every engine with a step ended by t is synced first), so the
view a policy sees never lags the engines. Engines push what they report as it changes, so an
arrival costs the same on 8 workers or 512.
"""

from __future__ import annotations

import functools
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import cast

import simpy
from mypy_extensions import mypyc_attr

import policies
from router.bands import Banded
from router.budgets import Budgets
from router.classes import (
    NO_DECODE_WORKER,
    QUEUE_TIME,
    RATE_LIMIT,
    ClassTable,
    Refused,
)
from router.config import RouterConfig, slowest_adapter_load
from router.core import Router
from router.cost_model import CostModel
from router.kv_events import KVEventIndexer
from router.ledger import LedgerStore
from router.planner import Planner
from router.policy import GlobalPolicy, LeastLoaded, LocalPolicy
from router.prefix_index import WorkerId
from router.records import Refusal
from router.request import BlockHash, Request
from router.runtime.collector import paced_for_throughput
from router.traits import IndexMode, Placement, Role
from router.view import boxed_id
from simulator.columns import RecordLog
from simulator.config import SimConfig
from simulator.engine import Engine, EngineConfig, Seq
from simulator.environment import FleetEnvironment
from simulator.fleet import check_requests
from simulator.hit_bound import InfiniteCache
from simulator.load_floors import LoadFloors
from simulator.progress import RunProgress
from simulator.results import SimResult, WorkerRecord, summarize
from simulator.scaling import Scaler
from simulator.time_heap import TimeHeap
from simulator.topology import kv_bytes
from simulator.transfers import KVTransfers, Transfer
from traces.schema import Trace

# Below this many workers the floors cost about what the engines they spare do (compiled,
# tiled Mooncake, instructions of a replay with floors against without, trace loading
# included: 1.00 at 64 workers, 0.97 at 128, 0.89 at 256).
LOAD_FLOORS_MIN_WORKERS = 128


@dataclass(frozen=True, slots=True)
class _Placement:
    """What one worker is: its model group (None in a fleet of one), cost model and engine."""

    group: str | None
    cost: CostModel
    engine: EngineConfig


@dataclass(slots=True)
class _Prefilled:
    """A split request's first stage, for its record: where its prompt ran."""

    worker: int
    cached_tokens: int
    preemptions: int
    kv_transfer: float | None = None


def _placements(config: SimConfig, block_size: int, cost: CostModel | None) -> list[_Placement]:
    """Each worker's model group, cost model and engine config, in worker order."""
    engine = replace(config.engine, block_size=block_size)
    if not config.groups:
        if cost is None:
            raise ValueError("simulate: give a cost model, or model groups (SimConfig.groups)")
        return [_Placement(None, cost, engine)] * config.num_workers
    several = len(config.groups) > 1  # one group: requests name no group (see Request.model)
    out: list[_Placement] = []
    for g in config.groups:
        slots = replace(
            engine, adapter_slots=g.adapter_slots, adapter_load_time=g.adapter_load_time
        )
        out += [_Placement(g.name if several else None, g.cost(), slots)] * g.workers
    return out


@mypyc_attr(allow_interpreted_subclasses=True)  # tests and benches extend the driver
class SimCluster:
    """The simulator's driver of the router core: SimPy time, engines as workers.

    `cost`: the step costs of every engine, and the router's estimates. With model groups each
    group's engines run the group's own; `cost` (None: the first group's) stays the router's,
    as a live router has one cost model for every worker."""

    def __init__(self, trace: Trace, cost: CostModel | None, config: SimConfig) -> None:
        check_requests(config.groups, trace.requests)
        placements = _placements(config, trace.block_size, cost)
        cost = placements[0].cost if cost is None else cost
        self.trace, self.cost, self.config = trace, cost, config
        self.env = FleetEnvironment()  # a float clock from the start
        self._calls = self.env.calls  # its time, read without an interpreted call
        self.policy: GlobalPolicy = self._global_policy()
        local_name = config.local_policy or self.policy.default_local
        self.local_name = local_name  # the discipline: in each engine, or in the router's queues
        self.local_factory: Callable[[], LocalPolicy] = lambda: policies.local_policies.build(
            local_name, config.local_params, config.seed
        )
        self.placement = config.placement
        fcfs = policies.local_policies.get("fcfs")
        in_router = config.placement is Placement.ROUTER
        self.precise = config.index is IndexMode.PRECISE
        self.classes = ClassTable(config.classes)
        banded = bool(self.classes) or len(set(trace.column("priority"))) > 1
        bands = self.classes.priorities()
        # What waits inside an engine: the discipline itself (engine placement), or a stock
        # vLLM's order: arrival, by priority when it runs priority scheduling.
        engine_local: Callable[[], LocalPolicy] = self.local_factory if not in_router else fcfs
        if banded and (not in_router or config.priority_scheduling):
            unbanded = engine_local
            engine_local = lambda: Banded(unbanded, bands)  # noqa: E731
        by_priority = banded and config.priority_scheduling
        self.router_config = RouterConfig(
            block_size=trace.block_size,
            window=config.window if in_router else None,
            cost=cost,
            index=config.index,
            adapter_load_time=slowest_adapter_load(p.engine.adapter_load_time for p in placements),
            adapter_affinity=config.adapter_affinity,
            classes=self.classes if banded else None,
            latency_routing=config.latency_routing,
            admission=config.admission,
            step_tokens=config.engine.max_num_batched_tokens,
            estimate_hits=config.autoscale is not None,  # its planner's demand reads them
        )
        self.routers = [
            self._new_router(
                self.policy if r == 0 else self._global_policy(),
                self.local_factory if in_router else fcfs,
            )
            for r in range(config.routers)
        ]
        self.router = self.routers[0]
        self.view = self.router.view
        counting_queues = in_router and self.local_factory().traits.counts_tokens  # no queue yet
        # Decode progress in sum mid-run (engines settle each sequence at the run's end) when
        # nothing reads tokens per request before it finishes: one router, whose policy and
        # queues count none, or a policy that reads its counts only at the finish.
        traits = self.policy.traits
        counting_policy = traits.counts_tokens and not traits.tokens_read_at_finish
        # A split fleet's prefill engines charge their disciplines the output decoded elsewhere
        # (engine placement), request by request.
        self._stage_counts = (
            config.split and not in_router and self.local_factory().traits.counts_tokens
        )
        self.defers_tokens = (
            len(self.routers) == 1
            and not counting_policy
            and not counting_queues
            and not self._stage_counts
        )
        # Nothing counts a request's tokens at all: each step's are credited to its worker's
        # load in sum, and a request's own count is settled once, at its finish. A run's end
        # then costs no pass over the batch in the router.
        self._tokens_in_sum = self.defers_tokens and not traits.counts_tokens
        self.engines: list[Engine] = []
        self.roles = config.roles
        self._prefills = [role is Role.PREFILL for role in self.roles]
        self._decodes = [role is Role.DECODE for role in self.roles]
        self.transfers = KVTransfers(self.env, config.network()) if config.split else None
        self._kv_bytes_per_token = config.kv_bytes_per_token or 0
        if config.split and not self._kv_bytes_per_token:
            model = getattr(cost, "model", None)
            if model is None:
                raise ValueError(
                    f"kv_bytes_per_token: the cost model {cost.name} names no model to take "
                    "it from; give it for a split fleet"
                )
            self._kv_bytes_per_token = model.kv_bytes_per_token
        self._prefilled: dict[int, _Prefilled] = {}  # split requests past their prefill
        self._split_originals: dict[int, Request] = {}  # at their prefill, by id
        self._due = TimeHeap()  # (step end, engine): see _sync
        self._last_due: list[float | None] = [None] * config.num_workers  # its newest entry
        for i, placement in enumerate(placements):
            # Precise: every replica subscribes to every engine's KV events.
            indexers = [
                KVEventIndexer(r.view.index, i, changed=r.view.changed) for r in self.routers
            ]
            sink = DelayedKVEvents(self, i, indexers) if self.precise else None
            engine = Engine(
                self.env,
                i,
                placement.cost,
                replace(placement.engine, priority_preemption=by_priority),
                engine_local(),
                self,
                sink,
            )
            engine.hands_off = self._stage_counts and self.roles[i] is Role.PREFILL
            self.engines.append(engine)
            for router in self.routers:
                router.add_worker(
                    i,
                    engine.blocks.num_blocks,
                    model=placement.group,
                    adapter_slots=placement.engine.adapter_slots,
                    role=self.roles[i],
                )
        self._group_of = [g.name for g in config.groups for _ in range(g.workers)]
        self._several_groups = len(config.groups) > 1
        self._owner: dict[int, Router] = {}  # request id -> the replica that routed it
        self._next_router = 0
        if len(self.routers) > 1:
            if config.router_sync > 0:
                for router in self.routers:
                    router.indexes.routing_log = []
            else:
                self._share_state()
        # Which engines an arrival must bring up to date: those with any step ended, or, when
        # nothing routing reads moves while requests decode, only those whose run has ended
        # (a finish or an admission): then an arrival costs the same on any fleet.
        names_workers = type(self.policy).progress_read is not GlobalPolicy.progress_read
        self._lazy = names_workers and not (self.precise or counting_queues)
        # A policy reading only who comes first in a load order: on a large fleet the engines
        # whose load could come first now are found from floors (simulator.load_floors), the
        # rest wait for their next change; on a small one, or several pools or routers, every
        # engine with a step ended is brought up to date.
        self._floors: LoadFloors | None = None
        reads = self._read_of_any_request()
        if isinstance(reads, LeastLoaded):
            large = config.num_workers >= LOAD_FLOORS_MIN_WORKERS
            if config.load_floors and large and self._lazy and self._one_pool():
                self._floors = LoadFloors(self.engines, self.view, reads.key)
                for engine in self.engines:
                    self._floors.changed(engine.id)
            else:
                self._lazy = False
        self.bound = InfiniteCache(trace.block_size)
        self.log = RecordLog()
        self.refusals: list[Refusal] = []
        self.budgets = Budgets(config.rate_limits) if config.rate_limits else None
        self._predicted_ttft: dict[int, float | None] = {}
        self._next_turns: dict[str, deque[Request]] = {}
        self._upcoming: Iterator[Request] = iter(())  # the requests not yet arrived
        self._next_arrival: Request | None = None  # the first of them, read
        self._progress: RunProgress | None = None
        self.scaler: Scaler | None = None
        if config.autoscale is not None:
            planner = Planner(config.autoscale, cost, config.engine.max_num_seqs)
            self.scaler = Scaler(self.env, planner, self.routers, self.engines, self._sync_all)
        # Synced lazily, with the trace's arrivals the only decisions (open loop, no outage,
        # scaler or prefill worker to make others), the engines a decision must bring up to
        # date are those whose run ends at that very arrival, by a call made after the
        # arrival's (an earlier one has run): only runs planned while that arrival is the next
        # can be, so those are noted (`_ties`) and no heap of run ends is kept. The heap's
        # pushes and stale pops were 5 % of a saturated replay.
        self._ties_only = (
            self._lazy
            and self._floors is None
            and not config.closed_loop
            and not config.outages
            and self.scaler is None
            and not any(self._prefills)
        )
        self._ties: list[int] = []  # engines whose run ends at the next arrival

    def _read_of_any_request(self) -> object:
        """What the policy's decisions read of decode progress, if it says without a request."""
        if not self.trace.requests:
            return None
        return self.policy.progress_read(self.trace.requests[0], self.view)

    def _one_pool(self) -> bool:
        c = self.config
        return len(self.routers) == 1 and not (c.groups or c.split or c.autoscale)

    def _new_router(self, policy: GlobalPolicy, local: Callable[[], LocalPolicy]) -> Router:
        """One router replica (a subclass may make its own kind: a test records its calls)."""
        return Router(policy, local, self.router_config)

    def _global_policy(self) -> GlobalPolicy:
        c = self.config
        return policies.global_policies.build(c.policy, c.policy_params, c.seed)

    # ---------------------------------------------------------------- replicas

    def _share_state(self) -> None:
        """Sync 0: a store written through at once. The replicas' counters and indexes are
        the same objects; load accounting and queues stay each replica's own."""
        first = self.routers[0]
        shared = first.ledgers()
        for router in self.routers[1:]:
            for key in router.ledgers():
                # Compiled, a cast is checked: key[1] is a worker only in a queue's key.
                owner: object = router.policy
                if key[0] != "global":
                    owner = router.queues[cast(WorkerId, key[1])].discipline
                setattr(owner, cast(str, key[-1]), shared[key])
            if not self.precise:
                router.share_indexes(first)

    def _sync_routers(self) -> simpy.events.ProcessGenerator:
        """Every `router_sync` seconds each replica, in turn, sends the store what it did since
        the last sync (`Ledger.take`: charges, lifts, clamps, refills) and what it routed; then
        each takes the store's values (`Ledger.rebase`) and the others' routing decisions. The
        store applies the steps as the live replicas' Redis script does (router/ledger.py)."""
        store = self.ledger_store = LedgerStore()
        while True:
            yield self.env.timeout(self.config.router_sync)
            routed = []
            for r in self.routers:
                for key, ledger in r.ledgers().items():
                    store.apply(key, ledger.take())
                routed.append(r.indexes.routing_log or [])
                r.indexes.routing_log = []
            for i, router in enumerate(self.routers):
                for key, ledger in router.ledgers().items():
                    ledger.rebase(store.values.get(key, {}))
                for j, decisions in enumerate(routed):
                    if i != j:
                        router.indexes.learn_routed(decisions)
            if self._done():
                return

    def _done(self) -> bool:
        return len(self.log) + len(self.refusals) >= len(self.trace)

    # ----------------------------------------------------------------- driving

    def run(self) -> SimResult:
        started, cpu_started = time.perf_counter(), time.process_time()
        self._progress = RunProgress(
            self.config.policy, len(self.trace), show=self.config.show_progress
        )
        self.env.process(self._arrivals())
        for outage in self.config.outages:
            self.env.process(self._outage(*outage))
        if len(self.routers) > 1 and self.config.router_sync > 0:
            self.env.process(self._sync_routers())
        if self.scaler is not None:
            self.env.process(self.scaler.run(self._done))
        with paced_for_throughput():  # a run's total time is what counts, not its pauses
            self.env.run()
        self._progress.close(self._calls.now)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        workers = [self._worker_record(e) for e in self.engines]
        records = self.log.columns()
        summary = summarize(
            records,
            workers,
            total=len(self.trace),
            cache_bound=self.bound.hit_rate,
            simulated_seconds=self._calls.now,
            wall_seconds=wall,
            config=self._config_summary(),
            classes=self.classes,
            refusals=self.refusals,
        )
        # Every worker holds a GPU from the start to the last answer, or as the planner had it.
        ends = [x.at for x in self.refusals]
        if len(records):
            ends.append(float(records.finish.max()))
        end = max(ends, default=0.0)
        if self.scaler is None:
            summary["gpu_seconds"] = self.config.num_workers * end
        else:
            self.scaler.close(end)
            summary.update(self.scaler.summary())
        decisions = sum((r.decisions for r in self.routers), Counter())
        summary["decisions"] = dict(sorted(decisions.items(), key=lambda kv: -kv[1]))
        # The event loop's CPU time, as `wall_seconds` is its time (the records' columns and this
        # summary not in either): the process's, so another thread's work in it counts too.
        summary["cpu_seconds"] = cpu
        prompt = summary["tokens"]["prompt"]  # type: ignore[index]
        predicted = sum(r.predicted_hit_tokens for r in self.routers)
        estimated = any(r.indexes.estimates for r in self.routers)  # else None: not estimated
        summary["prefix_cache"]["predicted_hit_rate"] = (  # type: ignore[index]
            (predicted / prompt if prompt else 0.0) if estimated else None
        )
        return SimResult(records, workers, summary)

    def release(self) -> None:
        """Let the fleet go, once nothing reads its engines' caches again. What is left of a
        dropped cluster in reference cycles (a few objects a worker) waits for the collector;
        the engines' cached blocks (a million at 1,024 workers) and the blocks the hit bound
        has seen (as many, in one set the collector's walk would visit entry by entry) are
        freed now, by reference counting."""
        for engine in self.engines:
            engine.blocks.forget()
        self.bound.forget()  # every block the trace named (half a million tiled 64 times)

    def _arrivals(self) -> simpy.events.ProcessGenerator:
        """A process only to start where SimPy starts one (before this instant's other events,
        in the order processes were made); from there each arrival is a call (`_arrive`)."""
        # Open loop, each request is read as it arrives (a tiled trace makes it then, and it
        # is let go once answered); closed loop, a session's later turns wait in its queue.
        first_turns: Iterable[Request] = self.trace.requests
        if self.config.closed_loop:
            first_turns = self._first_turns()
        self._upcoming = iter(first_turns)
        self._next_arrival = next(self._upcoming, None)
        self._arrive(0)
        return
        yield  # makes this a generator, which SimPy runs as a process

    def _arrive(self, _call: int) -> None:
        """The requests arriving now, in the trace's order; then the call for the next one,
        made after them as the Timeout it stands for was (so with the id SimPy would give it).
        A Timeout and the process it resumed cost about 1,000 instructions more an arrival."""
        req = self._next_arrival
        while req is not None and req.arrival <= self._calls.now:
            self.dispatch(req)
            req = next(self._upcoming, None)
        self._next_arrival = req
        if req is not None:
            self._calls.call_later(req.arrival - self._calls.now, self._arrive)

    def _first_turns(self) -> list[Request]:
        """Closed loop: the requests sent at their arrival; each session's later turns queued,
        sent as the turn before finishes (`_next_turn`)."""
        first_turns = []
        for req in self.trace.requests:
            if req.session is not None:
                queue = self._next_turns.setdefault(req.session, deque())
                queue.append(req)
                if len(queue) > 1:
                    continue
            first_turns.append(req)
        for queue in self._next_turns.values():
            queue.popleft()  # the first turn is dispatched from first_turns
        return first_turns

    def _send_later(self, req: Request, delay: float) -> simpy.events.ProcessGenerator:
        yield self.env.timeout(delay)
        req.arrival = self._calls.now
        self.dispatch(req)

    def _outage(self, start: float, end: float, worker: int) -> simpy.events.ProcessGenerator:
        yield self.env.timeout(start)
        self._sync(self._calls.now)
        for router in self.routers:  # each replica's health checks see it fail
            requeued = router.worker_down(worker, self._calls.now)
            if self._floors is not None:
                self._floors.changed(worker)  # not routable from now
            for req in requeued:
                prefilled = self._prefilled.pop(req.id, None)
                if prefilled is not None and self._stage_counts:  # prefilled again elsewhere
                    self.engines[prefilled.worker].local.on_finish(req)
                self.dispatch(req, rerouted=True)  # as the proxy: a queued one goes elsewhere
        yield self.env.timeout(end - start)
        for router in self.routers:
            router.worker_up(worker)
        if self._floors is not None:
            self._floors.changed(worker)

    def _sync(self, now: float) -> None:
        """Apply the engine steps that have ended by `now`: only engines with one due (see
        `_lazy`), found in a heap, or among the runs noted to end at this arrival (see
        `_ties_only`), so routing costs the same whatever the fleet's size."""
        due, engines = self._due, self.engines
        if self._ties_only:
            if self._ties:
                for wid in sorted(set(self._ties)):  # as the heap would, by worker
                    if engines[wid].run_end == now:
                        engines[wid].sync(now)
                self._ties.clear()
            return
        if not self._lazy:
            # Every engine with a step ended is due here, so a stale entry (its run replanned,
            # or a duplicate) syncs one with nothing left to apply: cheaper than spotting it.
            while due and due.first_at() <= now:
                engines[due.pop()].sync(now)
            return
        while due and due.first_at() <= now:
            end = due.first_at()
            wid = due.pop()
            if self._due_at(engines[wid]) == end:  # else stale: syncing would apply mid-run
                engines[wid].sync(now)

    def _sync_all(self, now: float) -> None:
        """Every engine's steps ended by `now` applied (a fleet decision reads every queue)."""
        self._sync(now)
        for engine in self.engines:
            engine.sync(now)

    def _due_at(self, engine: Engine) -> float | None:
        if not self._lazy:
            return engine.next_step_end
        return engine.next_change if self._floors is not None else engine.run_end

    def dispatch(self, req: Request, rerouted: bool = False) -> None:
        now = self._calls.now
        self._sync(now)
        router = self.routers[self._next_router]
        self._next_router = (self._next_router + 1) % len(self.routers)
        scaler = self.scaler
        if scaler is not None and not rerouted:
            scaler.arrived(req)
        if self._lazy:  # bring up to date what this decision reads, and nothing else
            # A request routed among a part of the fleet (its group, its adapter's holders) is
            # decided in a view the router makes inside route(): a policy asked what it reads
            # in the whole one may answer for, and remember, the wrong workers. Read all.
            partial = req.adapter is not None or (req.model is not None and self._several_groups)
            # Predicting its TTFT reads every worker's prompts not yet prefilled. A split
            # fleet's policy decides among the workers that prefill.
            read = (
                None
                if partial or router.banded
                else router.policy.progress_read(req, router.pools.routing_pool(req))
            )
            if isinstance(read, LeastLoaded) and self._floors is not None:
                read = () if (least := self._floors.least(now)) is None else (least,)
            elif isinstance(read, LeastLoaded):
                read = None
            for wid in range(len(self.engines)) if read is None else read:
                self.engines[wid].sync(now)
        budgets = self.budgets if not rerouted else None  # its tenant paid on arrival
        if budgets is not None and not budgets.admit(req.client, req.prompt_len, now).ok:
            self._refused(req, RATE_LIMIT)
            return
        try:
            routed = router.route(req, now, scaler.draining if scaler is not None else ())
        except Refused as refused:
            self._refused(req, refused.reason)
            return
        if len(self.routers) > 1:
            self._owner[req.id] = router
        if routed.predicted_ttft is not None:
            self._predicted_ttft[req.id] = routed.predicted_ttft
        self.bound.observe(req)
        if scaler is not None:
            scaler.routed(req, routed.hit_blocks * self.trace.block_size)
        self._submit_all(routed.decision.worker, routed.released)
        limit = router.queue_limit(req)
        if limit is not None:
            self.env.timeout(limit).callbacks.append(
                lambda _: self._queue_time_up(req, router, routed.decision.worker)
            )

    def _queue_time_up(self, req: Request, router: Router, worker: int) -> None:
        """`req` has waited its class's limit: refused if it never started, else it goes on.
        Whichever holds it unstarted takes it back and says so: the router from its queue,
        else its engine from the engine's, and then the router hears of it once."""
        now = self._calls.now
        if router.time_out(req, now):
            released: list[Request] = []
        elif self.engines[worker].withdraw(req.id):
            released = router.never_started(req, now)  # what its worker's queue sends next
        else:
            return  # started (or done): a started request is never refused
        self._owner.pop(req.id, None)
        self._submit_all(worker, released)
        self._refused(req, QUEUE_TIME)
        if self.scaler is not None:
            self.scaler.finished(worker)

    def _refused(self, req: Request, reason: str) -> None:
        self.refusals.append(Refusal(req.id, req.client, req.priority, reason, self._calls.now))
        self._predicted_ttft.pop(req.id, None)
        self._count_done()
        self._next_turn(req)

    def _submit_all(self, worker: int, requests: list[Request]) -> None:
        for req in requests:
            self._submit(worker, req)

    def _submit(self, worker: int, req: Request, preloaded: bool = False) -> None:
        """Hand `req` to its engine, after the server's per-request overhead if the cost model
        has one (a fitted profile measures it). A prefill worker gets it with one output token
        (vLLM's max_tokens 1); a decode worker once its prompt's KV has arrived."""
        if self._decodes[worker] and not preloaded:
            self._send_kv(worker, req)
            return
        if self._prefills[worker]:
            self._split_originals[req.id] = req
            req = replace(req, output_len=1)
        engine = self.engines[worker]
        delay = engine.cost.request_overhead
        if delay <= 0:
            engine.submit(req, preloaded)
        else:
            self.env.timeout(delay).callbacks.append(lambda _: engine.submit(req, preloaded))

    # ------------------------------------------------------------ split fleets

    def _send_kv(self, worker: int, req: Request) -> None:
        """Move `req`'s prompt KV from its prefill worker's GPU to `worker`'s, less the prefix
        `worker` holds already (vLLM's connectors fetch only the blocks missing there)."""
        assert self.transfers is not None
        held = self.engines[worker].reusable_tokens(req)
        nbytes = kv_bytes(req.prompt_len - held, self._kv_bytes_per_token)
        prefilled = self._prefilled[req.id]

        def arrived(transfer: Transfer) -> None:
            prefilled.kv_transfer = transfer.end - transfer.start
            self._submit(worker, req, preloaded=True)

        self.transfers.send(prefilled.worker, worker, nbytes, then=arrived)

    def _charge_prefill_stage(self, seqs: list[Seq], num_tokens: int) -> None:
        """Output decoded here, charged to the discipline of the prefill engine that admitted
        each request too: its queue orders by service over both stages (VTC, DLPM)."""
        for seq in seqs:
            prefilled = self._prefilled.get(seq.req.id)
            if prefilled is not None:
                self.engines[prefilled.worker].local.on_tokens((seq.req,), num_tokens)

    def _prefill_done(self, seq: Seq, now: float) -> None:
        """A split request's prompt is computed: the router hands it to a decode worker."""
        req = self._split_originals.pop(seq.req.id)
        self._prefilled[req.id] = _Prefilled(
            seq.worker, seq.num_cached_tokens or 0, seq.num_preemptions
        )
        self._sync(now)  # the decode choice reads the decode workers' load
        handoff = self._router_of(req).prefilled(req, now)
        self._submit_all(seq.worker, handoff.released_prefill)
        if handoff.decode is None:
            self._owner.pop(req.id, None)
            del self._prefilled[req.id]
            if self._stage_counts:
                self.engines[seq.worker].local.on_finish(req)
            self._refused(req, NO_DECODE_WORKER)
            return
        self._submit_all(handoff.decode, handoff.released)

    # ------------------------------------------------------- engine listener
    # simulator.engine.EngineListener, every call; `defers_tokens` is set in __init__.

    counts_tokens = True  # the router hears every token (in sum while `defers_tokens`)

    def on_engine_changed(self, engine: Engine) -> None:
        """An engine's state moved: tell the router what the server would report, and note
        when its next step ends."""
        waiting, used = len(engine.waiting), engine.kv_used_blocks
        for router in self.routers:
            router.report(engine.id, waiting=waiting, kv_used_blocks=used)
        end = self._due_at(engine)
        if self._ties_only:
            arriving = self._next_arrival
            if arriving is not None and end == arriving.arrival:
                self._ties.append(engine.id)
        elif end is not None and end != self._last_due[engine.id]:  # a tell may leave it be
            self._last_due[engine.id] = end
            self._due.push(end, engine.id)
        if self._floors is not None:
            self._floors.changed(engine.id)

    def on_first_token(self, seq: Seq, now: float) -> None:
        if self._prefills[seq.worker]:
            return  # a prefill worker's one token is not the user's first
        self._router_of(seq.req).first_token(seq.req, now)

    def on_tokens(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
        if self._prefills[seqs[0].worker]:  # one engine's batch
            return
        if self._tokens_in_sum:
            self.router.work_done_on(seqs[0].worker, num_tokens * len(seqs))
            return
        if self._stage_counts:
            self._charge_prefill_stage(seqs, num_tokens)
        if not self._owner:
            self.router.tokens_many([seq.req for seq in seqs], num_tokens, now)
            return
        for seq in seqs:
            self._router_of(seq.req).tokens(seq.req, num_tokens, now)

    def on_progress(
        self, engine: Engine, num_tokens: int, kv_used_blocks: int, next_step_end: float
    ) -> None:
        """Decode steps applied in sum mid-run (one router): its load and KV use moved."""
        self.router.work_done_on(engine.id, num_tokens, kv_used_blocks)
        if self._floors is not None:
            self._floors.changed(engine.id)
        if not self._lazy:  # lazily synced, an engine is due at its run's end, noted already
            self._last_due[engine.id] = next_step_end
            self._due.push(next_step_end, engine.id)

    def on_tokens_settled(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
        if self._tokens_in_sum:
            return  # credited to the worker as they were made; settled at the finish
        self.router.tokens_many([seq.req for seq in seqs], num_tokens, now, credited=True)

    def _router_of(self, req: Request) -> Router:
        return self._owner.get(req.id, self.router) if self._owner else self.router

    def on_finish(self, seq: Seq, now: float) -> None:
        if self._prefills[seq.worker]:
            self._prefill_done(seq, now)
            return
        req = seq.req
        assert seq.admitted_at is not None and seq.first_token_at is not None
        # A split request hit the cache of its prefill worker; it was admitted (its waiting
        # over, as the service curves count a backlog) when its decode began, as live.
        split = self._prefilled.pop(req.id, None) if self._prefilled else None
        if split is not None and self._stage_counts:
            self.engines[split.worker].local.on_finish(req)
        # A record's fields in RequestRecord's order (simulator.columns keeps them as columns).
        self.log.add(
            (
                req.id,
                req.client,
                req.session,
                boxed_id(seq.worker),  # shared by every record of the worker
                req.arrival,
                seq.admitted_at,
                seq.first_token_at,
                now,
                req.prompt_len,
                split.cached_tokens if split else seq.num_cached_tokens or 0,
                seq.num_output,
                seq.num_preemptions + (split.preemptions if split else 0),
                req.weight,
                req.priority,
                self._predicted_ttft.pop(req.id, None),
                None if split is None else split.worker,
                None if split is None else split.kv_transfer,
                req.api,
            )
        )
        if self.budgets is not None:
            self.budgets.charge_output(req.client, seq.num_output, now)
        router = self._owner.pop(req.id, self.router) if self._owner else self.router
        if self._tokens_in_sum:  # its tokens, each credited to its worker already
            router.tokens_many((req,), seq.num_output, now, credited=True)
        self._submit_all(seq.worker, router.finish(req, now))
        if self.scaler is not None:
            self.scaler.finished(seq.worker)
        self._count_done()
        self._next_turn(req)

    def _count_done(self) -> None:
        """One more request done (finished or refused), on the progress bar (simulator.progress:
        this run's own, or the command's over all its runs)."""
        progress = self._progress
        if progress is not None and progress.enabled:
            progress.request_done(self._calls.now)

    def _next_turn(self, req: Request) -> None:
        """Closed loop: the session's next turn, after its think time (a refused turn too:
        its user goes on)."""
        if self.config.closed_loop and req.session is not None:
            queue = self._next_turns.get(req.session)
            if queue:
                nxt = queue.popleft()
                self.env.process(self._send_later(nxt, nxt.think_time or 0.0))

    # ------------------------------------------------------------------ output

    def _worker_record(self, e: Engine) -> WorkerRecord:
        return WorkerRecord(
            id=e.id,
            requests=sum(r.routed[e.id] + r.handoffs[e.id] for r in self.routers),
            tokens_processed=e.tokens_processed,
            kv_blocks=e.blocks.num_blocks,
            peak_kv_blocks=e.peak_used_blocks,
            preemptions=e.num_preemptions,
            evictions=e.blocks.num_evictions,
            steps=e.num_steps,
            events=e.num_events,
            adapter_loads=e.adapter_loads,
            group=self._group_of[e.id] if self._group_of else None,
            role=self.roles[e.id].value,
        )

    def _config_summary(self) -> dict[str, object]:
        e = self.engines[0]
        return {
            "trace": self.trace.source,
            "policy": self.config.policy,
            "local_policy": (
                self.router.queues[0].discipline.name
                if self.placement is Placement.ROUTER
                else e.local.name
            ),
            "policy_params": dict(self.config.policy_params),
            "local_params": dict(self.config.local_params),
            "workers": self.config.num_workers,
            "prefill_workers": self.config.prefill_workers,
            "decode_workers": self.config.decode_workers,
            "topology": self.config.topology if self.config.split else None,
            "cost_model": self.cost.name,
            "groups": [g.model_dump() for g in self.config.groups],
            "adapter_affinity": self.config.adapter_affinity,
            "classes": [asdict(c) for c in self.classes],
            "latency_routing": self.config.latency_routing,
            "admission": self.config.admission,
            "block_size": self.trace.block_size,
            "kv_blocks_per_worker": e.blocks.num_blocks,
            "max_num_seqs": e.config.max_num_seqs,
            "max_num_batched_tokens": e.config.max_num_batched_tokens,
            "fast_forward": e.config.fast_forward,
            "closed_loop": self.config.closed_loop,
            "placement": self.config.placement,
            "window": self.config.window if self.placement is Placement.ROUTER else None,
            "index": self.config.index,
            "kv_event_delay": self.config.kv_event_delay,
            "seed": self.config.seed,
        } | ({} if self.config.autoscale is None else {"autoscale": asdict(self.config.autoscale)})


# What DelayedKVEvents applies at the delay: functions, where a lambda's default argument (the
# indexer of each turn of a loop) is more than mypyc infers.
def _stored(
    indexer: KVEventIndexer, hashes: list[BlockHash], parent: BlockHash | None, now: float
) -> None:
    indexer.stored(hashes, parent, hashes, now)


def _removed(indexer: KVEventIndexer, hashes: list[BlockHash], now: float) -> None:
    indexer.removed(hashes)


class DelayedKVEvents:
    """An engine's KV events reaching the router's index `kv_event_delay` seconds after the
    step that caused them, as vLLM's events reach a live router over ZMQ."""

    def __init__(self, cluster: SimCluster, worker: int, indexers: list[KVEventIndexer]) -> None:
        self.cluster, self.worker, self.indexers = cluster, worker, indexers

    def stored(self, parent: BlockHash | None, hashes: list[BlockHash]) -> None:
        hashes = list(hashes)  # the engine keeps appending to its list
        for indexer in self.indexers:
            self._at_delay(functools.partial(_stored, indexer, hashes, parent))

    def removed(self, hashes: list[BlockHash]) -> None:
        for indexer in self.indexers:
            self._at_delay(functools.partial(_removed, indexer, hashes))

    def _at_delay(self, apply: Callable[[float], None]) -> None:
        env = self.cluster.env
        due = self.cluster.engines[self.worker].event_time + self.cluster.config.kv_event_delay
        if due <= env.now:  # engines apply steps lazily: this one is already due
            apply(due)
        else:
            env.timeout(due - env.now).callbacks.append(lambda _: apply(due))


def simulate(trace: Trace, cost: CostModel | None, config: SimConfig) -> SimResult:
    """Replay `trace`; `cost` may be None when `config.groups` give each group's."""
    cluster = SimCluster(trace, cost, config)
    result = cluster.run()
    cluster.release()
    return result
