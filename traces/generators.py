"""Synthetic workloads with real prefix structure (the public traces lack tenants + content).

Prompts are built as token-id sequences and hashed like live prompts, so shared prefixes come
from shared content, never from hand-placed hashes:

    shared_prefix   tenants, each with a long system prompt/document and many questions
    lora_tenants    many tenants, each with its own LoRA adapter and system prompt, Zipf popularity
    few_shot        a pool of few-shot templates shared across tenants, then a question
    chat_sessions   multi-turn chats: turn k = turn k-1's prompt + its answer + a new message
    agent_loops     tool loops: a long tool preamble, then call, tool output, call, ...
    agent_sessions  coding agents: a preamble per tenant, contexts growing to tens of thousands
                    of tokens, tenants of unequal demand, each session on one client API
    flood           one client floods over a long shared prefix next to calm clients
    priority_mix    interactive tenants at a steady rate beside batch tenants (two priorities)

Sessions (chat, agents) carry `think_time`, so they also replay closed-loop. Every generator
takes `seed` and draws from its own streams.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np

from router.request import (
    APIS,
    BlockHash,
    Request,
    cache_root,
    extend_chain,
    hash_token_blocks,
)
from traces.schema import DEFAULT_BLOCK_SIZE, Trace, finish, renumber

VOCAB = 32000


class _Tokens:
    """Random token content from one seeded stream."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def take(self, n: int) -> np.ndarray:
        return self._rng.integers(0, VOCAB, size=n, dtype=np.uint32)


def _lognormal_int(rng: random.Random, mean: float, sigma: float = 0.5, lo: int = 1) -> int:
    mu = np.log(mean) - sigma**2 / 2
    return max(lo, int(rng.lognormvariate(mu, sigma)))


def _poisson_times(rng: random.Random, rate: float, n: int) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


class _Shared:
    """Tokens many prompts start with (a document, a template), their full blocks hashed once
    per cache identity: a prompt that starts with them hashes only what follows, continuing
    the chain from their last full block, the same hashes as the whole prompt's."""

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size
        self._heads: dict[BlockHash | None, list[BlockHash]] = {}

    def hash_prompt(self, prompt: np.ndarray, root: BlockHash | None) -> list[BlockHash]:
        """`hash_token_blocks(prompt, block_size, root)` for a prompt that starts with these
        tokens."""
        head = self._heads.get(root)
        if head is None:
            head = self._heads[root] = hash_token_blocks(self.tokens, self.block_size, root)
        return extend_chain(head, prompt, self.block_size, root)


def _request(
    i: int,
    t: float,
    prompt: np.ndarray,
    out_len: int,
    block_size: int,
    shared: _Shared | None = None,
    **kw: object,
) -> Request:
    """A request for `prompt` (which starts with `shared`'s tokens, if given), its blocks
    hashed under the cache identity `kw` gives it (a model, adapter or cache_salt), as a live
    prompt is."""
    root = cache_root(kw.get("model"), kw.get("adapter"), kw.get("cache_salt"))  # type: ignore[arg-type]
    return Request(
        id=i,
        arrival=t,
        prompt_len=len(prompt),
        output_len=out_len,
        block_hashes=(
            hash_token_blocks(prompt, block_size, parent=root)
            if shared is None
            else shared.hash_prompt(prompt, root)
        ),
        **kw,  # type: ignore[arg-type]
    )


