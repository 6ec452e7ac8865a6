"""The fleet planner on hand-fed windows: ahead of a ramp, slow to drain, within its range."""

from __future__ import annotations

import math

import pytest

from router.planner import Fleet, Planner, PlannerConfig, Window
from tests.helpers import COST

PROMPT, OUTPUT = 1000, 200  # every window's mix: tokens per request


def window(start: float, rate: float, length: float = 10.0, hits: float = 0.5) -> Window:
    n = round(rate * length)
    return Window(start, start + length, n, n * PROMPT, n * OUTPUT, int(n * PROMPT * hits))


def planner(**overrides: object) -> Planner:
    settings: dict[str, object] = {
        "min_workers": 1, "max_workers": 64, "startup": 30.0, "interval": 10.0,
    }  # fmt: skip
    settings.update(overrides)
    return Planner(PlannerConfig(**settings), COST)  # type: ignore[arg-type]


def feed(p: Planner, rates: list[float], length: float = 10.0) -> list[int]:
    """The targets after each window of `rates`, the fleet serving the last target."""
    return [p.decide(window(i * length, r, length), Fleet(p.target)).target
            for i, r in enumerate(rates)]  # fmt: skip


def sustained(p: Planner) -> float:
    """Requests per second one worker is planned for, at the test mix."""
    return p.config.headroom * p.worker_rate(PROMPT, OUTPUT, 0.5)


def test_one_worker_sustains_a_plausible_rate() -> None:
    rate = planner().worker_rate(PROMPT, OUTPUT, 0.5)
    assert 1 < rate < 100  # an 8B model on an A100, 1k-token prompts, 200 out
    assert planner().worker_rate(PROMPT, OUTPUT, 0.9) > rate  # hits make prefill cheaper
    assert planner(tpot=0.02).worker_rate(PROMPT, OUTPUT, 0.5) < rate  # smaller batches


def test_a_ramp_raises_the_target_ahead_of_the_load() -> None:
    p = planner()
    per_worker = sustained(p)
    slope = per_worker / 10  # one worker's worth more every 10 s
    rates = [slope * 10 * i for i in range(1, 13)]
    targets = feed(p, rates)
    for i, target in enumerate(targets[2:], start=2):  # from the second window a trend shows
        # Workers started now serve from start-up later: they must cover the load then.
        at_startup = slope * ((i + 1) * 10 + p.config.startup)
        assert target * per_worker >= at_startup, (i, target)
        # More than a planner reading only the rate just seen would run.
        assert target > math.ceil(rates[i] / per_worker)


def test_a_short_spike_is_not_followed_by_drains_at_once() -> None:
    p = planner(cooldown=40.0, step_down=1)
    per_worker = sustained(p)
    base = 2 * per_worker
    targets = feed(p, [base] * 3 + [10 * per_worker] + [base] * 12)
    steady, peak = targets[2], targets[3]
    assert peak > steady
    after = targets[4:]
    # The cool-down: the spike's workers stay for 40 s (4 windows) after it.
    assert after[:4] == [peak] * 4
    # Then down by at most one worker a step, each step a cool-down apart, to the steady need.
    drops = [a - b for a, b in zip(after, after[1:], strict=False)]
    assert all(d in (0, 1) for d in drops)
    assert after[-1] < peak
    assert min(after) >= steady


def test_the_target_stays_within_min_and_max() -> None:
    p = planner(min_workers=2, max_workers=5, cooldown=0.0, step_down=10)
    assert p.target == 2  # the initial fleet is the minimum
    per_worker = sustained(p)
    # Idle, a flood, then idle until the flood has left the windows the planner keeps.
    targets = feed(p, [0.0] * 3 + [100 * per_worker] * 3 + [0.0] * (p.config.history + 1))
    assert min(targets) == 2 and max(targets) == 5
    assert targets[:3] == [2, 2, 2]
    assert targets[3:6] == [5, 5, 5]
    assert targets[-1] == 2


def test_a_flat_load_holds_steady() -> None:
    p = planner()
    per_worker = sustained(p)
    wobble = [1.0, 1.05, 0.95, 1.02, 0.98, 1.03, 0.97]  # a Poisson count's few percent
    targets = feed(p, [4.5 * per_worker * w for w in wobble * 4])
    assert len(set(targets[2:])) == 1
    assert 5 <= targets[-1] <= 6  # 4.5 workers' worth, and a little for the wobble


def test_waiting_requests_raise_the_target() -> None:
    calm, backlogged = planner(), planner()
    w = window(0.0, 2 * sustained(calm))
    assert backlogged.decide(w, Fleet(1, waiting=2000)).target > calm.decide(w, Fleet(1)).target


def test_the_same_windows_give_the_same_plans() -> None:
    rates = [3.0, 9.0, 1.0, 30.0, 0.0, 12.0, 12.0, 2.0] * 3
    a, b = planner(cooldown=20.0), planner(cooldown=20.0)
    plans = [a.decide(window(i * 10.0, r), Fleet(a.target)) for i, r in enumerate(rates)]
    again = [b.decide(window(i * 10.0, r), Fleet(b.target)) for i, r in enumerate(rates)]
    assert plans == again


@pytest.mark.parametrize(
    "spec, field",
    [
        ("min=4,max=2", "min"),
        ("min=0", "min"),
        ("startup=-1", "startup"),
        ("interval=0", "interval"),
        ("interval=-5", "interval"),
        ("min=1.5", "min"),
        ("speed=3", "speed"),
        ("startup", "startup"),
        ("max=many", "max"),
        ("initial=9,max=4", "initial"),
    ],
)
def test_bad_settings_name_their_field(spec: str, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        PlannerConfig.parse(spec)


def test_settings_parse_with_short_names() -> None:
    c = PlannerConfig.parse("min=2,max=16,startup=60,interval=15")
    assert (c.min_workers, c.max_workers, c.startup, c.interval) == (2, 16, 60.0, 15.0)
    assert c.hold == 60.0 and c.first == 2


def test_one_busy_window_is_not_extrapolated() -> None:
    """ServeGen's arrivals are burstier than Poisson: one window at three times a flat load
    (or one with a few long answers) must not be projected a start-up ahead as a ramp."""
    p = planner()
    per_worker = sustained(p)
    *flat, spike = feed(p, [4 * per_worker] * 8 + [12 * per_worker])
    # The windows' mean rises by a quarter; a line through the spike would ask for 12+.
    assert flat[-1] <= spike <= 6
    w = window(90.0, 4 * per_worker)
    long_answers = Window(w.start, w.end, w.arrivals, w.prompt_tokens, 20 * w.output_tokens)
    assert p.decide(long_answers, Fleet(p.target)).worker_rate > 0.5 * p.worker_rate(
        PROMPT, OUTPUT, 0.5
    )  # the mix is the windows', not the last one's
