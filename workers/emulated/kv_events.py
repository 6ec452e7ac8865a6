"""The emulated server's KV events: its engine's cache as vLLM publishes it over ZMQ
(`--kv-events`), and the tokenizer that tells the publisher each prompt's tokens. It can lose
some or all of its events on purpose (what a router's precise index must survive)."""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgpack
import zmq

from router.proxy.prompts import PromptEncoder
from router.request import BlockHash


@dataclass(slots=True)
class _Block:
    """A prompt block the publisher may have to announce: its tokens and cache identity."""

    tokens: list[int]
    lora: tuple[str, int] | None = None  # (lora_name, lora_id)
    salt: str | None = None


class KVEventPublisher:
    """The engine's cache as vLLM's KV events: a ZMQ PUB socket sending (topic, 8-byte big-endian
    sequence number, msgpack [ts, events, dp_rank]), with `BlockStored` when a prompt block is
    computed and `BlockRemoved` when it is evicted (router/kv_events.py reads them).

    As vLLM, it names blocks by a hash of its own, seeded afresh in every process (a restarted
    vLLM names the same tokens differently), and each stored block carries its tokens.
    A block of a request run under an adapter or a cache_salt names them as vLLM does: the
    event's `lora_name`/`lora_id`, and per block `extra_keys`, the adapter's name on every block
    and the salt after it on a chain's first block (None for a block with neither).
    It loses `drop_share` of its batches after the first `drop_after` (or from a `drop()` on),
    as a lossy link would: a lost batch still takes its sequence number, so a subscriber can
    see the gap.
    """

    MAX_PROMPT_BLOCKS = 1 << 14  # tokens remembered for blocks not stored yet

    def __init__(
        self, endpoint: str, block_size: int, drop_share: float = 0.0, drop_after: int = 0
    ) -> None:
        self.block_size = block_size
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._salt = random.getrandbits(64)
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()
        self._seq = itertools.count()
        self._rng = random.Random()
        self.drop_share, self.drop_after = drop_share, drop_after
        self.sent = self.dropped = 0

    def drop(self, share: float = 1.0) -> None:
        """Lose `share` of the batches from now on (0 delivers them all again)."""
        self.drop_share = share

    def learn(self, hashes: list[BlockHash], token_ids: list[int]) -> None:
        """A prompt's block hashes and tokens, for the BlockStored events its blocks cause."""
        bs = self.block_size
        for i, h in enumerate(hashes):
            self._blocks[h] = _Block(token_ids[i * bs : (i + 1) * bs])
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.MAX_PROMPT_BLOCKS:
            self._blocks.popitem(last=False)

    def identify(
        self, hashes: list[BlockHash], lora: tuple[str, int] | None, salt: str | None
    ) -> None:
        """The cache identity of a prompt just learned (the encoder sees only its hash root)."""
        for h in hashes:
            if (block := self._blocks.get(h)) is not None:
                block.lora, block.salt = lora, salt

    def close(self) -> None:
        self._pub.close()
        self._ctx.term()

    # KVEventSink
    def stored(self, parent: BlockHash | None, hashes: list[BlockHash]) -> None:
        if not hashes or any(h not in self._blocks for h in hashes):
            return  # never seen a prompt with it (cannot happen while learn() sees each one)
        blocks = [self._blocks[h] for h in hashes]
        lora, salt = blocks[0].lora, blocks[0].salt  # one chain, one identity
        name = [lora[0]] if lora else []
        first = name + [salt] if salt and parent is None else name  # the salt: 1st block only
        extra_keys = [first or None] + [name or None] * (len(blocks) - 1)
        self._send(
            {
                "type": "BlockStored",
                "block_hashes": [self._name(h) for h in hashes],
                "parent_block_hash": None if parent is None else self._name(parent),
                "token_ids": [t for b in blocks for t in b.tokens],
                "block_size": self.block_size,
                "lora_id": lora[1] if lora else None,
                "medium": "GPU",
                "lora_name": lora[0] if lora else None,
                "extra_keys": extra_keys,
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            }
        )

    def removed(self, hashes: list[BlockHash]) -> None:
        names = [self._name(h) for h in hashes]
        self._send({"type": "BlockRemoved", "block_hashes": names, "medium": "GPU"})

    def _name(self, h: BlockHash) -> int:
        return h ^ self._salt

    def _send(self, event: dict) -> None:
        seq = next(self._seq)
        if seq >= self.drop_after and self.drop_share and self._rng.random() < self.drop_share:
            self.dropped += 1
            return
        payload = msgpack.packb([time.time(), [event], 0])
        with contextlib.suppress(zmq.Again):  # PUB drops at its high-water mark, never blocks
            self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        self.sent += 1


class RecordingEncoder(PromptEncoder):
    """The emulated server's tokenizer, telling the KV-event publisher each prompt's tokens."""

    publisher: KVEventPublisher | None = None

    def block_hashes(self, ids: list[int], root: BlockHash | None = None) -> list[BlockHash]:
        hashes = super().block_hashes(ids, root)
        if self.publisher is not None:
            self.publisher.learn(hashes, ids)
        return hashes
