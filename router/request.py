"""The request every layer shares, and vLLM-style chained block hashing of prompts.

A prompt is seen by the router as a chain of block hashes: block i covers tokens
[i * block_size, (i + 1) * block_size) and its hash folds in the hash of block i - 1, so two
prompts share hash i exactly when they share their first (i + 1) * block_size tokens. Only full
blocks are hashed; the tail of a prompt shorter than a block is never cached or indexed.

A block's identity is more than its tokens: vLLM keys its prefix cache by the LoRA adapter and
the request's `cache_salt` as well, so the same tokens under another adapter or salt are a miss.
The chain's first block folds in a root made of the model group (in a fleet of several), the
adapter and the salt (`cache_root`), so every later block differs too; a request with none of
them hashes exactly as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

BlockHash = int
# A trace's block hashes are 64-bit, signed or not (a simulated KV cache keeps them in 128 bits,
# room for a tiled trace's copies to offset them).
BLOCK_HASH_MIN, BLOCK_HASH_END = -(1 << 63), 1 << 64
# The client APIs a request may come through: OpenAI completions, chat completions and
# Responses, and Anthropic Messages.
Api = Literal["completions", "chat", "responses", "messages"]
APIS: tuple[str, ...] = get_args(Api)


def hash_token_blocks(
    token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None
) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` (the partial tail is dropped).

    Deterministic across processes (unlike `hash()` on tuples under PYTHONHASHSEED), so a trace
    hashed offline and a live prompt hashed by the proxy agree.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = np.asarray(token_ids, dtype="<u4").tobytes()
    step = 4 * block_size
    prev = b"" if parent is None else parent.to_bytes(8, "little")
    hashes: list[BlockHash] = []
    for start in range(0, len(data) - step + 1, step):
        prev = hashlib.blake2b(data[start : start + step], digest_size=8, key=prev).digest()
        hashes.append(int.from_bytes(prev, "little"))
    return hashes


def extend_chain(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """`hash_token_blocks(token_ids, block_size, parent)` for tokens whose first
    `len(hashes)` full blocks are already hashed as `hashes`: only the rest is hashed, the
    chain continued from the last of them (a shared document, an earlier turn)."""
    rest = token_ids[len(hashes) * block_size :]
    return hashes + hash_token_blocks(rest, block_size, hashes[-1] if hashes else parent)


def cache_root(
    model: str | None = None, adapter: str | None = None, cache_salt: str | None = None
) -> BlockHash | None:
    """The parent a prompt's chain starts from under this cache identity; None for none."""
    if model is None and adapter is None and cache_salt is None:
        return None
    name = repr((model, adapter, cache_salt)).encode()  # unambiguous, None apart from ""
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")


def rekey_blocks(hashes: Sequence[BlockHash], root: BlockHash | None) -> list[BlockHash]:
    """Hashes computed without a cache identity (a trace's ids), keyed under `root`: equal
    prefixes under the same root stay equal, and nothing matches across roots."""
    if root is None:
        return list(hashes)
    key = root.to_bytes(8, "little")
    mask = (1 << 64) - 1
    return [
        int.from_bytes(
            hashlib.blake2b((h & mask).to_bytes(8, "little"), digest_size=8, key=key).digest(),
            "little",
        )
        for h in hashes
    ]


@dataclass(slots=True)
class Request:
    """One inference request as the router and the simulator see it.

    `block_hashes` are the chained hashes of the prompt's full blocks (see module doc);
    `output_len` is the number of tokens the request will generate (known in a trace, an estimate
    live). `weight` divides the service charged to the client by fairness policies.

    `model` names the model group that must serve it (None: a fleet of one model), `adapter` the
    LoRA adapter it runs under (None: the base model); both and `cache_salt` are part of its
    blocks' identity (see `cache_root`), which `block_hashes` already carry.

    `api` is the client API that sent it (one of `APIS`; None: not known, as in a trace that does
    not say). It changes nothing about how the request is served: records and reports split by it.
    """

    id: int
    arrival: float
    prompt_len: int
    output_len: int
    block_hashes: list[BlockHash] = field(default_factory=list)
    client: str = "default"
    session: str | None = None
    priority: int = 0
    weight: float = 1.0
    # Closed-loop sessions: this turn is sent `think_time` after the previous turn of the same
    # session finishes, instead of at `arrival`.
    think_time: float | None = None
    model: str | None = None
    adapter: str | None = None
    cache_salt: str | None = None
    api: str | None = None

    def __post_init__(self) -> None:
        assert self.prompt_len > 0, f"request {self.id}: prompt_len must be positive"
        assert self.output_len > 0, f"request {self.id}: output_len must be positive"
        assert self.api is None or self.api in APIS, f"request {self.id}: unknown api {self.api!r}"

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    def prompt_blocks(self, block_size: int) -> list[BlockHash]:
        """The hashes of the prompt's full blocks: what a worker that computes it holds."""
        return self.block_hashes[: self.prompt_len // block_size]

    def reusable_blocks(self, block_size: int) -> int:
        """The most prompt blocks an engine can reuse from its cache: the last prompt token is
        always computed (its logits give the first output token), as vLLM caps a hit."""
        return (self.prompt_len - 1) // block_size
