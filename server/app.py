"""The FastAPI application: native SGLang-compatible API, OpenAI API, metrics, protection.

from radixlm.server.app import create_app
app = create_app(radixlm.Engine(), api_key="secret")
uvicorn.run(app, host="127.0.0.1", port=30000)
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixlm import __version__
from radixlm.errors import EngineShutDown
from radixlm.protocol.reasoning import reasoning_parser as get_reasoning_parser
from radixlm.server.audit import AuditLog
from radixlm.server.backend import GenerationBackend, LocalEngineBackend, engine_stats
from radixlm.server.errors import APIError, ClientDisconnected, unavailable
from radixlm.server.guard import GuardMiddleware
from radixlm.server.inflight import InFlight
from radixlm.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixlm.server.metrics import Metrics
from radixlm.server.openapi import add_bodies
from radixlm.server.state import ServerLimits, ServerState
from radixlm.server.tool_parsers import resolve_tool_call_parser

logger = logging.getLogger("radixlm.server")


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    limits: ServerLimits | None = None,
    owns_engine: bool = True,
    server_info: dict[str, Any] | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    admin_api_key: str | None = None,
    audit_log: str | AuditLog | None = None,
    log_requests: bool = False,
) -> FastAPI:
    """Build the app over an engine (a `radixlm.Engine` or any `GenerationBackend`).

    With `owns_engine`, the engine is shut down when the app shuts down (uvicorn on SIGTERM: it
    stops accepting, lets in-flight requests finish for its graceful timeout, then runs this).
    `served_model_name` is the model id of the OpenAI API (default: the model folder's name).
    `tool_call_parser` is the model's tool-call format under SGLang's names (`hermes`, `qwen25`,
    `llama3`, `pythonic`, `mistral`, `deepseekv3`, or `auto`: from the chat template; default:
    the server's own format, see server/tools.py); `reasoning_parser` (`deepseek-r1`, `qwen3`)
    splits the thinking off into `reasoning_content`. ValueError for an unknown name.

    `admin_api_key` guards the admin routes (/flush_cache, /freeze_gc, /start_profile, /stop_profile,
    /abort_request) apart from `api_key` (see server/guard.py). `audit_log` (a path, `-` for
    standard output, or an `AuditLog`) writes one JSON line per request (server/audit.py);
    `log_requests` puts the request bodies and output texts in it. `limits` bound the requests
    (`max_queued_requests`, `request_timeout`, sizes, rates: `ServerLimits`).
    """
    reasoning = None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
    backend: GenerationBackend = (
        engine if _is_backend(engine) else LocalEngineBackend(engine)
    )  # fmt: skip
    info = backend.model_info()
    tool_parser = resolve_tool_call_parser(tool_call_parser, info.chat_template)
    name = served_model_name or info.name
    limits = limits or ServerLimits()
    owns_audit = isinstance(audit_log, str)
    if isinstance(audit_log, str):
        audit_log = AuditLog(audit_log, log_requests=log_requests)
    state = ServerState(
        backend=backend,
        served_model_name=name,
        limits=limits,
        metrics=Metrics(name),
        api_key=api_key or None,
        owns_engine=owns_engine,
        extra_server_info=dict(server_info or {}),
        json_whitespace=backend.engine_config().get("json_whitespace", "compact"),
        tool_parser=tool_parser,
        reasoning_parser=reasoning,
        admin_api_key=admin_api_key or None,
        inflight=InFlight(limits.max_queued_requests),
        audit=audit_log,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info("serving %s (%s)", name, info.model_path)
        yield
        if state.owns_engine:
            logger.info("shutting down the engine")
            backend.shutdown()
        if owns_audit and state.audit is not None:
            state.audit.close()

    app = FastAPI(
        title="radixlm",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.server = state

    from radixlm.server import native, openai_api, responses_api, tokenizer_api

    app.include_router(native.router)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(tokenizer_api.router)

    def openapi() -> dict[str, Any]:  # FastAPI's, with the bodies the routes read themselves
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # (duplicate operation ids: add_bodies renames them)
                warnings.simplefilter("ignore", UserWarning)
                document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = add_bodies(document, info.vocab_size)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await engine_stats(backend)
        except APIError as e:  # the engine is gone (/health says so too) or did not answer
            logger.warning("engine stats unavailable: %s", e.message)
            stats = None
        except Exception:  # metrics must answer even when the engine does not
            logger.exception("engine stats unavailable")
            stats = None
        return Response(state.metrics.render(stats), media_type=METRICS_CONTENT_TYPE)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        state.metrics.count_error(exc.type)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # unknown routes and methods, in the same error shape as everything else
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers)
        state.metrics.count_error(err.type)
        return err.response()

    @app.exception_handler(EngineShutDown)
    async def shut_down(request: Request, exc: EngineShutDown) -> Response:
        # (any route: /flush_cache, /server_info, ... on an engine that takes no more calls)
        err = unavailable(str(exc))
        state.metrics.count_error(err.type)
        return err.response()

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    # the route paths, the metrics' endpoint labels (read from the routers: FastAPI may keep an
    # included router as one entry of app.routes)
    routers = (native.router, openai_api.router, responses_api.router, tokenizer_api.router, app)
    endpoints = frozenset(
        path for r in routers for route in r.routes if (path := getattr(route, "path", None))
    )
    app.add_middleware(GuardMiddleware, state=state, endpoints=endpoints)
    return app


def _is_backend(engine: Any) -> bool:
    return callable(getattr(engine, "model_info", None)) and callable(
        getattr(engine, "stream", None)
    )
