"""Precise mode: a worker's vLLM KV events (ZMQ PUB, msgpack) kept in the prefix index.

vLLM names blocks by its own hashes; events carry each stored block's token ids and its
parent, so the router re-hashes the tokens with its chained block hash (the one it uses for
prompts) and remembers vLLM's name for each block to place later events. A chain's first block
is hashed under the cache identity the event names (its `lora_name`, the `cache_salt` among its
`extra_keys`) and the worker's model group, as the proxy hashes a prompt for that identity.
A removed block takes everything below it on that worker with it: a prefix match could not
reach past it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import msgpack

from router.prefix_index import PrefixIndex, WorkerId
from router.request import BlockHash, cache_root, hash_token_blocks

log = logging.getLogger(__name__)


class KVEventIndexer:
    """`block_size`: the router's. Blocks of another size (a worker configured apart from the
    router) can never match a prompt's hashes: they are not indexed, and a warning says why.
    `changed(worker)` is told after each change to what the index says the worker holds (the
    router's view re-keys the worker in the orders policies read). `model`: the worker's model
    group in a fleet of several (router.request.cache_root)."""

    def __init__(
        self,
        index: PrefixIndex,
        worker: WorkerId,
        block_size: int | None = None,
        changed: Callable[[WorkerId], None] | None = None,
        model: str | None = None,
    ) -> None:
        self.index = index
        self.worker = worker
        self.model = model
        self.changed = changed or (lambda _: None)
        self.block_size = block_size
        self.other_sizes: set[int] = set()  # block sizes heard of and ignored
        self._blocks: dict[int, tuple[BlockHash, int | None]] = {}  # vLLM hash -> ours, parent
        self.last_seq: int | None = None
        self.num_gaps = 0

    def feed(self, parts: list[bytes], now: float) -> None:
        """One multipart message: (topic, 8-byte big-endian sequence number, msgpack batch)."""
        seq = int.from_bytes(parts[-2], "big") if len(parts) >= 2 else None
        if seq is not None and self.last_seq is not None and seq != self.last_seq + 1:
            self.num_gaps += 1  # events were lost; the index drifts until blocks are re-stored
        self.last_seq = seq
        batch = msgpack.unpackb(parts[-1], raw=False, strict_map_key=False)
        events = batch[1] if isinstance(batch, list) else batch.get("events", [])
        self.apply(events, now)

    def apply(self, events: Iterable[object], now: float) -> None:
        for event in events:
            kind, fields = _normalize(event)
            if kind == "BlockStored":
                self._stored_tokens(fields, now)
            elif kind == "BlockRemoved":
                self.removed(fields.get("block_hashes") or [])
            elif kind == "AllBlocksCleared":
                self.cleared()

    def stored(
        self, names: list[int], parent: int | None, ours: list[BlockHash], now: float
    ) -> None:
        """Blocks `names` (hashed by us as `ours`) now follow block `parent` on the worker.
        The simulator's engines name blocks by our hashes already: there `names` is `ours`."""
        prefix = self._path(parent) if parent is not None else []
        if parent is None or prefix:  # else its parent was never seen (we joined late)
            self._store(names, parent, prefix, ours, now)

    def removed(self, names: Iterable[int]) -> None:
        # Caches evict a chain's blocks deepest first; taken in reverse, the first removal of a
        # chain drops the blocks below it too, and theirs find their path gone at once. Any
        # order leaves the same index: a removal takes the subtree below the block with it.
        for name in reversed(list(names)):
            path = self._path(name)
            if path:
                self.index.remove_prefix(path, self.worker)
                self.changed(self.worker)
            self._blocks.pop(name, None)

    def cleared(self) -> None:
        self.index.remove_worker(self.worker)
        self.changed(self.worker)
        self._blocks.clear()

    def _stored_tokens(self, fields: dict, now: float) -> None:
        parent = fields.get("parent_block_hash")
        names = list(fields.get("block_hashes") or [])
        size = int(fields.get("block_size") or 0)
        tokens = list(fields.get("token_ids") or [])
        if not names or size <= 0 or len(tokens) < size * len(names):
            return
        if self.block_size is not None and size != self.block_size:
            if size not in self.other_sizes:
                self.other_sizes.add(size)
                log.warning(
                    "worker %s: KV events of %d-token blocks, the router's are %d: not indexed",
                    self.worker,
                    size,
                    self.block_size,
                )
            return
        prefix = self._path(parent) if parent is not None else []
        if parent is not None and not prefix:
            return  # its parent was never seen (we joined late): nothing to chain it to
        root: BlockHash | None
        if prefix:
            root = prefix[-1]
        else:
            lora = fields.get("lora_name")
            root = cache_root(self.model, lora, _salt(fields.get("extra_keys"), lora))
        ours = hash_token_blocks(tokens[: size * len(names)], size, root)
        self._store(names, parent, prefix, ours, now)

    def _store(
        self,
        names: list[int],
        parent: int | None,
        prefix: list[BlockHash],
        ours: list[BlockHash],
        now: float,
    ) -> None:
        previous = parent
        for name, h in zip(names, ours, strict=True):
            self._blocks[name] = (h, previous)
            previous = name
        # A store is the new blocks' first use; reuses of the prefix are counted on routing.
        self.index.insert(prefix + list(ours), self.worker, now, hits_from=len(prefix))
        self.changed(self.worker)

    def _path(self, name: int) -> list[BlockHash]:
        """Our hashes from the root to vLLM block `name` ([] if unknown)."""
        path = []
        block: int | None = name
        while block is not None:
            entry = self._blocks.get(block)
            if entry is None:
                return []
            path.append(entry[0])
            block = entry[1]
        path.reverse()
        return path


def _salt(extra_keys: object, lora: object) -> str | None:
    """The cache salt among a chain's first block's extra keys: in order, the LoRA name (when
    there is one), (mm identifier, offset) pairs, the salt, prompt-embedding digests."""
    if not isinstance(extra_keys, list) or not extra_keys or not extra_keys[0]:
        return None
    keys = list(extra_keys[0])
    if lora is not None and keys and keys[0] == lora:
        keys = keys[1:]
    return next((k for k in keys if isinstance(k, str)), None)


def _normalize(event: object) -> tuple[str, dict]:
    """vLLM sends events as maps with a `type`; older builds as tagged arrays."""
    if isinstance(event, dict):
        return str(event.get("type", "")), event
    if isinstance(event, list) and event:
        kind = str(event[0])
        names = {
            "BlockStored": [
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
            ],
            "BlockRemoved": ["block_hashes"],
        }.get(kind, [])
        return kind, dict(zip(names, event[1:], strict=False))
    return "", {}
