"""Token accounting on a server-sent event stream, as it passes through the proxy.

Fairness policies charge clients per output token while the answer streams, so the proxy counts
tokens as events go by: one per content event (vLLM sends one per generated token, or a few
when it detokenizes them together). That running count is an estimate. The exact figure
arrives at the end, in each API's own usage, and the proxy reconciles with it:

    stream        token events            usage (exact)                      end
    completions,  `data: {...}` (not a    the usage event, always asked for  `data: [DONE]`
    chat          chat's role-only one)   (`stream_options.include_usage`),
                                          passed on only if the client asked
    responses     `event: response.*.delta`  `response.completed` (or          that event
                                          `.incomplete`, `.failed`): its
                                          response's usage
    messages      `event: content_block_delta`  `message_delta`'s usage        `message_stop`

Events are handed on whole: a network chunk can end mid-event, and both the count and the
decision to drop the usage event need the whole event.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import orjson

_USAGE = re.compile(rb'"usage":\s*\{')
_NO_PREVIOUS = re.compile(rb'"previous_response_id":\s*null')


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


class WholeEvents:
    """What every stream account shares: a stream cut into whole events (`whole`), and
    whatever trails the last one (`flush`)."""

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self._partial = b""

    def whole(self, chunk: bytes) -> bytes:
        """The whole events the stream holds so far, from `chunk` and what came before it;
        the rest is kept for the next chunk."""
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self._partial = data
            return b""
        self._partial = data[end:]
        return data[:end]

    def flush(self) -> bytes:
        """Whatever trails the last whole event (a stream should end on one)."""
        rest, self._partial = self._partial, b""
        return rest


class StreamAccount(WholeEvents):
    """Splits a completions or chat stream into whole events, counts their tokens and takes
    the usage event out.

    `feed` returns the bytes to pass on (whole events only) and the tokens they carry; `ends`
    tells whether those events hold the stream's end.
    """

    END = b"data: [DONE]"

    def __init__(self, forward_usage: bool) -> None:
        super().__init__()
        self.forward_usage = forward_usage

    def ends(self, events: bytes) -> bool:
        return self.END in events

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        whole = self.whole(chunk)
        if not whole:
            return b"", 0
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


class NamedEventAccount(WholeEvents):
    """A stream of named events (`event: NAME` then `data: {...}`): the Responses API's and
    Anthropic's. Every event is passed on; the usage comes from the event that carries it."""

    TOKEN: bytes  # what begins a token-carrying event
    USAGE: re.Pattern[bytes]  # the events that carry the exact usage
    END: re.Pattern[bytes]  # the event that ends the stream

    def ends(self, events: bytes) -> bool:
        return self.END.search(events) is not None

    @classmethod
    def begun(cls, head: bytes) -> bool:
        """Whether a stream's first bytes hold a token, or its end."""
        return cls.TOKEN in head or cls.END.search(head) is not None

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        whole = self.whole(chunk)
        if whole and self.USAGE.search(whole) is not None:
            for event in whole.split(b"\n\n")[:-1]:
                if self.USAGE.search(event) is not None:
                    payload = event.partition(b"data: ")[2]
                    with contextlib.suppress(ValueError):
                        self.seen_final(orjson.loads(payload))
        return whole, whole.count(self.TOKEN)

    def seen_final(self, event: object) -> None:
        raise NotImplementedError


class ResponsesAccount(NamedEventAccount):
    """A Responses API stream. Keeps the final response object (`final`), which the proxy
    stores for the turns that continue it."""

    TOKEN = b"delta\ndata: "
    USAGE = END = re.compile(rb"event: response\.(completed|incomplete|failed)\n")

    def __init__(self) -> None:
        super().__init__()
        self.final: dict | None = None
        # The response a chained turn continues: the worker, sent the conversation whole,
        # says it continued none; the client is told the one it named.
        self.continues: str | None = None

    def feed(self, chunk: bytes) -> tuple[bytes, int]:
        events, tokens = super().feed(chunk)
        if self.continues is not None and events:
            named = b'"previous_response_id":' + orjson.dumps(self.continues)
            events = _NO_PREVIOUS.sub(lambda _: named, events)
        return events, tokens

    def seen_final(self, event: object) -> None:
        if not isinstance(event, dict) or not isinstance(event.get("response"), dict):
            return
        self.final = event["response"]
        self.usage = responses_usage(self.final)


class MessagesAccount(NamedEventAccount):
    """An Anthropic Messages stream."""

    TOKEN = b"event: content_block_delta\n"
    USAGE = re.compile(rb"event: message_delta\n")
    END = re.compile(rb"event: message_stop\n")

    def seen_final(self, event: object) -> None:
        if isinstance(event, dict):
            self.usage = messages_usage(event)


def responses_usage(response: dict) -> Usage | None:
    """A Responses API response object's usage: output tokens, cached input tokens."""
    with contextlib.suppress(AttributeError, KeyError, TypeError, ValueError):
        usage = response["usage"]
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        return Usage(int(usage["output_tokens"]), None if cached is None else int(cached))
    return None


def messages_usage(answer: dict) -> Usage | None:
    """An Anthropic message's (or message_delta event's) usage."""
    with contextlib.suppress(AttributeError, KeyError, TypeError, ValueError):
        usage = answer["usage"]
        cached = usage.get("cache_read_input_tokens")
        return Usage(int(usage["output_tokens"]), None if cached is None else int(cached))
    return None


def chat_usage(answer: dict) -> Usage | None:
    """A completions or chat answer's usage."""
    with contextlib.suppress(AttributeError, KeyError, TypeError, ValueError):
        usage = answer["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return Usage(int(usage["completion_tokens"]), None if cached is None else int(cached))
    return None


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
    except (ValueError, AttributeError):
        return None
    return chat_usage(answer)
