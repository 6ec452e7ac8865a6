"""Latency targets: each request's predicted time to first token, routing by it, admission.

A request waits behind the prompt tokens its worker has yet to prefill in its own priority band
and the ones above (the queue is many prompts, so their attention pairs are summed per prompt),
then computes its own missed prefix; chunked into steps of the engine's token budget that also
advance the running decodes, and priced by the same step-cost model the simulator runs on:

    TTFT(w) = steps x step_time(shape) + request overhead [+ half a decode step in progress]

A class with a TTFT target is routed among the workers predicted to meet it (`latency_routing`),
in the global policy's own preference; with `admission` on, a request no worker is predicted to
serve in time is refused (Refused: unmeetable), and one waiting past its class's queue limit is
taken back (queue_time).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from router.classes import UNMEETABLE, ClassTable, Refused, TrafficClass
from router.config import RouterConfig
from router.cost_model import StepShape, prefill_pairs
from router.flight import Flight
from router.policy import Decision
from router.prefix_index import WorkerId
from router.request import Request
from router.view import ClusterView, CostEstimates, WorkerState

RouteAmong = Callable[[Request, ClusterView], Decision]


class LatencyTargets:
    def __init__(self, view: ClusterView, config: RouterConfig) -> None:
        self.view = view
        self.classes = config.classes if config.classes is not None else ClassTable()
        self.latency_routing = config.latency_routing
        self.admission = config.admission
        self.step_tokens = config.step_tokens
        self._request_overhead = float(getattr(config.cost, "request_overhead", 0.0))
        # Per worker, by priority: (prompt tokens to prefill before the first token of what it
        # was sent, their attention pairs).
        self._ahead: dict[WorkerId, dict[int, tuple[int, float]]] = {}
        self.refusals: Counter[tuple[str, str]] = Counter()  # (class, reason)

    def add_worker(self, wid: WorkerId) -> None:
        self._ahead[wid] = {}

    def remove_worker(self, wid: WorkerId) -> None:
        self._ahead.pop(wid, None)

    def route(
        self, request: Request, candidates: ClusterView, decision: Decision, route: RouteAmong
    ) -> tuple[Decision, float | None]:
        """The policy's `decision` kept, or made again (`route`) among the candidates predicted
        to meet `request`'s TTFT target; with the TTFT predicted on the worker chosen (None for
        a class without a target). Raises Refused when admission control finds none in time."""
        traffic = self.classes.of_request(request)
        target = traffic.ttft
        if target is None:
            return decision, None
        ttft = self._predict_on(request, candidates, decision.worker)
        if ttft <= target:
            return decision, ttft
        # The policy's choice would miss: it chooses again among those that would not (its
        # preference among them). (A policy keeping a turn, round robin, moves on twice.)
        predicted = self._predict_all(request, candidates)
        meeting = self._meeting_target(request, traffic, candidates, predicted)
        if meeting is not candidates:
            decision = route(request, meeting)
        return decision, predicted.get(decision.worker)

    def queued(self, flight: Flight, state: WorkerState, hit_blocks: int) -> None:
        """`flight` is routed to `state`'s worker expecting `hit_blocks` cached: its predicted
        TTFT (if not predicted already), and its missed prompt now ahead of later requests."""
        request = flight.request
        if flight.predicted_ttft is None:
            flight.predicted_ttft = self._predict(request, state, hit_blocks)
        cached = hit_blocks * self.view.block_size
        new = flight.prefill = request.prompt_len - cached
        flight.prefill_pairs = prefill_pairs(new, cached)
        ahead = self._ahead[flight.worker]
        tokens, pairs = ahead.get(request.priority, (0, 0.0))
        ahead[request.priority] = (tokens + new, pairs + flight.prefill_pairs)

    def prefilled(self, flight: Flight) -> None:
        """Its prompt is no longer ahead of anyone on its worker."""
        if flight.prefill:
            ahead = self._ahead.get(flight.worker)
            if ahead is not None:
                tokens, pairs = ahead[flight.request.priority]
                ahead[flight.request.priority] = (
                    tokens - flight.prefill,
                    pairs - flight.prefill_pairs,
                )
            flight.prefill, flight.prefill_pairs = 0, 0.0

    def predict(self, request: Request, wid: WorkerId) -> float | None:
        """Seconds until `request` would have its first token on `wid` if sent there now.
        None without a cost model or for an unknown worker."""
        if wid not in self.view.workers or self.view.cost is None:
            return None
        return self._predict_on(request, self.view, wid)

    def queue_limit(self, request: Request) -> float | None:
        """How long `request` may wait in a queue before admission control refuses it."""
        if not self.admission:
            return None
        return self.classes.of_request(request).max_queue_time

    def refused(self, request: Request, reason: str) -> None:
        self.refusals[(self.classes.of_request(request).name, reason)] += 1

    def _predict_on(self, request: Request, view: ClusterView, wid: WorkerId) -> float:
        hit = view.index.match_of(request.block_hashes, wid)
        cap = request.reusable_blocks(view.block_size)
        return self._predict(request, view.workers[wid], min(hit, cap))

    def _predict(self, request: Request, state: WorkerState, hit_blocks: int) -> float:
        cost: CostEstimates | None = self.view.cost
        assert cost is not None, "a TTFT is predicted only with a step-cost model"
        cached = hit_blocks * self.view.block_size
        own = request.prompt_len - cached
        new, pairs = own, prefill_pairs(own, cached)
        for priority, (tokens, their_pairs) in self._ahead[state.id].items():
            if priority <= request.priority:
                new += tokens
                pairs += their_pairs
        # Chunked into steps of the engine's token budget, each also decoding what runs there
        # (a decoding sequence takes a token of each step's budget first).
        running = state.num_running
        steps = -(-new // max(self.step_tokens - running, self.step_tokens // 4))
        context = state.kv_used_blocks * self.view.block_size if running else 0
        step = StepShape(
            -(-new // steps) + running,
            pairs / steps + context,
            -(-(cached + new) // steps) + context,
            running,
        )
        seconds = steps * cost.step_time(step) + self._request_overhead
        if running:  # it joins at the end of the step in progress, half of one on average
            seconds += 0.5 * cost.decode_time(running, context)
        return seconds

    def _predict_all(self, request: Request, view: ClusterView) -> dict[WorkerId, float]:
        """Predicted TTFT on each healthy worker of `view`, from one walk of the index."""
        cap = request.reusable_blocks(view.block_size)
        hits = view.index.match(request.block_hashes[:cap])
        return {
            w.id: self._predict(request, w, hits.get(w.id, 0))
            for w in view.workers.values()
            if w.healthy
        }

    def _meeting_target(
        self,
        request: Request,
        traffic: TrafficClass,
        view: ClusterView,
        predicted: dict[WorkerId, float],
    ) -> ClusterView:
        """The workers of `view` predicted to meet the class's TTFT target (routing by
        latency), or the best predicted if none does; admission control refuses then."""
        target = traffic.ttft
        assert target is not None
        meeting = [wid for wid, t in predicted.items() if t <= target]
        if not meeting:
            best = min(predicted, key=lambda wid: (predicted[wid], wid))
            if self.admission:
                self.refusals[(traffic.name, UNMEETABLE)] += 1
                excess = predicted[best] - target
                raise Refused(
                    UNMEETABLE,
                    f"no worker can start this {traffic.name} request within its "
                    f"{target:g} s target (best predicted {predicted[best]:.3g} s)",
                    retry_after=max(1.0, excess),
                )
            meeting = [best]
        if not self.latency_routing or len(meeting) == len(view.workers):
            return view
        return view.among({wid: view.workers[wid] for wid in meeting})
