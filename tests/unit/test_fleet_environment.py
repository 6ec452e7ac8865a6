"""FleetEnvironment's calls run in SimPy's order: where a Timeout scheduled in a call's place
would, at the same time, read by compiled code as by SimPy."""

from __future__ import annotations

import random

import pytest
import simpy

from simulator.environment import FleetEnvironment

# Delays with many ties (equal times order by when they were scheduled) and zero delays.
DELAYS = (0.0, 0.0, 0.5, 1.0, 1.0, 1.5, 2.0)


def replay(seed: int, as_calls: bool) -> list[tuple[float, float, str]]:
    """A random cascade of Timeouts and processes, each firing scheduling more; with
    `as_calls`, the Timeouts marked "call" are calls instead. Returns what ran, in order:
    (SimPy's time, the calls' time, name)."""
    rng = random.Random(seed)
    env = FleetEnvironment()
    ran: list[tuple[float, float, str]] = []
    budget = [300]  # events in all: a bounded cascade

    def fire(name: str) -> None:
        ran.append((env.now, env.calls.now, name))
        for k in range(rng.choice((0, 1, 2, 3))):
            if budget[0] <= 0:
                return
            budget[0] -= 1
            schedule(f"{name}.{k}", rng.choice(DELAYS), rng.random() < 0.5)

    def schedule(name: str, delay: float, call: bool) -> None:
        if call and as_calls:
            env.calls.call_later(delay, lambda _id: fire(name))
        else:
            env.timeout(delay).callbacks.append(lambda _event: fire(name))

    def process(name: str):
        for k in range(3):
            yield env.timeout(rng.choice(DELAYS))
            fire(f"{name}/{k}")

    for i in range(5):
        schedule(f"t{i}", rng.choice(DELAYS), i % 2 == 0)
    env.process(process("p"))
    env.run(until=2.5)  # an URGENT stop between the others
    ran.append((env.now, env.calls.now, "until"))
    env.run()
    return ran


@pytest.mark.parametrize("seed", range(20))
def test_calls_run_where_timeouts_would(seed: int) -> None:
    as_timeouts, as_calls = replay(seed, as_calls=False), replay(seed, as_calls=True)
    assert as_calls == as_timeouts
    assert all(simpy_now == calls_now for simpy_now, calls_now, _ in as_calls)


def test_peek_sees_both_queues() -> None:
    env = FleetEnvironment()
    env.timeout(3.0)
    assert env.peek() == 3.0
    env.calls.call_later(1.0, lambda _id: None)
    assert env.peek() == 1.0
    env.step()
    assert env.now == env.calls.now == 1.0
    assert env.peek() == 3.0
    env.step()
    assert env.peek() == float("inf")
    with pytest.raises(simpy.core.EmptySchedule):
        env.step()


def test_a_call_gets_its_own_id() -> None:
    env = FleetEnvironment()
    seen: list[int] = []
    first = env.calls.call_later(1.0, seen.append)
    second = env.calls.call_later(1.0, seen.append)
    env.run()
    assert seen == [first, second] and first != second
