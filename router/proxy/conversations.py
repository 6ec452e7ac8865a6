"""The Responses API's conversation state, kept by the router rather than by a worker.

vLLM's own store is per server, in memory and off by default: a turn that names
`previous_response_id` could only go where the last turn ran, and dies with that server. So the
proxy stores each response it relays, with the whole input it answered, and expands a chained
turn into full input before routing it: any worker can serve any turn, and the prefix index
(not a pin) keeps a conversation where its KV is.

    turn 1   input I1 ─► worker ─► response R1      stored: R1, I1
    turn 2   previous R1, input I2                  sent:   I1 + R1's output + I2
                             ─► any worker ─► R2     stored: R2, I1 + R1's output + I2

Each record holds its turns expanded, so a turn needs one read however long the conversation,
and a conversation whose older responses expired or were evicted continues from its newest; the
price is that a long conversation's early turns are stored again in each record (bounded by
the retention, and in memory by max_bytes).

    MemoryResponses  one router: bounded in bytes (oldest out first), expired after retention
    RedisResponses   router replicas: one key per response in their store, expired by Redis;
                     a background response's generating router holds a key that expires
                     unless renewed, so the others can tell when that router died

A record is read, continued or deleted only by its owner; for anyone else it does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import orjson
import redis
import redis.asyncio
from aiohttp import web

if TYPE_CHECKING:
    from router.proxy.service.store import Store

log = logging.getLogger(__name__)

# A stop asked of whichever replica runs a background response: (owner, response id).
OnCancel = Callable[[str, str], Awaitable[None]]
RESUBSCRIBE_DELAY = 1.0  # seconds between tries while the store does not answer

REDIS_TIMEOUT = 5.0  # seconds a call may take in all (the client's own: 2 s to connect, 2 s
# to read), so that a store that stops answering fails a turn rather than holding it


class StoreUnavailable(Exception):
    """The shared store did not answer (Redis down, or slower than REDIS_TIMEOUT)."""


@dataclass(frozen=True, slots=True)
class Stored:
    owner: str  # who made it (a tenant's client name, or the caller's identity)
    response: dict  # the response object as the client got it (vLLM's Responses shape)
    input: list[dict]  # the whole input it answered, as input items, earlier turns expanded

    def continued(self) -> list[dict]:
        """The input a follow-up turn continues from: `input`, then this response's output
        as input items. A message keeps its role and text (not its id, status or logprobs:
        an `incomplete` status would make vLLM continue that message instead of answering);
        reasoning is dropped, as vLLM drops it when it expands a previous response; function
        calls and other tool calls are valid input items as they are."""
        items = list(self.input)
        for item in self.response.get("output") or ():
            kind = item.get("type")
            if kind == "reasoning":
                continue
            if kind == "message":
                content = [_content_part(p) for p in item.get("content") or ()]
                item = {"type": "message", "role": "assistant", "content": content}
            items.append(item)
        return items


def _content_part(part: dict) -> dict:
    if part.get("type") == "output_text":
        return {"type": "output_text", "text": part.get("text", "")}
    return part  # a refusal: an input item as it is


class Responses(Protocol):
    """Where the proxy keeps the responses it relayed. Each call raises StoreUnavailable
    when its backend does not answer, within a bounded time."""

    retention: float  # seconds a response is kept after it is stored

    async def get(self, owner: str, response_id: str) -> Stored | None:
        """The response stored under `response_id` if `owner` made it; None if it was never
        stored, has expired or was evicted, or is another owner's: one answer for all, so an
        id reveals nothing about another tenant's."""
        ...

    async def put(self, response_id: str, stored: Stored) -> None:
        """Keep `stored` for `retention` seconds (replacing what `response_id` held)."""
        ...

    async def delete(self, owner: str, response_id: str) -> bool:
        """Forget the response if `owner` made it; whether there was one to forget."""
        ...

    async def request_cancel(self, owner: str, response_id: str) -> int:
        """Ask the other routers sharing the store to stop `response_id` if one of them is
        generating it for `owner`; how many routers heard (0: none listens)."""
        ...

    async def hold(self, response_id: str, seconds: float) -> None:
        """This router is generating `response_id` (a background response): say so for
        `seconds`, renewed while it runs, so that a router that dies leaves it unheld."""
        ...

    async def is_held(self, response_id: str) -> bool:
        """Whether a live router holds `response_id` (`hold`)."""
        ...

    async def listen_for_cancels(self, on_cancel: OnCancel, ready: asyncio.Event) -> None:
        """Until cancelled: `on_cancel(owner, id)` for each stop another router asks for,
        `ready` set once listening (again after an outage). Never raises for the store's
        trouble: it says so and tries again."""
        ...


RESPONSES = web.AppKey("responses", Responses)


def encode(stored: Stored) -> bytes:
    """A record's bytes (what Redis holds, and what the memory store counts and keeps). A
    body the proxy accepted may hold what orjson refuses (a lone surrogate, an integer past
    64 bits: openai_request.py reads those with the standard module); so may the record."""
    record = {"owner": stored.owner, "response": stored.response, "input": stored.input}
    try:
        return orjson.dumps(record)
    except orjson.JSONEncodeError:
        return json.dumps(record).encode()  # ASCII: a lone surrogate as its \u escape


def decode(raw: bytes) -> Stored:
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:  # written by the standard module (`encode`)
        record = json.loads(raw)
    return Stored(record["owner"], record["response"], record["input"])


