"""The ASGI middleware in front of every route: request log and audit log, API keys, rate limit,
the bound on accepted generations, body size, and a JSON 500 for anything unexpected (never a
dropped connection).

Keys. `api_key` guards every route but the public ones (/health, /health_generate, /metrics). The
admin routes (/flush_cache, /freeze_gc, /start_profile, /stop_profile, /abort_request) are
guarded apart by `admin_api_key` when one is set, as SGLang's ADMIN_OPTIONAL routes: only the
admin key opens them (the user key gets a 403, no key or another a 401), and the admin key opens
no other route. With no admin key they keep the user key's guard (open where no key is set at
all). Keys are compared in constant time."""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
import uuid
from http import HTTPStatus
from typing import Any

from radixlm.server.audit import AuditLog, key_id
from radixlm.server.errors import APIError
from radixlm.server.state import RequestUsage, ServerState

logger = logging.getLogger("radixlm.server")

Scope = dict[str, Any]

# Routes open without an API key, as SGLang's: /health and /health_generate for a load balancer's
# probes, /metrics for Prometheus (which scrapes without credentials by default).
_PUBLIC_PATHS = {"/health", "/health_generate", "/metrics"}
# routes not counted against the rate limit
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
_UNLIMITED_PATHS = {"/health", "/metrics"}
# routes that operate the server rather than use it (--admin-api-key)
ADMIN_PATHS = {"/flush_cache", "/freeze_gc", "/start_profile", "/stop_profile", "/abort_request"}
# routes that start generations: refused at once while the server is at capacity
_GENERATION_PATHS = {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"}


class RateLimiter:
    """A token bucket per key: `per_minute` requests a minute on average, `burst` at once."""

    _MAX_KEYS = 10_000

    def __init__(self, per_minute: float, burst: int | None = None) -> None:
        self.rate = per_minute / 60.0
        self.burst = float(burst if burst is not None else max(1, math.ceil(per_minute / 10)))
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, time)

    def acquire(self, key: str, now: float | None = None) -> float:
        """0 if the request may go now, else the seconds until it may."""
        now = time.monotonic() if now is None else now
        tokens, then = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            self._prune(now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (1.0 - tokens) / self.rate

    def _prune(self, now: float) -> None:
        if len(self._buckets) > self._MAX_KEYS:  # forget keys whose buckets have refilled
            full = [k for k, (t, s) in self._buckets.items() if t + (now - s) * self.rate >= 1]
            for k in full:
                del self._buckets[k]


class GuardMiddleware:
    def __init__(
        self, app: Any, state: ServerState, endpoints: frozenset[str] = frozenset()
    ) -> None:
        self.app = app
        self.state = state
        self.endpoints = endpoints  # the app's route paths: the metrics' endpoint label values
        limits = state.limits
        self.rate_limiter = (
            RateLimiter(limits.rate_limit_per_minute, limits.rate_limit_burst)
            if limits.rate_limit_per_minute
            else None
        )

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = uuid.uuid4().hex[:12]
        audit = self.state.audit
        usage = RequestUsage(outputs=[] if audit is not None and audit.log_requests else None)
        scope.setdefault("state", {}).update(usage=usage, arrived=started)
        response = _ResponseRecord()
        metrics = self.state.metrics
        path = scope.get("path", "")
        method = scope.get("method", "")
        endpoint = self._endpoint(path)
        # a metrics label from a fixed set: any token the client sends is a method to uvicorn,
        # and each new label value would be a new series kept forever
        label_method = method if method in _METHODS else "other"

        async def send_logged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            response.saw(message)
            await send(message)

        metrics.http_requests.labels(endpoint=endpoint, method=label_method).inc()
        active = metrics.http_active.labels(endpoint=endpoint, method=label_method)
        active.inc()
        access = _Access(None, None)
        body = b""
        try:
            access = self._check_access(scope)
            rejection = access.rejection
            if rejection is None:
                receive, rejection, body = await self._buffer_body(scope, receive)
            if rejection is not None:
                metrics.count_error(rejection.type)
                await rejection.response()(scope, receive, send_logged)
            else:
                await self.app(scope, receive, send_logged)
        except Exception as e:
            logger.exception("request %s failed", request_id)
            metrics.count_error("internal_error")
            response.failure = f"internal server error: {e}"
            if not response.started:
                err = APIError(500, f"internal server error: {e}", type="internal_error")
                await err.response()(scope, receive, send_logged)
        finally:
            for generation in usage.generations:  # answered: none of them counts any longer
                self.state.inflight.release(generation)
            active.dec()
            code, reason = response.outcome()
            metrics.http_responses.labels(
                endpoint=endpoint, status_code=str(code), method=label_method
            ).inc()
            latency = time.perf_counter() - started
            if path not in _UNLIMITED_PATHS:
                logger.info(
                    "%s %s %s %d in=%d out=%d cached=%d %.3fs%s",
                    request_id,
                    method,
                    path,
                    code,
                    usage.prompt_tokens,
                    usage.completion_tokens,
                    usage.cached_tokens,
                    latency,
                    f": {reason}" if reason else "",
                )
            if audit is not None:
                self._audit(audit, scope, request_id, access, code, usage, latency, body)

    def _endpoint(self, path: str) -> str:
        """The endpoint label of the metrics: a route's path, never a path a client made up."""
        if path in self.endpoints:
            return path
        if path.startswith("/v1/models/"):
            return "/v1/models/{model_id}"
        return "other"

    def _audit(
        self,
        audit: AuditLog,
        scope: Scope,
        request_id: str,
        access: _Access,
        code: int,
        usage: RequestUsage,
        latency: float,
        body: bytes,
    ) -> None:
        client = scope.get("client") or (None, 0)
        entry: dict[str, Any] = {
            "request_id": request_id,
            "rids": sorted({g.id for g in usage.generations}),
            "key_id": access.key_id,
            "role": access.role,
            "client": client[0],
            "method": scope.get("method", ""),
            "endpoint": scope.get("path", ""),
            "status": code,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
            "latency_s": round(latency, 6),
            "finish_reasons": usage.finish_reasons,
        }
        if audit.log_requests:
            entry["request"] = body.decode("utf-8", errors="replace")
            entry["outputs"] = usage.outputs
        try:
            audit.write(entry)
        except Exception:  # a full disk must not fail the requests
            logger.exception("writing the audit log failed")

    def _check_access(self, scope: Scope) -> _Access:
        path = scope.get("path", "")
        access = _Access(None, None)
        if path not in _PUBLIC_PATHS:
            access = self._authorize(path, _bearer_token(scope))
            if access.rejection is not None:
                return access
        if self.rate_limiter is not None and path not in _UNLIMITED_PATHS:
            client = scope.get("client") or ("unknown", 0)
            wait = self.rate_limiter.acquire(access.key_id or f"addr:{client[0]}")
            if wait > 0:
                access.rejection = APIError(
                    429,
                    f"rate limit exceeded; retry in {math.ceil(wait)} s",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(math.ceil(wait))},
                )
                return access
        if path in _GENERATION_PATHS and scope.get("method") == "POST":
            access.rejection = self.state.inflight.overloaded()
        return access

    def _authorize(self, path: str, token: str | None) -> _Access:
        user, admin = self.state.api_key, self.state.admin_api_key
        if path in ADMIN_PATHS and admin is not None:
            if token is not None and _same(token, admin):
                return _Access("admin", key_id(token))
            if token is not None and user is not None and _same(token, user):
                return _Access(
                    None,
                    None,
                    APIError(
                        403,
                        f"{path} is an admin route: the API key given is a user's; send the "
                        "admin key ('Authorization: Bearer <admin key>')",
                        type="permission_error",
                        code="admin_key_required",
                    ),
                )
            return _Access(None, None, _unauthorized("admin API key"))
        if user is None:
            return _Access(None, None)
        if token is not None and _same(token, user):
            return _Access("user", key_id(token))
        return _Access(None, None, _unauthorized("API key"))

    async def _buffer_body(self, scope: Scope, receive: Any) -> tuple[Any, APIError | None, bytes]:
        """Read the whole body (up to the limit) so that no route sees an oversized one."""
        limit = self.state.limits.max_body_bytes
        too_large = APIError(
            413,
            f"the request body exceeds this server's limit of {limit} bytes",
            type="request_too_large",
            code="request_too_large",
        )
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > limit:
                        return receive, too_large, b""
                except ValueError:
                    return receive, APIError(400, "bad Content-Length header"), b""
        if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            return receive, None, b""
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _replay([message], receive), None, b""
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return receive, too_large, b""
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = b"".join(chunks)
        message = {"type": "http.request", "body": whole, "more_body": False}
        return _replay([message], receive), None, whole


