"""How the emulated server words its answers, per API, as vLLM 0.32 words them: a whole answer,
or a stream's events (opened at the first token, one event per token, closed with the usage).

    completions, chat   `data: {...}` chunks; the usage chunk if asked; `data: [DONE]`
    responses           response.created ... output_text.delta ... response.completed
    messages            message_start ... content_block_delta ... message_delta, message_stop
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Counts:
    prompt: int
    output: int
    cached: int


def _sse(payload: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload)}\n\n".encode()


class Shape:
    """One answer's wording. `done` is true when the answer reached its output limit."""

    def __init__(self, body: dict, model: str, created: int) -> None:
        self.body, self.model, self.created = body, model, created

    def whole(self, pieces: list[str], counts: Counts) -> dict:
        raise NotImplementedError

    def preamble(self) -> bytes:
        """What a stream sends before any token is generated."""
        return b""

    def opening(self) -> bytes:
        """What a stream sends with its first token, before it."""
        return b""

    def token(self, piece: str, done: bool) -> bytes:
        raise NotImplementedError

    def closing(self, text: str, counts: Counts) -> bytes:
        raise NotImplementedError


class CompletionShape(Shape):
    def __init__(self, body: dict, model: str, created: int, chat: bool, choices: int = 1) -> None:
        super().__init__(body, model, created)
        self.chat, self.choices = chat, choices
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]

    def _usage(self, c: Counts) -> dict:
        return {
            "prompt_tokens": c.prompt,
            "completion_tokens": c.output,
            "total_tokens": c.prompt + c.output,
            "prompt_tokens_details": {"cached_tokens": c.cached},
        }

    def whole(self, pieces: list[str], counts: Counts) -> dict:
        # A batch's tokens shared out among its choices (vLLM's batch chat: a conversation each,
        # each its own max_tokens of the request's).
        size = -(-len(pieces) // self.choices)
        parts = ["".join(pieces[i * size : (i + 1) * size]) for i in range(self.choices)]
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(i, part) for i, part in enumerate(parts)],
            "usage": self._usage(counts),
        }

    def _choice(self, index: int, text: str) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {"index": index, "message": message, "finish_reason": "length"}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": "length"}

    def _chunk(self, choices: list, **extra: object) -> bytes:
        payload = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return _sse(payload)

    def opening(self) -> bytes:
        if not self.chat:
            return b""
        # vLLM opens a chat stream with a role-only delta
        opening = {"role": "assistant", "content": ""}
        return self._chunk([{"index": 0, "delta": opening, "finish_reason": None}])

    def token(self, piece: str, done: bool) -> bytes:
        finish = "length" if done else None
        delta = (
            {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
            if self.chat
            else {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
        )
        return self._chunk([delta])

    def closing(self, text: str, counts: Counts) -> bytes:
        options = self.body.get("stream_options") or {}
        usage = self._chunk([], usage=self._usage(counts)) if options.get("include_usage") else b""
        return usage + b"data: [DONE]\n\n"


class ResponseShape(Shape):
    """The Responses API: the id the request names (`request_id`), else a new one."""

    def __init__(self, body: dict, model: str, created: int) -> None:
        super().__init__(body, model, created)
        rid = body.get("request_id")
        self.id = rid if isinstance(rid, str) and rid else f"resp_{uuid.uuid4().hex[:16]}"
        self.item = f"msg_{uuid.uuid4().hex[:16]}"
        self.sequence = 0

    def _response(self, status: str, output: list, counts: Counts | None) -> dict:
        usage = None
        if counts is not None:
            usage = {
                "input_tokens": counts.prompt,
                "input_tokens_details": {"cached_tokens": counts.cached},
                "output_tokens": counts.output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": counts.prompt + counts.output,
            }
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": None
            if status != "incomplete"
            else {"reason": "max_output_tokens"},
            "instructions": self.body.get("instructions"),
            "model": self.model,
            "object": "response",
            "output": output,
            "background": False,
            "max_output_tokens": self.body.get("max_output_tokens"),
            "previous_response_id": self.body.get("previous_response_id"),
            "status": status,
            "tools": self.body.get("tools") or [],
            "usage": usage,
        }

    def _message(self, text: str, status: str) -> dict:
        part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        return {
            "id": self.item,
            "content": [part] if status == "completed" else [],
            "role": "assistant",
            "status": status,
            "type": "message",
        }

    def _event(self, kind: str, payload: dict) -> bytes:
        event = {**payload, "sequence_number": self.sequence, "type": kind}
        self.sequence += 1
        return _sse(event, kind)

    def whole(self, pieces: list[str], counts: Counts) -> dict:
        return self._response("incomplete", [self._message("".join(pieces), "completed")], counts)

    def preamble(self) -> bytes:
        # vLLM sends these as soon as the request is accepted, before generating.
        started = {"response": self._response("in_progress", [], None)}
        return self._event("response.created", started) + self._event(
            "response.in_progress", started
        )

    def opening(self) -> bytes:
        empty = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        at = {"item_id": self.item, "output_index": 0}
        return b"".join(
            [
                self._event(
                    "response.output_item.added",
                    {"item": self._message("", "in_progress"), "output_index": 0},
                ),
                self._event(
                    "response.content_part.added", {**at, "content_index": 0, "part": empty}
                ),
            ]
        )

    def token(self, piece: str, done: bool) -> bytes:
        at = {"content_index": 0, "item_id": self.item, "output_index": 0}
        return self._event("response.output_text.delta", {**at, "delta": piece, "logprobs": []})

    def closing(self, text: str, counts: Counts) -> bytes:
        at = {"content_index": 0, "item_id": self.item, "output_index": 0}
        part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        message = self._message(text, "completed")
        final = self._response("incomplete", [message], counts)
        return b"".join(
            [
                self._event("response.output_text.done", {**at, "text": text, "logprobs": []}),
                self._event("response.content_part.done", {**at, "part": part}),
                self._event("response.output_item.done", {"item": message, "output_index": 0}),
                self._event("response.completed", {"response": final}),
            ]
        )


class MessageShape(Shape):
    """Anthropic's Messages API, as vLLM serves it (ids as its chat completions')."""

    def __init__(self, body: dict, model: str, created: int) -> None:
        super().__init__(body, model, created)
        self.id = "chatcmpl-" + uuid.uuid4().hex[:16]

    @staticmethod
    def _usage(c: Counts) -> dict:
        # Anthropic's input_tokens leaves out the tokens read from the cache (vLLM's rule).
        return {
            "input_tokens": max(0, c.prompt - c.cached),
            "output_tokens": c.output,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": c.cached,
        }

    def whole(self, pieces: list[str], counts: Counts) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": "".join(pieces)}],
            "model": self.model,
            "stop_reason": "max_tokens",
            "usage": self._usage(counts),
        }

    def opening(self) -> bytes:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        block = {"type": "content_block_start", "content_block": {"type": "text", "text": ""}}
        return _sse({"type": "message_start", "message": message}, "message_start") + _sse(
            {**block, "index": 0}, "content_block_start"
        )

    def token(self, piece: str, done: bool) -> bytes:
        delta = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": piece}}
        return _sse({**delta, "index": 0}, "content_block_delta")

    def closing(self, text: str, counts: Counts) -> bytes:
        delta = {"stop_reason": "max_tokens", "stop_sequence": None}
        return b"".join(
            [
                _sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                _sse(
                    {"type": "message_delta", "delta": delta, "usage": self._usage(counts)},
                    "message_delta",
                ),
                _sse({"type": "message_stop"}, "message_stop"),
            ]
        )


def shape_for(api: str, body: dict, model: str, created: int, choices: int = 1) -> Shape:
    if api == "responses":
        return ResponseShape(body, model, created)
    if api == "messages":
        return MessageShape(body, model, created)
    return CompletionShape(body, model, created, chat=api == "chat", choices=choices)
