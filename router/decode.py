"""Where a split request decodes: the second of its two routing decisions.

A split request's prefill worker is the global policy's choice (prefix locality and fairness
live there); once its prompt is computed, its KV goes to a decode worker chosen here. What
matters on the decode side is different: a decode server's step time grows with the sequences
it batches and their context, and it must have room for the prompt's KV plus the output. So:

  1. the decode worker holding the longest part of the prompt already (a multi-turn session's
     earlier turns: vLLM's connectors move only the blocks the decode server lacks), unless it
     runs more than `slack` sequences beyond the least busy one;
  2. else the one with the fewest sequences outstanding, then the least KV in use.

DistServe and Splitwise place decode by load alone; Mooncake's Conductor also weighs the
decode-side cache. Neither says how a fairness policy's service is counted across the two
stages. The papers define a policy's service on one server; across two stages the router core
counts the whole of a request on the worker its policy chose: input at admission there, output
as it is decoded elsewhere, and every hook names that prefill worker. So VTC's client counters
mean what they mean on a mixed fleet, and D²LPM's (client, worker) deficits are the prefill
worker's, the choice they steer. The prefill worker's queue discipline orders by the same
service: it charges the prompt at admission and keeps the request's account open after the
handoff, charged the output as it is decoded (DispatchQueue.handed_off). A decode worker's
discipline orders its own queue by its own definition of the request, whose prompt is cached
there (its KV arrived): DLPM, charging extend tokens, charges it the output; VTC, whose service
is prompt and output, charges both, as that batch holds and reads the prompt.
"""

from __future__ import annotations

from router.prefix_index import WorkerId
from router.request import Request
from router.view import ClusterView, WorkerState

DEFAULT_SLACK = 4  # sequences: about what a batch absorbs without a visible step-time change


def decode_load(view: ClusterView, w: WorkerState) -> tuple[int, float, WorkerId]:
    """Sequences outstanding (the batch it will step), then KV in use: least first."""
    return (w.num_outstanding, w.kv_usage, w.id)


def choose_decode(request: Request, view: ClusterView, slack: int = DEFAULT_SLACK) -> WorkerId:
    """The decode worker of `view` (healthy ones only; at least one) for `request`."""
    least = view.least(decode_load)
    cap = request.reusable_blocks(view.block_size)
    healthy = view.healthy_set()
    held = {w: m for w, m in view.index.match(request.block_hashes[:cap]).items() if w in healthy}
    if held:
        workers = view.workers
        best = max(held, key=lambda w: (held[w], -workers[w].num_outstanding, -w))
        if workers[best].num_outstanding <= least.num_outstanding + slack:
            return best
    return least.id
