"""Traffic classes at the proxy: the answers admission control gives, the priority a worker is
sent, and each answered request scored against its class's targets.

    route ──▶ Refused (unmeetable) ─────────────────────────▶ 503, Retry-After
      │
    queue ──▶ waited min(class's max_queue_time, timeouts.queue):
      │         still queued: withdrawn (Router.time_out) ..... 503 `queue_time`, Retry-After
      │         released meanwhile: it goes on
    send ───▶ body `priority` = the request's band, to a worker that runs vLLM's priority
      │       scheduling; stripped for one that does not (and X-Vllm-Priority never passes)
    answer ─▶ fairway_class_requests_total{class, outcome=met|missed}; for a stream with a
              prediction, the TTFT predicted against the TTFT measured

The classes, their bands and the predictions are the router core's (router/classes.py,
router/core.py); this module only turns them into HTTP and metrics.
"""

from __future__ import annotations

import math

from router.classes import QUEUE_TIME, Refused, TrafficClass
from router.proxy.errors import APIError
from router.proxy.metrics import RouterMetrics

# vLLM 0.32 takes a request's priority from this header before the body's field: a client's
# own must never reach a worker, or it would choose its band there.
VLLM_PRIORITY_HEADER = "x-vllm-priority"


def refused(e: Refused) -> APIError:
    """Admission control's refusal at routing: 503, `code` the reason, with Retry-After."""
    return _unavailable(str(e), e.reason, e.retry_after)


def queue_time_refused(traffic: TrafficClass, waited: float) -> APIError:
    """Refused after waiting its class's queue limit without starting. Retry-After: as long
    again (the queue did not move in that time)."""
    message = (
        f"this {traffic.name} request waited {waited:g} s in the router queue without "
        "starting, its class's limit"
    )
    return _unavailable(message, QUEUE_TIME, waited)


def _unavailable(message: str, code: str, retry_after: float) -> APIError:
    error = APIError(503, message, "service_unavailable", code=code)
    error.headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return error


def upstream_body(body: dict, priority: int, priority_scheduling: bool) -> dict:
    """The body a worker is sent: with the request's own priority where the worker orders by
    it (vLLM's --scheduling-policy priority); without any where it does not (under fcfs a
    client's value means nothing, and vLLM's docs say a non-zero one may be refused)."""
    if priority_scheduling:
        if priority == 0 and "priority" not in body:
            return body
        return {**body, "priority": priority}
    if "priority" in body:
        return {k: v for k, v in body.items() if k != "priority"}
    return body


def score(
    metrics: RouterMetrics,
    label: str,
    traffic: TrafficClass,
    ttft: float,
    tpot: float | None,
    predicted_ttft: float | None,
) -> None:
    """An answered request against its class: `ttft` from its arrival to the client's first
    byte (a whole answer, when not streamed), `tpot` between a stream's first and last tokens
    (None: not a stream, or one token); `predicted_ttft` is compared only for streams, where
    the first byte is the first token."""
    outcome = "met" if traffic.meets(ttft, tpot) else "missed"
    metrics.class_requests.labels(label, outcome).inc()
    if predicted_ttft is None:
        return
    metrics.ttft_predicted.labels(label).inc(predicted_ttft)
    metrics.ttft_observed.labels(label).inc(ttft)
    metrics.ttft_prediction_error.labels(label).observe(abs(predicted_ttft - ttft))