class _Access:
    """Who a request is (the role its key opened, the key's id) or why it is refused."""

    __slots__ = ("role", "key_id", "rejection")

    def __init__(self, role: str | None, key_id: str | None, rejection: APIError | None = None):
        self.role = role
        self.key_id = key_id
        self.rejection = rejection


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _unauthorized(what: str) -> APIError:
    return APIError(
        401,
        f"missing or wrong {what}: send the header 'Authorization: Bearer <key>'",
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


class _ResponseRecord:
    """What the request log says of a response: its status, and for an error, its reason (the
    message of the JSON error body every error response has). A response that started but never
    finished, with no error on our side, was cut off by the client: logged as 499."""

    _MAX_ERROR_BODY = 4096

    def __init__(self) -> None:
        self.code = 0
        self.started = False
        self.complete = False
        self.failure: str | None = None  # an exception of ours ended the response
        self._error_body = bytearray()

    def saw(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.code, self.started = message["status"], True
        elif message["type"] == "http.response.body":
            if self.code >= 400 and len(self._error_body) < self._MAX_ERROR_BODY:
                self._error_body += message.get("body", b"")[: self._MAX_ERROR_BODY]
            if not message.get("more_body", False):
                self.complete = True

    def outcome(self) -> tuple[int, str | None]:
        """(status, reason) for the log."""
        if self.failure is not None:
            return (self.code if self.started else 500), self.failure
        if not self.started:  # the client went away before an answer
            return 499, "the client closed the connection before the response"
        if not self.complete:
            return 499, f"the client closed the connection during the response ({self.code} sent)"
        if self.code >= 400:
            return self.code, self._error_message()
        return self.code, None

    def _error_message(self) -> str:
        try:
            body = json.loads(bytes(self._error_body))
            return str(body["error"]["message"])
        except (ValueError, KeyError, TypeError):  # not our JSON error shape
            return (
                HTTPStatus(self.code).phrase if self.code in HTTPStatus._value2member_map_ else ""
            )


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None
