"""Request errors in vLLM's shapes: ``{"error": {"message", "type", "param", "code"}}``.

Why a module: every wire format raises these, and the app turns them into the right status and
body (the Messages API wraps its own shape, ``{"type": "error", "error": {...}}``).
"""

from __future__ import annotations


class ApiError(Exception):
    status = 400
    type = "Bad Request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}

    def anthropic_body(self) -> dict:
        """vLLM's Messages error: ``{"type": "error", "error": {"type": "NotFoundError", ...}}``."""
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


class BadRequest(ApiError):
    status = 400
    type = "Bad Request"


class NotFound(ApiError):
    status = 404
    type = "NotFoundError"
