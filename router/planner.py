"""The fleet planner: how many workers to run, decided every interval from what the router saw.

    arrivals, lengths, hits ──▶ Window ─┐
    queues, workers starting ─▶ Fleet  ─┼─▶ Planner.decide ─▶ Plan(target, reason)
    the cost model (one worker's rate) ─┘

Pure: no clock, no I/O. A driver (the simulator's replay, later the live proxy against Ray) hands
it one `Window` and one `Fleet` per decision and starts or drains workers towards the target.

Scaling up looks ahead: the arrival rate's trend over the last few windows is projected over a
worker's start-up plus one interval, so workers are serving before the load that needs them
arrives. The trend is a Theil-Sen line (the median of the pairwise slopes) and the load mix is
pooled over the same windows: production arrivals are bursty, and one busy window, or a few long
answers in it, would otherwise be extrapolated into workers the day never needs. Scaling down
waits: only after a lower target has held for `cooldown` seconds, so a short lull or the end of a
spike does not stop workers the next burst needs.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, fields

from router.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """`min_workers`..`max_workers`: the target's range; `startup`: seconds from starting a worker
    to its serving; `interval`: seconds between decisions; `cooldown` (None: four intervals): how
    long a lower target must hold before workers are drained; `step_down`: the most workers one
    decision drains (None: down to the need at once); `history`: windows the trend and the mix are
    taken over; `headroom`: the share of a worker's sustainable rate planned for (the rest absorbs
    bursts, so queues and TTFT stay short); `high_water`: workers are added only once the projection
    loads the fleet above this share of what it sustains (a window's noise inside the band between
    `headroom` and `high_water` adds nothing); `low_water`: workers are drained only once the need
    fits the smaller fleet at this share of its planned rate (the gap keeps a load near a boundary
    from flapping between two sizes); `tpot`: the time per output token a worker's batch must keep;
    `initial`: workers serving at the start (None: `min_workers`)."""

    min_workers: int = 1
    max_workers: int = 16
    startup: float = 60.0
    interval: float = 15.0
    cooldown: float | None = None
    step_down: int | None = None
    history: int = 8
    headroom: float = 0.8
    high_water: float = 0.9
    low_water: float = 0.85
    tpot: float = 0.1
    initial: int | None = None

    # The names `--autoscale` takes, for the fields whose own names are long.
    SHORT = {"min": "min_workers", "max": "max_workers"}

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min: must be at least 1, got {self.min_workers}")
        if self.max_workers < self.min_workers:
            raise ValueError(f"min: {self.min_workers} is above max ({self.max_workers})")
        if self.startup < 0:
            raise ValueError(f"startup: must be >= 0 seconds, got {self.startup}")
        if not self.interval > 0:
            raise ValueError(f"interval: must be > 0 seconds, got {self.interval}")
        if self.cooldown is not None and self.cooldown < 0:
            raise ValueError(f"cooldown: must be >= 0 seconds, got {self.cooldown}")
        if self.step_down is not None and self.step_down < 1:
            raise ValueError(f"step_down: must be at least 1, got {self.step_down}")
        if self.history < 2:
            raise ValueError(f"history: must be at least 2 windows, got {self.history}")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"headroom: must be in (0, 1], got {self.headroom}")
        if not self.headroom <= self.high_water <= 1:
            raise ValueError(
                f"high_water: must be within headroom..1 ({self.headroom}..1), "
                f"got {self.high_water}"
            )
        if not 0 < self.low_water <= 1:
            raise ValueError(f"low_water: must be in (0, 1], got {self.low_water}")
        if not self.tpot > 0:
            raise ValueError(f"tpot: must be > 0 seconds, got {self.tpot}")
        if self.initial is not None and not self.min_workers <= self.initial <= self.max_workers:
            raise ValueError(
                f"initial: must be within min..max ({self.min_workers}..{self.max_workers}), "
                f"got {self.initial}"
            )

    @property
    def hold(self) -> float:
        """Seconds a lower target must hold before a drain."""
        return 4 * self.interval if self.cooldown is None else self.cooldown

    @property
    def first(self) -> int:
        """Workers serving when the run starts."""
        return self.min_workers if self.initial is None else self.initial

    @classmethod
    def parse(cls, spec: str) -> PlannerConfig:
        """`min=2,max=16,startup=60[,interval=15,...]`; a ValueError names the bad field."""
        known = {f.name for f in fields(cls)}
        values: dict[str, object] = {}
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            key, sep, text = item.partition("=")
            name = cls.SHORT.get(key.strip(), key.strip())
            if not sep or name not in known or name in cls.SHORT:
                names = ", ".join(sorted({*cls.SHORT, *known} - set(cls.SHORT.values())))
                raise ValueError(f"{key.strip() or item}: expected K=V with K one of: {names}")
            try:
                number = float(text)
            except ValueError:
                raise ValueError(f"{key.strip()}: expected a number, got {text!r}") from None
            integral = name in ("min_workers", "max_workers", "step_down", "history", "initial")
            if integral and number != int(number):
                raise ValueError(f"{key.strip()}: expected a whole number, got {text!r}")
            values[name] = int(number) if integral else number
        return cls(**values)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Window:
    """What arrived over one decision interval [start, end): requests, their prompt and
    expected output tokens, and the prompt tokens routing expected to find cached."""

    start: float
    end: float
    arrivals: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0

    @property
    def rate(self) -> float:
        span = self.end - self.start
        return self.arrivals / span if span > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Fleet:
    """The fleet at a decision: workers serving (draining ones left out), workers starting,
    and the requests waiting on the serving ones, summed."""

    serving: int
    starting: int = 0
    waiting: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """A decision: the target worker count, why, and the figures it came from."""

    target: int
    reason: str
    projected_rate: float  # requests per second expected a start-up from now
    worker_rate: float  # requests per second one worker sustains for the current mix
    needed: int  # workers the projection needs, before the range and the hold


class Planner:
    """Sets a target worker count each interval. `cost`: the step costs of one worker (the
    router's cost model); `max_num_seqs`: the engine's batch limit."""

    def __init__(self, config: PlannerConfig, cost: CostModel, max_num_seqs: int = 256) -> None:
        self.config, self.cost, self.max_num_seqs = config, cost, max_num_seqs
        self.target = config.first
        self._windows: deque[Window] = deque(maxlen=config.history)
        self._mix = (0.0, 0.0, 0.0)  # mean prompt, output, hit rate: the last seen, kept over
        self._low_since: float | None = None  # when the need first fell below the target

    def decide(self, window: Window, fleet: Fleet) -> Plan:
        """The target after `window`. Mutates the planner's history (deterministic: the same
        windows give the same plans)."""
        c = self.config
        per_worker = self._observe(window)
        horizon = window.end + c.startup + c.interval
        # Not below the windows' mean: a trend pointing down waits for the load to fall.
        projected = max(self._mean_rate(), self._trend_at(horizon))
        # What waits now must be served over the same horizon, on top of what arrives.
        projected += fleet.waiting / (c.startup + c.interval)
        planned = c.headroom * per_worker
        needed = self._workers_for(projected, planned)
        wanted = min(max(needed, c.min_workers), c.max_workers)
        enough = min(max(self._workers_for(projected, c.low_water * planned), c.min_workers),
                     c.max_workers)  # fmt: skip
        crowded = self._workers_for(projected, c.high_water * per_worker) > self.target
        rise = wanted if crowded and wanted > self.target else None
        reason = self._move(rise, enough >= self.target, enough, window.end)
        return Plan(self.target, reason, projected, per_worker, needed)

    def _move(self, rise: int | None, holds: bool, floor: int, now: float) -> str:
        """The hysteresis every planner shares: up to `rise` at once (None: no rise called
        for); held while `holds`; else down toward `floor`, at most `step_down` at a time, each
        step after a cool-down of its own. Returns the decision's reason."""
        if rise is not None:
            self._low_since = None
            self.target = rise
            return "up"
        if holds:
            self._low_since = None
            return "hold"
        if self._low_since is None:
            self._low_since = now
            return "hold: cooling down"
        if now - self._low_since >= self.config.hold:
            step = self.config.step_down
            self.target = floor if step is None else max(floor, self.target - step)
            self._low_since = now  # the next step down waits a cool-down of its own
            return "down"
        return "hold: cooling down"

    def _observe(self, window: Window) -> float:
        """Keeps `window`; one worker's rate for the mix of the windows kept (the last mix seen
        while nothing arrives)."""
        self._windows.append(window)
        arrivals = sum(w.arrivals for w in self._windows)
        if arrivals:
            prompt = sum(w.prompt_tokens for w in self._windows)
            cached = sum(min(w.cached_tokens, w.prompt_tokens) for w in self._windows)
            output = sum(w.output_tokens for w in self._windows)
            self._mix = (prompt / arrivals, output / arrivals, cached / prompt if prompt else 0.0)
        return self.worker_rate(*self._mix)

    def _mean_rate(self) -> float:
        """Arrivals per second over the windows kept."""
        windows = self._windows
        if not windows:
            return 0.0
        span = windows[-1].end - windows[0].start
        return sum(w.arrivals for w in windows) / span if span > 0 else windows[-1].rate

    def _workers_for(self, rate: float, per_worker: float) -> int:
        if rate <= 0:
            return 0
        return math.ceil(rate / per_worker) if per_worker > 0 else self.config.max_workers

    def worker_rate(self, prompt: float, output: float, hit_rate: float) -> float:
        """Requests per second one worker sustains for this mix within the TPOT target: the
        largest batch (that fits the KV cache) whose decode step, stretched by the prefills
        running beside it, keeps the target; each request costs its prefill and its output
        decoded in steps shared by the batch."""
        if prompt <= 0:
            return 0.0
        output = max(output, 1.0)
        cached = int(prompt * hit_rate)
        prefill = self.cost.prefill_time(max(int(prompt) - cached, 1), cached)
        fits = int(self.cost.kv_capacity_tokens // (prompt + output)) or 1
        best = 0.0
        for batch in range(1, min(self.max_num_seqs, fits) + 1):
            step = self.cost.decode_time(batch, int(batch * (prompt + output / 2)))
            rate = 1.0 / (prefill + output * step / batch)
            # Prefills share the steps (chunked): a sequence's token waits for them too.
            if batch > 1 and step / max(1.0 - rate * prefill, 1e-9) > self.config.tpot:
                break
            best = rate
        return best

    def _trend_at(self, t: float) -> float:
        """The arrival rate at `t` on the Theil-Sen line through the windows' rates (0 if it
        points below; the last rate with fewer than two windows). A step from quiet to busy
        in the last window moves a least-squares line's slope by the whole step over the span;
        the median slope waits until the step has held for half the windows."""
        windows = self._windows
        if len(windows) < 2:
            return windows[-1].rate if windows else 0.0
        xs = [(w.start + w.end) / 2 for w in windows]
        ys = [w.rate for w in windows]
        slopes = [
            (ys[j] - ys[i]) / (xs[j] - xs[i])
            for i in range(len(xs))
            for j in range(i + 1, len(xs))
            if xs[j] > xs[i]
        ]
        slope = statistics.median(slopes) if slopes else 0.0
        intercept = statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))
        return max(0.0, intercept + slope * t)


