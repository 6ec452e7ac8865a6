"""Token accounting on an OpenAI server-sent event stream, as it passes through the proxy.

Fairness policies charge clients per output token while the answer streams, so the proxy counts
tokens as events go by: one per content event (vLLM sends one per generated token; a chat
stream's opening role-only event carries none). That running count is an estimate. The exact
figure arrives at the end: the proxy always asks the worker for the usage event
(`stream_options.include_usage`) and reconciles with it, and passes that event on only to
clients that asked for it themselves.

Events are handed on whole: a network chunk can end mid-event, and both the count and the
decision to drop the usage event need the whole event.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import orjson

_USAGE = re.compile(rb'"usage":\s*\{')


@dataclass(frozen=True, slots=True)
class Usage:
    completion_tokens: int
    cached_tokens: int | None  # None: the worker does not report it


def with_usage_requested(body: dict) -> dict:
    """The request body to send upstream: a stream always ends with the usage event."""
    if not body.get("stream"):
        return body
    options = body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    return {**body, "stream_options": {**options, "include_usage": True}}


def client_wants_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


class StreamAccount:
    """Splits a stream into whole events, counts their tokens and takes the usage event out.

    `feed` returns the bytes to pass on (whole events only) and the tokens they carry.
    """

    def __init__(self, forward_usage: bool) -> None:
        self.forward_usage = forward_usage
        self.usage: Usage | None = None
        self._partial = b""

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self._partial = data
            return b"", 0
        self._partial = data[end:]
        whole = data[:end]
        if _USAGE.search(whole) is None:  # the common case: token events only
            return whole, _count_tokens(whole)
        kept, tokens = [], 0
        for event in whole.split(b"\n\n")[:-1]:
            if _USAGE.search(event) and (usage := _parse_usage(event)) is not None:
                self.usage = usage
                if not self.forward_usage:
                    continue
            else:
                tokens += _count_tokens(event)
            kept.append(event + b"\n\n")
        return b"".join(kept), tokens

    def flush(self) -> bytes:
        """Whatever trails the last whole event (a stream should end on one)."""
        rest, self._partial = self._partial, b""
        return rest


def _count_tokens(events: bytes) -> int:
    # Role-only chat events ("delta": {"role": ...}) open a stream and carry no token.
    return events.count(b"data: {") - events.count(b'"role"')


def _parse_usage(event: bytes) -> Usage | None:
    """The usage of a final usage event (`choices` empty), else None."""
    payload = event.partition(b"data: ")[2]
    try:
        answer = orjson.loads(payload)
        if answer.get("choices"):
            return None  # continuous usage stats on a token event: still a token
        usage = answer["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return Usage(int(usage["completion_tokens"]), None if cached is None else int(cached))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
