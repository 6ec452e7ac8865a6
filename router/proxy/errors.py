"""Errors in the shape each client API parses.

    OpenAI (every path but /v1/messages)   {"error": {"message", "type", "param", "code"}}
    Anthropic (/v1/messages...)            {"type": "error", "error": {"type", "message"}}

Every answer the proxy gives that is not a worker's own reply is in one of these shapes,
including the ones aiohttp would otherwise write as text/plain (unknown path, wrong method, body
too large, headers too large, an unexpected exception): see `openai_errors` below, and for what
aiohttp's parser refuses, connections.py. Mid-stream, an error is one event in the stream's own
framing (`sse`): OpenAI's completions streams end with `data: [DONE]`, the Responses API's and
Anthropic's streams with a named `error` event.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from aiohttp import web

log = logging.getLogger(__name__)

# The OpenAI error type for a status the proxy answers itself.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    431: "invalid_request_error",
}
# Anthropic's error types (its API's documented set) for the same statuses.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

OPENAI, ANTHROPIC = "openai", "anthropic"  # the error shapes (`APIError.response(shape)`)
# The framing of a mid-stream error: completions and chat streams, the Responses API's, Anthropic's.
DONE, RESPONSES_EVENTS, ANTHROPIC_EVENTS = "done", "responses", "anthropic"


def shape_for(path: str) -> str:
    """The error shape clients of `path` parse."""
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.headers: dict[str, str] = {}
        self.close = False  # close the connection after answering (a body left unread)

    @classmethod
    def of_status(cls, status: int, message: str | None = None, code: str | None = None):
        """An error for a bare HTTP status, typed as OpenAI types it."""
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Error"
        kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return cls(status, message or phrase, kind, code=code)

    @property
    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    @property
    def anthropic_body(self) -> dict[str, object]:
        kind = _ANTHROPIC_TYPES.get(self.status)
        if kind is None:
            kind = "api_error" if self.status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, shape: str = OPENAI) -> web.Response:
        body = self.anthropic_body if shape == ANTHROPIC else self.body
        response = web.json_response(body, status=self.status, headers=self.headers)
        if self.close:
            response.force_close()
        return response

    def sse(self, framing: str = DONE) -> bytes:
        """A mid-stream error as one framed SSE event (then `[DONE]`, where the stream's
        framing has one)."""
        if framing == ANTHROPIC_EVENTS:
            return f"event: error\ndata: {json.dumps(self.anthropic_body)}\n\n".encode()
        if framing == RESPONSES_EVENTS:
            error = self.body["error"]
            assert isinstance(error, dict)
            event = {"type": "error", **error}
            return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
        return f"data: {json.dumps(self.body)}\n\ndata: [DONE]\n\n".encode()

    def raw(self) -> bytes:
        """A whole HTTP/1.1 answer that closes the connection, written to the transport where
        there is no request to answer through (connections.py, overload.py)."""
        body = json.dumps(self.body).encode()
        headers = {
            "Content-Type": "application/json",
            "Content-Length": str(len(body)),
            "Connection": "close",
            **self.headers,
        }
        head = f"HTTP/1.1 {self.status} {HTTPStatus(self.status).phrase}\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers.items()
        )
        return f"{head}\r\n".encode() + body


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", code="no_healthy_worker")


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Answer aiohttp's own errors (404, 405, 413, ...) and any escaped exception in the shape
    the path's clients parse (`shape_for`), without a traceback. An answer already under way
    cannot be replaced: it re-raises."""
    shape = shape_for(request.path)
    try:
        return await handler(request)
    except APIError as e:
        return e.response(shape)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error = APIError.of_status(e.status, _reason(e))
        if allow := e.headers.get("Allow"):
            error.headers["Allow"] = allow
        return error.response(shape)
    except Exception:
        if request.writer is not None and request.writer.output_size > 0:
            raise
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return APIError.of_status(500, "internal error in the router").response(shape)


def _reason(e: web.HTTPException) -> str:
    if e.status == 404:
        return "Not Found: no such endpoint"
    if e.status == 405:
        return f"Method Not Allowed: use {e.headers.get('Allow', 'another method')}"
    return e.text or e.reason
