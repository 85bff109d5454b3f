"""API errors and their JSON bodies.

Every error the server answers with has OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, on `/v1` and on the native routes alike (SGLang's client only needs a non-200 status and
a readable body).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error a client caused (4xx) or the server hit (5xx), with the fields of its JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, type="not_found_error", param=param, code=code)


def internal_error(message: str) -> APIError:
    return APIError(500, message, type="internal_error")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable")


class ClientDisconnected(Exception):
    """The client closed the connection; its generations were aborted (answered 499)."""