class MemoryResponses:
    """One router's store: records as bytes (a copy no caller can change, and the size it
    is bounded by), in the order stored, which with one retention is the order they expire.
    Past `max_bytes` the oldest go first; a record larger than `max_bytes` is not kept."""

    def __init__(
        self, retention: float, max_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        assert retention > 0 and max_bytes > 0, f"retention {retention}, max_bytes {max_bytes}"
        self.retention, self.max_bytes, self.clock = retention, max_bytes, clock
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # id -> expiry, record
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    async def get(self, owner: str, response_id: str) -> Stored | None:
        self._expire()
        found = self._records.get(response_id)
        if found is None:
            return None
        stored = decode(found[1])
        return stored if stored.owner == owner else None

    async def put(self, response_id: str, stored: Stored) -> None:
        self._expire()
        self._drop(response_id)
        raw = encode(stored)
        self._records[response_id] = (self.clock() + self.retention, raw)
        self.num_bytes += len(raw)
        while self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._records)))

    async def delete(self, owner: str, response_id: str) -> bool:
        if await self.get(owner, response_id) is None:
            return False
        self._drop(response_id)
        return True

    async def request_cancel(self, owner: str, response_id: str) -> int:
        return 0  # one router: nobody else runs anything

    async def hold(self, response_id: str, seconds: float) -> None:
        pass

    async def is_held(self, response_id: str) -> bool:
        return True  # one router, whose store dies with it: what it generates, it holds

    async def listen_for_cancels(self, on_cancel: OnCancel, ready: asyncio.Event) -> None:
        ready.set()
        await asyncio.Event().wait()

    def _expire(self) -> None:
        now = self.clock()
        while self._records:
            response_id, (expiry, _) = next(iter(self._records.items()))
            if expiry > now:
                return
            self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        found = self._records.pop(response_id, None)
        if found is not None:
            self.num_bytes -= len(found[1])

    def check_integrity(self) -> None:
        expiries = [expiry for expiry, _ in self._records.values()]
        assert expiries == sorted(expiries), "records are kept in the order they expire"
        total = sum(len(raw) for _, raw in self._records.values())
        assert total == self.num_bytes <= self.max_bytes, (total, self.num_bytes, self.max_bytes)


class RedisResponses:
    """Router replicas' store: one record per key, `<prefix>:response:<id>`, set to expire
    after `retention` (Redis drops it; nothing here sweeps). Any replica serves any turn."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        prefix: str,
        retention: float,
        timeout: float = REDIS_TIMEOUT,
    ) -> None:
        self.client, self.prefix, self.retention, self.timeout = client, prefix, retention, timeout

    def key(self, response_id: str) -> str:
        return f"{self.prefix}:response:{response_id}"

    async def get(self, owner: str, response_id: str) -> Stored | None:
        async with self._answering():
            raw = await self.client.get(self.key(response_id))
        if raw is None:
            return None
        stored = decode(raw)
        return stored if stored.owner == owner else None

    async def put(self, response_id: str, stored: Stored) -> None:
        # PX: a retention in seconds need not be whole (EX takes integers only).
        expiry_ms = max(1, round(self.retention * 1000))
        async with self._answering():
            await self.client.set(self.key(response_id), encode(stored), px=expiry_ms)

    async def delete(self, owner: str, response_id: str) -> bool:
        # Read, then delete: an id is made once, by one owner, so nothing changes it between.
        if await self.get(owner, response_id) is None:
            return False
        async with self._answering():
            return bool(await self.client.delete(self.key(response_id)))

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}:cancel"

    async def request_cancel(self, owner: str, response_id: str) -> int:
        message = orjson.dumps({"owner": owner, "id": response_id})
        async with self._answering():
            return int(await self.client.publish(self.cancel_channel, message))

    def hold_key(self, response_id: str) -> str:
        return f"{self.prefix}:generating:{response_id}"

    async def hold(self, response_id: str, seconds: float) -> None:
        async with self._answering():
            await self.client.set(self.hold_key(response_id), b"", px=max(1, round(seconds * 1000)))

    async def is_held(self, response_id: str) -> bool:
        async with self._answering():
            return bool(await self.client.exists(self.hold_key(response_id)))

    async def listen_for_cancels(self, on_cancel: OnCancel, ready: asyncio.Event) -> None:
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.cancel_channel)
                ready.set()
                while True:
                    message = await pubsub.get_message(timeout=RESUBSCRIBE_DELAY)
                    if message is not None:
                        request = orjson.loads(message["data"])
                        await on_cancel(str(request["owner"]), str(request["id"]))
            except (redis.RedisError, OSError, orjson.JSONDecodeError, KeyError, TypeError) as e:
                ready.clear()
                log.warning("cancel requests: not listening (%s: %s); trying again in %.0f s",
                            type(e).__name__, e, RESUBSCRIBE_DELAY)  # fmt: skip
                await asyncio.sleep(RESUBSCRIBE_DELAY)
            finally:
                with contextlib.suppress(redis.RedisError, OSError):
                    await pubsub.aclose()

    @contextlib.asynccontextmanager
    async def _answering(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.timeout):
                yield
        except (redis.RedisError, OSError, TimeoutError) as e:
            raise StoreUnavailable(
                f"the responses store did not answer ({type(e).__name__}: {e})"
            ) from e


def responses_ctx(
    store: Store, prefix: str, retention: float
) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp cleanup context: while the app runs, its RESPONSES are kept in `store`
    under `prefix` (shared by the replicas), in place of the memory store create_app put
    there."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        client = store.client()
        app[RESPONSES] = RedisResponses(client, prefix, retention)
        try:
            yield
        finally:
            with contextlib.suppress(redis.RedisError, OSError):
                await client.aclose()

    return ctx
