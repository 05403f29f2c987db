"""Errors in the shape of the API that was called, for every failure path: OpenAI's
{"error": {"message", "type", "param", "code"}}, and Anthropic's {"type": "error", "error": {"type",
"message"}} under /v1/messages (so a Messages client reads a 401, 404, 413 or 503 there too)."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

RETRY_AFTER_SECONDS = 1
ANTHROPIC_PATH = "/v1/messages"
# HTTP status -> Anthropic's error type (its API reference, "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
OVERLOADED_MESSAGE = "Server is busy. Retry later."


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self, path: str = "") -> dict:
        """The error as the API at `path` writes it (OpenAI's shape unless it is Anthropic's)."""
        if path.startswith(ANTHROPIC_PATH):
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        return _ErrorResponse(self.body(path), status_code=self.status, headers=self.headers)


class _ErrorResponse(JSONResponse):
    """ASCII-escaped JSON: a message quoting client input renders whatever that input holds."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def overloaded() -> APIError:
    return APIError(503, OVERLOADED_MESSAGE, "overloaded", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def shutting_down() -> APIError:
    return APIError(503, "Server is shutting down.", "unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def engine_dead(reason: str) -> APIError:
    return APIError(503, f"The inference engine has stopped: {reason}", "server_error", code="engine_dead")


def generation_failed(message: str) -> APIError:
    return APIError(500, message, "server_error", code="inference_error")


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _param(loc: tuple) -> str:
    """('messages', 0, 'content', 'str') -> 'messages.[0].content'; union branch tags are dropped."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif part != "body" and part.isidentifier() and part not in _UNION_TAGS:
            parts.append(part)
    return ".".join(parts)


def from_validation(exc: ValidationError | RequestValidationError) -> APIError:
    first = exc.errors()[0]
    param = _param(tuple(first.get("loc", ())))
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return invalid(f"{message} (at '{param}')" if param else message, param or None)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = APIError(404, f"Invalid URL ({request.method} {request.url.path})", "invalid_request_error",
                             code="not_found")
        elif exc.status_code == 405:
            error = APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                             "invalid_request_error", code="method_not_allowed")
        else:
            error = APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        return error.response(request.url.path)
    # Anything else that escapes a route becomes a 500 in middleware.CatchAll (the connection stays open).