class ReactivePlanner(Planner):
    """A utilization-threshold autoscaler, as Kubernetes' HPA and Knative's KPA: no look-ahead.
    Utilization is the last window's load (its rate, and what waits served over a start-up and
    an interval) over what the committed workers (serving and starting) sustain. Above `high`
    the target jumps to the fleet that puts it back at `headroom`; below `low` held for the
    cool-down, it steps down towards that fleet by at most `step_down`."""

    def __init__(
        self,
        config: PlannerConfig,
        cost: CostModel,
        max_num_seqs: int = 256,
        high: float = 0.9,
        low: float = 0.6,
    ) -> None:
        if not 0 < low < config.headroom < high:
            raise ValueError(f"thresholds: need 0 < low < headroom < high, got {low}, {high}")
        super().__init__(config, cost, max_num_seqs)
        self.high, self.low = high, low

    def decide(self, window: Window, fleet: Fleet) -> Plan:
        c = self.config
        per_worker = self._observe(window)
        load = window.rate + fleet.waiting / (c.startup + c.interval)
        committed = max(fleet.serving + fleet.starting, 1)
        utilization = load / (committed * per_worker) if per_worker > 0 else math.inf
        needed = self._workers_for(load, c.headroom * per_worker)
        wanted = min(max(needed, c.min_workers), c.max_workers)
        rise = wanted if utilization > self.high and wanted > self.target else None
        holds = utilization >= self.low or wanted >= self.target
        reason = self._move(rise, holds, wanted, window.end)
        return Plan(self.target, reason, load, per_worker, needed)
