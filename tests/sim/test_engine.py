"""The engine model: block accounting, prefix hits, chunked prefill, preemption, fast-forward."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import random
from collections import Counter
from collections.abc import Callable

import pytest
import simpy

from policies.fcfs import FCFS
from router.cost_model import StepShape, roofline
from router.request import Request, hash_token_blocks
from simulator.config import SimConfig
from simulator.driver import simulate
from simulator.engine import Engine, EngineConfig, EngineListener, Seq, decode_steps_within
from simulator.environment import FleetEnvironment
from simulator.listener import ListenerDefaults
from traces.generators import chat_sessions, shared_prefix
from traces.schema import Trace

BS = 16
COST = roofline("llama-3-8b", "a100-80g")


def req(i: int, t: float, prompt: list[int], out: int, client: str = "c") -> Request:
    return Request(i, t, len(prompt), out, hash_token_blocks(prompt, BS), client=client)


def run(reqs: list[Request], workers: int = 1, policy: str = "round_robin", **engine: object):
    trace = Trace([dataclasses.replace(r) for r in reqs], BS)
    config = EngineConfig(check_invariants=True, **engine)  # type: ignore[arg-type]
    result = simulate(trace, COST, SimConfig(num_workers=workers, policy=policy, engine=config))
    return {r.id: r for r in result.records}, result


class TestPrefixCaching:
    def test_second_request_hits_the_first_ones_full_blocks(self) -> None:
        prompt = list(range(3000))  # 187 full blocks + 8 tokens
        records, _ = run([req(0, 0.0, prompt, 4), req(1, 5.0, prompt + [7] * 20, 4)])
        assert records[0].cached_tokens == 0
        assert records[1].cached_tokens == 187 * BS
        assert records[1].ttft < records[0].ttft

    def test_whole_prompt_cached_still_computes_its_last_block(self) -> None:
        prompt = list(range(64))  # exactly 4 blocks
        records, _ = run([req(0, 0.0, prompt, 2), req(1, 5.0, prompt, 2)])
        assert records[1].cached_tokens == 3 * BS

    def test_freed_blocks_stay_cached_until_reused(self) -> None:
        a, b = list(range(64)), list(range(1000, 1080))
        # 8 blocks in all. a holds 5 (4 prompt + 1 for its output), then frees them; b needs 6,
        # so 2 of a's cached blocks are reused, and freeing tail first makes those a's last two.
        records, _ = run(
            [req(0, 0.0, a, 2), req(1, 5.0, b, 2), req(2, 10.0, a, 2)], num_kv_blocks=8
        )
        assert records[2].cached_tokens == 2 * BS, "a's first two blocks survive, its tail went"


class TestChunkedPrefill:
    def test_long_prompt_is_prefilled_over_several_steps(self) -> None:
        _, result = run([req(0, 0.0, list(range(5000)), 1)], max_num_batched_tokens=1024)
        assert result.workers[0].steps == 5  # ceil(5000 / 1024)

    def test_decodes_share_steps_with_a_prefill_chunk(self) -> None:
        short = req(0, 0.0, list(range(50)), 400)
        long = req(1, 0.5, list(range(10_000, 16_000)), 2)
        records, _ = run([short, long], max_num_batched_tokens=512)
        # The long prefill took several steps, during which the short request kept decoding.
        assert records[0].finish > records[1].first_token
        assert records[1].ttft > 5 * COST.step_time(StepShape.prefill(512, 0))


class TestPreemption:
    def test_blocks_running_out_preempts_and_everything_completes(self) -> None:
        reqs = [req(i, 0.01 * i, [i * 1000 + k for k in range(100)], 300) for i in range(12)]
        records, result = run(reqs, num_kv_blocks=80)
        assert len(records) == 12
        assert sum(r.preemptions for r in records.values()) > 0
        assert result.workers[0].peak_kv_blocks <= 80

    def test_a_request_larger_than_memory_is_a_clear_error(self) -> None:
        with pytest.raises(RuntimeError, match="needs more KV blocks"):
            run([req(0, 0.0, list(range(200)), 2)], num_kv_blocks=4)


class ProtocolOnlyCost:
    """A cost model that only follows the CostModel protocol, no StepCost: the roofline's
    prices, through plain method calls."""

    def __init__(self, cost: object) -> None:
        self._cost = cost

    def __getattr__(self, name: str) -> object:
        return getattr(self._cost, name)


def test_a_cost_model_outside_step_cost_prices_steps_alike() -> None:
    """The engine prices steps through StepCost natively; any other CostModel is wrapped as one
    and must give the very same records."""
    trace = shared_prefix(num_requests=200, num_tenants=4, prefix_tokens=3000, rate=20, seed=3)
    config = SimConfig(num_workers=2, policy="least_load", engine=EngineConfig(num_kv_blocks=800))
    native = simulate(trace, COST, config)
    plain = simulate(trace, ProtocolOnlyCost(COST), config)  # type: ignore[arg-type]
    assert plain.records == native.records
    assert sum(r.preemptions for r in native.records) > 0  # chunks, decode runs and preemptions


def test_decode_steps_within_is_the_longest_run_that_fits() -> None:
    """The closed form a decode run's length is planned with, against counting each
    sequence's blocks step by step: the last step count whose new blocks fit."""
    rng = random.Random(7)

    def new_blocks(computed: list[int], bs: int, steps: int) -> int:
        return sum(-(-(c + steps) // bs) - -(-c // bs) for c in computed)

    for _ in range(3000):
        bs = rng.choice((1, 2, 16, 512))
        computed = [rng.randint(1, 3 * bs + 5) for _ in range(rng.randint(1, 9))]
        free = rng.randint(0, 4 * len(computed))
        most = 0
        while new_blocks(computed, bs, most + 1) <= free:
            most += 1
        assert decode_steps_within(computed, bs, free) == most, (computed, bs, free)


class TestFastForward:
    """Batching decode steps into one event must give exactly step-by-step's results, for a
    policy that reads decode progress (least_load: every engine is brought up to date before a
    decision) and for those that do not (their engines are synced only at run ends)."""

    policy, local = "least_load", None
    sim: dict[str, object] = {}  # more of the cluster's configuration
    saves_events = True

    def both(self, trace: Trace, **kw: object):
        out = []
        for ff in (True, False):
            t = Trace([dataclasses.replace(r) for r in trace.requests], trace.block_size)
            cfg = EngineConfig(fast_forward=ff, check_invariants=True, **kw)  # type: ignore
            config = SimConfig(
                3,
                self.policy,
                local_policy=self.local,
                engine=cfg,
                **self.sim,  # type: ignore[arg-type]
            )
            out.append(simulate(t, COST, config))
        return out

    def assert_same(self, fast, slow) -> None:
        assert fast.records == slow.records
        assert [w.steps for w in fast.workers] == [w.steps for w in slow.workers]
        if self.saves_events:
            assert fast.workers[0].events < slow.workers[0].events / 3, "fast-forward saved events"

    def test_shared_prefix_workload(self) -> None:
        trace = shared_prefix(num_requests=300, rate=15, prefix_tokens=1500, output_tokens=150)
        self.assert_same(*self.both(trace))

    def test_with_preemptions(self) -> None:
        trace = shared_prefix(num_requests=200, rate=30, prefix_tokens=1500, output_tokens=300)
        fast, slow = self.both(trace, num_kv_blocks=700)
        assert sum(r.preemptions for r in fast.records) > 0
        self.assert_same(fast, slow)

    def test_closed_loop_sessions(self) -> None:
        trace = chat_sessions(num_sessions=40, rate=2.0, think_time=1.0)
        out = []
        for ff in (True, False):
            t = Trace([dataclasses.replace(r) for r in trace.requests], trace.block_size)
            cfg = EngineConfig(fast_forward=ff)
            out.append(simulate(t, COST, SimConfig(num_workers=2, engine=cfg, closed_loop=True)))
        self.assert_same(*out)

    @pytest.mark.parametrize("num_steps", [1, 50, 500])  # the loop and the numpy path
    def test_run_decode_times_equal_step_times(self, num_steps: int) -> None:
        for cost in (COST, roofline("llama-3-70b", "h100")):  # memory- and compute-bound mixes
            times = cost.decode_step_times(7, 12_345, num_steps)
            assert times == [
                cost.step_time(StepShape(7, 12_345 + 7 * j, 12_345 + 7 * j))
                for j in range(num_steps)
            ]

    @pytest.mark.parametrize("num_decodes", [0, 1, 50, 500])
    def test_a_run_s_step_ends_are_its_step_times_summed_in_order(self, num_decodes: int) -> None:
        for cost in (COST, roofline("llama-3-70b", "h100")):
            times = [0.25, *cost.decode_step_times(7, 12_345, num_decodes)]
            expected = list(itertools.accumulate(times, initial=1.5))[1:]
            ends = cost.run_ends(1.5, 0.25, 7, 12_345, num_decodes)
            assert (ends.count, ends.last, ends.shortest) == (len(times), expected[-1], min(times))
            # Looked up out of order, as a run cut short and read mid-run is.
            for now in (expected[-1] + 1, expected[len(times) // 2], 1.5, expected[0]):
                assert ends.ended_by(now, 0, ends.count) == bisect.bisect_right(expected, now)
            assert [ends.end(i) for i in reversed(range(ends.count))] == expected[::-1]
            ends = cost.run_ends(1.5, 0.25, 7, 12_345, num_decodes)
            keep = max(1, len(times) // 3)
            assert ends.ended_by(expected[keep - 1], 1, keep) == keep
            ends.cut(keep)
            assert (ends.count, ends.last) == (keep, expected[keep - 1])

    def test_step_ends_read_in_any_order_and_cut_are_the_sums(self) -> None:
        """Reads, forward as a run's usually are or back, and cuts before or behind where the
        reads got to, in random order: each answer is the plain sums' (a cursor walks the ends,
        and ends behind it are stored)."""
        rng = random.Random(7)
        for cost in (COST, roofline("llama-3-70b", "h100")):
            for _ in range(40):
                num_decodes = rng.choice((1, 2, 30, 300))
                times = [0.25, *cost.decode_step_times(7, 12_345, num_decodes)]
                expected = list(itertools.accumulate(times, initial=1.5))[1:]
                ends = cost.run_ends(1.5, 0.25, 7, 12_345, num_decodes)
                for _ in range(30):
                    count = len(expected)
                    op = rng.random()
                    if op < 0.4:
                        i = rng.randrange(count)
                        assert ends.end(i) == expected[i]
                    elif op < 0.9:
                        now = rng.uniform(1.4, expected[-1] + 0.1)
                        lo = rng.randrange(count + 1)
                        hi = rng.randrange(lo, count + 1)
                        assert ends.ended_by(now, lo, hi) == bisect.bisect_right(
                            expected, now, lo, hi
                        )
                    elif count > 1:
                        keep = rng.randrange(1, count)
                        ends.cut(keep)
                        del expected[keep:]
                    assert (ends.count, ends.last) == (len(expected), expected[-1])


class TestPrefillThenDecodeRun:
    """A step that ends every prompt it prefills runs on into the decode steps after it, as
    one event, when nothing waits to join them; the times are step-by-step's."""

    def records_and_events(self, reqs: list[Request], fast_forward: bool, **engine: object):
        records, result = run(reqs, fast_forward=fast_forward, **engine)
        return records, result.workers[0]

    def test_a_lone_request_is_one_event(self) -> None:
        reqs = [req(0, 0.0, list(range(1000)), 50)]
        fast, worker = self.records_and_events(reqs, True)
        slow, by_step = self.records_and_events(reqs, False)
        assert fast == slow
        assert worker.steps == by_step.steps == 50
        assert (worker.events, by_step.events) == (1, 50)

    def test_a_prompt_chunked_over_steps_is_one_event_with_its_decodes(self) -> None:
        reqs = [req(0, 0.0, list(range(5000)), 30)]
        fast, worker = self.records_and_events(reqs, True, max_num_batched_tokens=1024)
        slow, _ = self.records_and_events(reqs, False, max_num_batched_tokens=1024)
        assert fast == slow
        assert worker.steps == 4 + 30 and worker.events == 1

    def test_an_arrival_mid_prompt_cuts_its_run_at_the_next_chunk(self) -> None:
        # b arrives while a's second chunk runs: the run is cut at that chunk's end, where b
        # waits (a's chunks fill the budget) and is admitted into a's last step.
        a = req(0, 0.0, list(range(5000)), 30)
        lone, _ = self.records_and_events([a], False, max_num_batched_tokens=1024)
        b = req(1, lone[0].first_token * 0.3, [7] * 300, 10)
        fast, worker = self.records_and_events([a, b], True, max_num_batched_tokens=1024)
        slow, by_step = self.records_and_events([a, b], False, max_num_batched_tokens=1024)
        assert fast == slow
        assert fast[1].arrival < fast[1].admitted < fast[0].first_token
        assert worker.steps == by_step.steps and 1 < worker.events < by_step.events

    def test_prefilled_prefix_lets_the_waiting_request_in_at_step_2(self) -> None:
        # b waits for memory while a prefills; a's prompt blocks, cached once step 1 ends,
        # are b's prefix, so b fits at step 2: a's prefill must be a step of its own.
        shared = list(range(96))  # 6 blocks
        a, b = req(0, 0.0, shared + [1] * 8, 20), req(1, 0.0, shared + [2] * 8, 20)
        fast, _ = self.records_and_events([a, b], True, num_kv_blocks=10, max_num_seqs=4)
        slow, _ = self.records_and_events([a, b], False, num_kv_blocks=10, max_num_seqs=4)
        assert fast == slow
        assert fast[1].cached_tokens == 6 * BS


class TestFastForwardLazySync(TestFastForward):
    policy, local = "lpm", "fcfs"


class TestFastForwardNamedWorkers(TestFastForward):
    """D²LPM names the workers whose deficits it reads: only those are brought up to date."""

    policy, local = "d2lpm", "fcfs"


class TestFastForwardReorderingQueue(TestFastForward):
    """An LPM queue may put a request that fits at its head as decode steps evict cached
    blocks: with a request waiting for memory, the engine steps one at a time."""

    policy, local = "lpm", "lpm"
    saves_events = False


class TestFastForwardFairQueue(TestFastForward):
    """VTC's queue in the engine, behind a router that reads no decode progress: an arrival
    lifts its client's counter to the backlogged ones', which the steps ended so far charged.
    Its head moves as tokens are served: with a request waiting, the engine steps one by one."""

    policy, local = "lpm", "vtc"
    saves_events = False


class TestFastForwardVTC(TestFastForward):
    """Least load across workers, VTC's queue in each engine: the queues' counters catch up
    with decode runs at their ends, and at an arrival."""

    policy, local = "vtc", None
    saves_events = False


class TestFastForwardPreciseIndex(TestFastForward):
    """The index hears the engines' KV events (blocks a prefill stored, blocks a decode step
    evicted) at their step's end plus the delay, also for steps applied after the fact."""

    policy, local = "lpm", "fcfs"
    sim = {"index": "precise", "kv_event_delay": 0.05}


class TestFastForwardRouterPlacement(TestFastForward):
    """D²LPM's queues in the router, each worker a FCFS engine with a window in flight."""

    policy, local = "d2lpm", None
    sim = {"placement": "router"}


class TestFastForwardRoundRobin(TestFastForward):
    policy = "round_robin"


class TestFastForwardPreble(TestFastForward):
    """Preble reads every worker's KV use and decode timings: every engine is brought up to
    date before a decision, as for least_load, with its own queue discipline."""

    policy, local = "preble", None


class TestRoofline:
    def test_decode_of_8b_on_a100_is_memory_bound_around_12ms(self) -> None:
        assert 0.010 < COST.decode_time(1, 1000) < 0.014

    def test_prefill_is_compute_bound_and_cached_tokens_are_cheap(self) -> None:
        full = COST.prefill_time(8000, 0)
        assert full > 0.5
        assert COST.prefill_time(500, 7500) < full / 5

    def test_70b_needs_tensor_parallelism(self) -> None:
        with pytest.raises(ValueError, match="does not fit"):
            roofline("llama-3-70b", "a100-80g", tp=1)
        assert roofline("llama-3-70b", "h100").tp == 4


class Finishes(ListenerDefaults):
    """Notes when each request ended and with how many tokens; counts none as they come."""

    counts_tokens = False

    def __init__(self) -> None:
        self.finished: dict[int, tuple[int, float]] = {}

    def on_first_token(self, seq: Seq, now: float) -> None:
        pass

    def on_tokens(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
        raise AssertionError("a listener counting no tokens hears of none")

    def on_finish(self, seq: Seq, now: float) -> None:
        self.finished[seq.req.id] = (seq.num_output, now)


def lone_engine(listener: EngineListener, **engine: object) -> tuple[FleetEnvironment, Engine]:
    """One engine on its own (no router), FCFS, checking its accounting after every change."""
    env = FleetEnvironment()
    config = EngineConfig(block_size=BS, check_invariants=True, **engine)  # type: ignore[arg-type]
    return env, Engine(env, 0, COST, config, FCFS(), listener)


def at(env: simpy.Environment, when: float, call: Callable[[], object]) -> None:
    env.timeout(when).callbacks.append(lambda _: call())


class TestAbort:
    """A client hanging up: the engine stops spending time on the request."""

    def run_with_abort(self, abort_at: float, victim: int, fast_forward: bool = True):
        listener = Finishes()
        env, engine = lone_engine(listener, max_num_seqs=2, fast_forward=fast_forward)
        for i in range(3):
            engine.submit(req(i, 0.0, [i * 100 + k for k in range(64)], 500))
        at(env, abort_at, lambda: engine.abort(victim))
        env.run()
        engine.check_integrity(between_steps=True)
        assert engine.blocks.num_used == 0, "every block came back"
        return listener.finished

    def test_running_request_ends_at_the_next_step(self) -> None:
        for ff in (True, False):
            done = self.run_with_abort(1.0, victim=0, fast_forward=ff)
            tokens, at = done[0]
            assert 0 < tokens < 500 and 1.0 <= at < 1.05
            assert done[1][0] == 500 and done[2][0] == 500

    def test_a_request_stopped_mid_prompt_ends_at_the_next_step(self) -> None:
        # Its prompt takes 16 steps of 64 tokens; stopped in the 8th, it ends with that step
        # (a step that samples nothing), and one beside it decodes on to its end.
        for ff in (True, False):
            listener = Finishes()
            env, engine = lone_engine(
                listener, max_num_batched_tokens=64, max_num_seqs=2, fast_forward=ff
            )
            engine.submit(req(0, 0.0, list(range(1024)), 50))
            engine.submit(req(1, 0.0, [7], 200))
            step = COST.step_time(StepShape(64, 0, 0))
            at(env, 7.5 * step, functools.partial(engine.abort, 0))
            env.run()
            assert engine.blocks.num_used == 0, "every block came back"
            tokens, ended = listener.finished[0]
            assert tokens == 0 and 7.5 * step < ended < 10 * step
            assert listener.finished[1][0] == 200

    def test_waiting_request_is_dropped_at_once(self) -> None:
        done = self.run_with_abort(0.5, victim=2)  # max_num_seqs=2: request 2 still waits
        assert 2 not in done
        assert done[0][0] == done[1][0] == 500


class TestWithdraw:
    """A request whose queue time ran out: the engine takes it back only if it never started,
    and says which."""

    def run_with_withdraw(self, when: float, victim: int, **engine: object):
        listener, said = Finishes(), []
        env, eng = lone_engine(listener, max_num_seqs=2, **engine)
        for i in range(3):
            eng.submit(req(i, 0.0, [i * 100 + k for k in range(64)], 500))
        at(env, when, lambda: said.append(eng.withdraw(victim)))
        env.run()
        assert eng.blocks.num_used == 0 and not eng.waiting, "every block and slot came back"
        return said, listener.finished

    def test_a_request_never_admitted_is_taken_back(self) -> None:
        said, done = self.run_with_withdraw(0.5, victim=2)  # max_num_seqs=2: 2 waits
        assert said == [True] and 2 not in done
        assert done[0][0] == done[1][0] == 500

    @pytest.mark.parametrize("victim", [0, 7], ids=["running", "never here"])
    def test_any_other_goes_on(self, victim: int) -> None:
        said, done = self.run_with_withdraw(0.5, victim)
        assert said == [False] and {i: n for i, (n, _) in done.items()} == {0: 500, 1: 500, 2: 500}

    def test_a_preempted_request_has_started(self) -> None:
        # 2 x 36 blocks at the end, 50 in all: request 1, admitted last, is preempted to wait.
        listener = Finishes()
        env, engine = lone_engine(listener, max_num_seqs=2, num_kv_blocks=50)
        for i in range(2):
            engine.submit(req(i, 0.0, [i * 100 + k for k in range(64)], 500))
        said = []

        def preempted() -> None:
            assert engine.num_preemptions == 1 and 1 in engine.waiting, "set up as preempted"
            said.append(engine.withdraw(1))

        at(env, 5.0, preempted)
        env.run()
        assert said == [False] and listener.finished[1][0] == 500


class Tally(ListenerDefaults):
    """Each request's tokens as the engine tells them: step by step, or in sum mid-run."""

    def __init__(self, defers_tokens: bool) -> None:
        self.defers_tokens = defers_tokens
        self.tokens: Counter[int] = Counter()
        self.in_sum = self.settled = 0
        self.finished: dict[int, tuple[int, float]] = {}

    def on_first_token(self, seq: Seq, now: float) -> None:
        pass

    def on_tokens(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
        for seq in seqs:
            self.tokens[seq.req.id] += num_tokens

    def on_progress(self, engine: Engine, num_tokens: int, used: int, next_end: float) -> None:
        self.in_sum += num_tokens

    def on_tokens_settled(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
        self.on_tokens(seqs, num_tokens, now)
        self.settled += num_tokens * len(seqs)

    def on_finish(self, seq: Seq, now: float) -> None:
        self.finished[seq.req.id] = (seq.num_output, now)


class TestListener:
    def run(self, listener: Tally) -> Tally:
        env, engine = lone_engine(listener)
        for i in range(3):
            engine.submit(req(i, 0.1 * i, [i * 100 + k for k in range(64)], 300 + 100 * i))

        def looker() -> simpy.events.ProcessGenerator:  # a router reading the engine mid-run
            for _ in range(400):
                yield env.timeout(0.05)
                engine.sync(env.now)

        env.process(looker())
        env.run()
        return listener

    def test_tokens_in_sum_are_settled_on_the_requests_that_made_them(self) -> None:
        each, in_sum = self.run(Tally(defers_tokens=False)), self.run(Tally(defers_tokens=True))
        assert in_sum.in_sum > 0 and in_sum.settled == in_sum.in_sum
        assert each.in_sum == each.settled == 0
        assert in_sum.tokens == each.tokens == {0: 300, 1: 400, 2: 500}
        assert in_sum.finished == each.finished

    def test_a_listener_deferring_tokens_must_take_them(self) -> None:
        class Forgetful(Finishes):
            counts_tokens, defers_tokens = True, True

            def on_tokens(self, seqs: list[Seq], num_tokens: int, now: float) -> None:
                pass

        env, engine = lone_engine(Forgetful())
        engine.submit(req(0, 0.0, list(range(64)), 500))
        at(env, 1.0, lambda: engine.sync(env.now))
        with pytest.raises(NotImplementedError, match="on_progress"):
            env.run()
