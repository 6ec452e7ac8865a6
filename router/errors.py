"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json

from aiohttp import web


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

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status)

    def sse(self) -> bytes:
        """A mid-stream error as one framed SSE event, then the stream's end."""
        return f"data: {json.dumps(self.body)}\n\ndata: [DONE]\n\n".encode()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", code="no_healthy_worker")
