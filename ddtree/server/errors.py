"""The OpenAI error object and the HTTP statuses the server answers with (docs/interfaces.md section 11).

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

400 bad request (a malformed body, a wrong type, an unsupported parameter, a prompt past the context),
401 a missing or wrong API key (--api-key; code "invalid_api_key"),
404 an unknown model, 429 the queue is full (with Retry-After), 500 a request that failed inside the
engine, 503 the engine is dead or the server is draining.
"""
from __future__ import annotations

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def unsupported(param: str, value, why: str = "") -> ApiError:
    """A parameter this server does not implement, set to a value other than its default."""
    return ApiError(400, f"{param}={value!r} is not supported by ddtree serve{why}", param=param,
                    code="unsupported_parameter")
