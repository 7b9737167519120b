"""Errors in the OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause or see becomes an ``APIError`` carrying its HTTP status; the app
turns it into that JSON body (or, once a stream has started, into one SSE event).
"""
from __future__ import annotations


class APIError(Exception):
    """A request that cannot be served, with the status and body the OpenAI API would give."""

    def __init__(self, status: int, message: str, *, error_type: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


def bad_request(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    """400: ``message`` names the field (``param``), what was wrong and what is allowed."""
    return APIError(400, message, error_type="invalid_request_error", param=param, code=code)


def model_not_found(model: str, served: list[str]) -> APIError:
    """404 naming the model asked for and every model served (the base model, then its adapters)."""
    names = ", ".join(f"`{name}`" for name in served)
    return APIError(404, f"The model `{model}` does not exist; this server serves {names} "
                         "(GET /v1/models lists them).",
                    error_type="invalid_request_error", param="model", code="model_not_found")


def not_ready(message: str) -> APIError:
    return APIError(503, message, error_type="server_error", code="model_not_ready")


def server_error(message: str) -> APIError:
    return APIError(500, message, error_type="server_error", code="internal_error")