def shared_prefix(
    num_requests: int = 2000,
    num_tenants: int = 8,
    prefix_tokens: int = 4000,
    question_tokens: int = 200,
    output_tokens: int = 128,
    rate: float = 20.0,
    prefixes_per_tenant: int = 2,
    tenant_skew: float = 0.0,
    adapters: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> Trace:
    """Tenants with long shared system prompts / documents, many questions each, Poisson.

    Tenant k sends a share of the requests in proportion to 1/(k+1)^tenant_skew: 0 (the
    default) gives every tenant the same demand; 1 gives tenant-0 twice tenant-1's demand and
    three times tenant-2's, down a Zipf tail. `adapters`: tenant k's requests run under its own
    LoRA adapter `lora-k`, so its prompts hit only its own blocks."""
    rng, tokens = random.Random(seed), _Tokens(seed)
    prefixes = {
        (t, p): _Shared(
            tokens.take(_lognormal_int(rng, prefix_tokens, 0.3, block_size)), block_size
        )
        for t in range(num_tenants)
        for p in range(prefixes_per_tenant)
    }
    shares = [1 / (k + 1) ** tenant_skew for k in range(num_tenants)]
    reqs = []
    for i, t in enumerate(_poisson_times(rng, rate, num_requests)):
        # Equal shares draw with randrange, so a seed gives the same trace with or without skew 0.
        tenant = (
            rng.choices(range(num_tenants), shares)[0]
            if tenant_skew
            else rng.randrange(num_tenants)
        )
        prefix = prefixes[(tenant, rng.randrange(prefixes_per_tenant))]
        prompt = np.concatenate([prefix.tokens, tokens.take(_lognormal_int(rng, question_tokens))])
        out = _lognormal_int(rng, output_tokens)
        adapter = f"lora-{tenant}" if adapters else None
        client = f"tenant-{tenant}"
        reqs.append(_request(i, t, prompt, out, block_size, prefix, client=client, adapter=adapter))
    return finish(Trace(reqs, block_size, source="generated:shared_prefix"))


def lora_tenants(
    num_requests: int = 3000,
    num_tenants: int = 48,
    zipf: float = 1.0,
    system_tokens: int = 2000,
    question_tokens: int = 200,
    output_tokens: int = 128,
    rate: float = 20.0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> Trace:
    """Many tenants, each with its own LoRA adapter (`lora-k`) and system prompt, tenant k's
    share of the requests in proportion to 1/(k+1)^zipf; Poisson arrivals. A tenant's system
    prompt is cached only under its adapter, so where its adapter is held and where its prefix
    is cached are the same workers when routing keeps them together."""
    trace = shared_prefix(
        num_requests=num_requests,
        num_tenants=num_tenants,
        prefix_tokens=system_tokens,
        question_tokens=question_tokens,
        output_tokens=output_tokens,
        rate=rate,
        prefixes_per_tenant=1,
        tenant_skew=zipf,
        adapters=True,
        block_size=block_size,
        seed=seed,
    )
    trace.source = "generated:lora_tenants"
    return trace


def few_shot(
    num_requests: int = 2000,
    num_tenants: int = 4,
    num_templates: int = 16,
    template_tokens: int = 1500,
    question_tokens: int = 100,
    output_tokens: int = 64,
    rate: float = 20.0,
    zipf: float = 1.1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> Trace:
    """Few-shot templates shared across tenants, popularity Zipf-distributed."""
    rng, tokens = random.Random(seed), _Tokens(seed)
    templates = [
        _Shared(tokens.take(_lognormal_int(rng, template_tokens, 0.3)), block_size)
        for _ in range(num_templates)
    ]
    weights = [1 / (k + 1) ** zipf for k in range(num_templates)]
    reqs = []
    for i, t in enumerate(_poisson_times(rng, rate, num_requests)):
        template = rng.choices(templates, weights)[0]
        prompt = np.concatenate(
            [template.tokens, tokens.take(_lognormal_int(rng, question_tokens))]
        )
        client = f"tenant-{rng.randrange(num_tenants)}"
        out = _lognormal_int(rng, output_tokens)
        reqs.append(_request(i, t, prompt, out, block_size, template, client=client))
    return finish(Trace(reqs, block_size, source="generated:few_shot"))


def _sessions(
    num_sessions: int,
    rate: float,
    seed: int,
    block_size: int,
    source: str,
    num_tenants: int,
    first_prompt: Callable[[random.Random, _Tokens, int], np.ndarray],
    turns: Callable[[random.Random], int],
    message: Callable[[random.Random], int],
    output_tokens: float,
    think: Callable[[random.Random], float],
    tenant_weights: Sequence[float] | None = None,
    apis: Sequence[str] = (),
) -> Trace:
    """Sessions whose every turn's prompt extends the previous prompt and answer.

    A session's tenant is drawn uniformly, or in proportion to `tenant_weights`; its first
    prompt is `first_prompt(rng, tokens, tenant)`, and each later turn adds the answer and a
    message of `message(rng)` tokens. With `apis`, each session is sent through one of them."""
    rng, tokens = random.Random(seed), _Tokens(seed)
    reqs: list[Request] = []
    for s, start in enumerate(_poisson_times(rng, rate, num_sessions)):
        tenant = (
            rng.choices(range(num_tenants), tenant_weights)[0]
            if tenant_weights is not None
            else rng.randrange(num_tenants)
        )
        client = f"tenant-{tenant}"
        api = rng.choice(apis) if apis else None
        prompt = first_prompt(rng, tokens, tenant)
        hashes: list[int] = []  # the prompt's full blocks hashed so far: later turns extend them
        t = start
        for turn in range(turns(rng)):
            out = _lognormal_int(rng, output_tokens)
            wait = think(rng) if turn else None
            hashes = extend_chain(hashes, prompt, block_size)
            reqs.append(
                Request(
                    id=0,
                    arrival=t,
                    prompt_len=len(prompt),
                    output_len=out,
                    block_hashes=hashes,  # a new list each turn: extend_chain copies
                    client=client,
                    session=f"s{s}",
                    think_time=wait,
                    api=api,
                )
            )
            answer = tokens.take(out)
            prompt = np.concatenate([prompt, answer, tokens.take(message(rng))])
            # Open-loop timestamp of the next turn: a guess at the answer time plus think time;
            # closed-loop replay uses the real finish instead.
            t += 0.02 * out + think(rng)
    reqs.sort(key=lambda r: r.arrival)
    return finish(Trace(renumber(reqs), block_size, source=f"generated:{source}"))


def chat_sessions(
    num_sessions: int = 300,
    mean_turns: float = 5,
    system_tokens: int = 500,
    user_tokens: int = 150,
    output_tokens: int = 200,
    think_time: float = 10.0,
    rate: float = 2.0,
    num_tenants: int = 4,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> Trace:
    """Multi-turn chats; the system prompt is shared by all sessions of a tenant... and by none
    across tenants, so chat turns reuse their own history above all."""
    shared = {k: _Tokens(seed + 1 + k).take(system_tokens) for k in range(num_tenants)}

    def first(rng: random.Random, tokens: _Tokens, tenant: int) -> np.ndarray:
        system = shared[rng.randrange(num_tenants)]
        return np.concatenate([system, tokens.take(_lognormal_int(rng, user_tokens))])

    return _sessions(
        num_sessions,
        rate,
        seed,
        block_size,
        "chat_sessions",
        num_tenants,
        first,
        turns=lambda rng: 1 + int(rng.expovariate(1 / max(mean_turns - 1, 1e-9))),
        message=lambda rng: _lognormal_int(rng, user_tokens),
        output_tokens=output_tokens,
        think=lambda rng: rng.expovariate(1 / think_time) if think_time > 0 else 0.0,
    )


def agent_loops(
    num_sessions: int = 100,
    steps: int = 12,
    preamble_tokens: int = 3000,
    tool_output_tokens: int = 400,
    call_tokens: int = 60,
    tool_latency: float = 1.0,
    rate: float = 1.0,
    num_tenants: int = 4,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> Trace:
    """Agent/tool loops: short calls on a long, growing context; tools answer after a delay."""
    preamble = _Tokens(seed + 7).take(preamble_tokens)  # one tool spec shared by every agent

    def first(rng: random.Random, tokens: _Tokens, tenant: int) -> np.ndarray:
        return np.concatenate([preamble, tokens.take(_lognormal_int(rng, 200))])

    return _sessions(
        num_sessions,
        rate,
        seed,
        block_size,
        "agent_loops",
        num_tenants,
        first,
        turns=lambda rng: max(1, int(rng.gauss(steps, steps / 4))),
        message=lambda rng: _lognormal_int(rng, tool_output_tokens),
        output_tokens=call_tokens,
        think=lambda rng: rng.expovariate(1 / tool_latency),
    )


def agent_sessions(
    num_sessions: int = 200,
    num_tenants: int = 8,
    tenant_skew: float = 1.0,
    preamble_tokens: int = 6000,
    task_tokens: int = 400,
    mean_turns: float = 16,
    tool_tokens: int = 1200,
    tool_tokens_min: int = 200,
    tool_tokens_max: int = 6000,
    output_tokens: int = 150,
    tool_time: float = 2.0,
    rate: float = 1.0,
    apis: str = "responses,messages",
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> Trace:
    """Coding agents and tool-calling assistants: closed-loop sessions on contexts that grow to
    tens of thousands of tokens.

    Each tenant has its own preamble (system prompt and tool specs, ~`preamble_tokens`) that
    all its sessions start with, then the session's task. Every later turn's prompt is the
    previous prompt, the model's answer (a tool call) and the tool's result: lognormal around
    `tool_tokens`, clipped to [`tool_tokens_min`, `tool_tokens_max`]. The next turn is sent
    `tool_time` (exponential mean) after the answer. Sessions start as a Poisson process at
    `rate`; tenant k starts a share in proportion to 1/(k+1)^tenant_skew. A session speaks one
    client API throughout, drawn from the comma-separated `apis`."""
    names = tuple(a.strip() for a in apis.split(",") if a.strip())
    unknown = [a for a in names if a not in APIS]
    if not names or unknown:
        raise ValueError(f"apis: a comma-separated list of {', '.join(APIS)}, got {apis!r}")
    if not 0 < tool_tokens_min <= tool_tokens_max:
        raise ValueError(
            f"tool_tokens_min, tool_tokens_max: 0 < min <= max, got {tool_tokens_min}, "
            f"{tool_tokens_max}"
        )
    preambles: dict[int, np.ndarray] = {}

    def first(rng: random.Random, tokens: _Tokens, tenant: int) -> np.ndarray:
        if tenant not in preambles:  # drawn when the tenant first appears: one stream
            preambles[tenant] = tokens.take(_lognormal_int(rng, preamble_tokens, 0.2, block_size))
        return np.concatenate([preambles[tenant], tokens.take(_lognormal_int(rng, task_tokens))])

    def tool_result(rng: random.Random) -> int:
        return min(_lognormal_int(rng, tool_tokens, 0.8, tool_tokens_min), tool_tokens_max)

    return _sessions(
        num_sessions,
        rate,
        seed,
        block_size,
        "agent_sessions",
        num_tenants,
        first,
        turns=lambda rng: _lognormal_int(rng, mean_turns, 0.4, 2),
        message=tool_result,
        output_tokens=output_tokens,
        think=lambda rng: rng.expovariate(1 / tool_time) if tool_time > 0 else 0.0,
        tenant_weights=[1 / (k + 1) ** tenant_skew for k in range(num_tenants)],
        apis=names,
    )


def flood(
    duration: float = 120.0,
    flood_rate: float = 20.0,
    flood_prefix_tokens: int = 4000,
    num_calm: int = 4,
    calm_rate: float = 1.0,
    calm_prefix_tokens: int = 1000,
    question_tokens: int = 100,
    output_tokens: int = 128,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> Trace:
    """One client floods with requests sharing a long prefix; several calm clients ask at a
    modest rate, each over its own shorter shared prompt. All Poisson."""
    rng, tokens = random.Random(seed), _Tokens(seed)
    clients = [("flood", flood_rate, tokens.take(flood_prefix_tokens))]
    clients += [(f"calm-{k}", calm_rate, tokens.take(calm_prefix_tokens)) for k in range(num_calm)]
    reqs = []
    for client, rate, prefix in clients:
        t = rng.expovariate(rate)
        while t < duration:
            prompt = np.concatenate([prefix, tokens.take(_lognormal_int(rng, question_tokens))])
            reqs.append(
                _request(
                    0, t, prompt, _lognormal_int(rng, output_tokens), block_size, client=client
                )
            )
            t += rng.expovariate(rate)
    reqs.sort(key=lambda r: r.arrival)
    return finish(Trace(renumber(reqs), block_size, source="generated:flood"))


def late_joiner(
    duration: float = 120.0,
    rate: float = 18.0,
    late_rate: float = 6.0,
    late_start: float = 60.0,
    prompt_tokens: int = 512,
    output_tokens: int = 256,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> Trace:
    """A heavy client, `steady`, that overloads a worker alone, and a light one, `late`, that
    asks for less than half the worker but only from `late_start` (the VTC paper's cases: a
    light client behind a heavy one, and an idle client that returns). FCFS makes the light
    client wait behind the heavy one's backlog; a scheduler that banks the idle client's credit
    (least counter first without VTC's lift) hands it everything until it has caught up.
    Distinct prompts: no prefix sharing."""
    rng, tokens = random.Random(seed), _Tokens(seed)
    reqs = []
    for client, r, start in (("steady", rate, 0.0), ("late", late_rate, late_start)):
        t = start + rng.expovariate(r)
        while t < duration:
            prompt = tokens.take(_lognormal_int(rng, prompt_tokens, 0.3, block_size))
            out = _lognormal_int(rng, output_tokens, 0.3)
            reqs.append(_request(0, t, prompt, out, block_size, client=client))
            t += rng.expovariate(r)
    reqs.sort(key=lambda r: r.arrival)
    return finish(Trace(renumber(reqs), block_size, source="generated:late_joiner"))


def priority_mix(
    duration: float = 120.0,
    interactive_rate: float = 4.0,
    batch_rate: float = 8.0,
    num_interactive: int = 4,
    num_batch: int = 2,
    system_tokens: int = 1000,
    question_tokens: int = 100,
    interactive_output: int = 128,
    document_tokens: int = 2000,
    batch_output: int = 256,
    interactive_priority: int = 0,
    batch_priority: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> Trace:
    """Two traffic classes. Interactive tenants (`chat-k`) ask short questions over their own
    system prompt at `interactive_rate` in all; batch tenants (`batch-k`) send long distinct
    documents at `batch_rate` in all, at a lower priority (a larger value). Poisson arrivals."""
    rng, tokens = random.Random(seed), _Tokens(seed)
    systems = [tokens.take(system_tokens) for _ in range(num_interactive)]
    reqs = []
    t = rng.expovariate(interactive_rate) if interactive_rate > 0 else duration
    while t < duration:
        k = rng.randrange(num_interactive)
        prompt = np.concatenate([systems[k], tokens.take(_lognormal_int(rng, question_tokens))])
        out = _lognormal_int(rng, interactive_output)
        reqs.append(
            _request(
                0, t, prompt, out, block_size, client=f"chat-{k}", priority=interactive_priority
            )  # fmt: skip
        )
        t += rng.expovariate(interactive_rate)
    t = rng.expovariate(batch_rate) if batch_rate > 0 else duration
    while t < duration:
        prompt = tokens.take(_lognormal_int(rng, document_tokens, 0.3, block_size))
        out = _lognormal_int(rng, batch_output, 0.3)
        client = f"batch-{rng.randrange(num_batch)}"
        reqs.append(_request(0, t, prompt, out, block_size, client=client, priority=batch_priority))
        t += rng.expovariate(batch_rate)
    reqs.sort(key=lambda r: r.arrival)
    return finish(Trace(renumber(reqs), block_size, source="generated:priority_mix"))


GENERATORS: dict[str, Callable[..., Trace]] = {
    "priority_mix": priority_mix,
    "late_joiner": late_joiner,
    "flood": flood,
    "shared_prefix": shared_prefix,
    "lora_tenants": lora_tenants,
    "few_shot": few_shot,
    "chat_sessions": chat_sessions,
    "agent_loops": agent_loops,
    "agent_sessions": agent_sessions,
}
