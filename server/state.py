"""The server's settings and per-app state (no module globals: two apps in one process are apart)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixlm.protocol.reasoning import ReasoningParser
from radixlm.server.audit import AuditLog
from radixlm.server.backend import GenerationBackend
from radixlm.server.inflight import Generation, InFlight
from radixlm.server.metrics import Metrics
from radixlm.server.tool_parsers import ToolCallParser


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for. None means "no limit but the model's own"."""

    max_body_bytes: int = 8 * 2**20
    max_prompt_tokens: int | None = None  # also bounded by the model's context
    max_new_tokens: int | None = None  # also bounded by the model's context
    max_n: int = 16  # completions per prompt
    max_batch_size: int = 256  # prompts in one request
    rate_limit_per_minute: float | None = None  # requests per API key (or client address)
    rate_limit_burst: int | None = None  # default: a tenth of a minute's allowance, at least 1
    # generations accepted and not finished at most (SGLang's name); past it a 503 with
    # Retry-After (None: no bound)
    max_queued_requests: int | None = None
    request_timeout: float | None = None  # seconds a generation may run (None: no deadline)

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerLimits.{name} must be at least 1")
        for name in (
            "max_prompt_tokens",
            "max_new_tokens",
            "rate_limit_burst",
            "max_queued_requests",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ServerLimits.{name} must be at least 1 (or None)")
        if self.rate_limit_per_minute is not None and self.rate_limit_per_minute <= 0:
            raise ValueError("ServerLimits.rate_limit_per_minute must be positive (or None)")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError("ServerLimits.request_timeout must be positive seconds (or None)")


@dataclass
class RequestUsage:
    """What one HTTP request did, filled in as its generations run: token counts (for the
    request log and the audit log), the generations it was accepted for (released when it is
    answered, whatever became of them), their ids and finish reasons, and, when the audit log
    keeps texts, their outputs."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    generations: list[Generation] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    outputs: list[str] | None = None  # (kept only for an audit log with --log-requests)

    def add(self, meta_info: dict[str, Any]) -> None:
        self.prompt_tokens += int(meta_info.get("prompt_tokens", 0))
        self.completion_tokens += int(meta_info.get("completion_tokens", 0))
        self.cached_tokens += int(meta_info.get("cached_tokens", 0))

    def note_final(self, meta_info: dict[str, Any], text: str | None) -> None:
        reason = meta_info.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        self.finish_reasons.append(str(kind))
        if self.outputs is not None and text is not None:
            self.outputs.append(text)


@dataclass
class ServerState:
    backend: GenerationBackend
    served_model_name: str
    limits: ServerLimits
    metrics: Metrics
    api_key: str | None = None
    owns_engine: bool = True
    extra_server_info: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    json_whitespace: str = "compact"  # the engine's, for the tool-call grammars the server builds
    tool_parser: ToolCallParser | None = None  # the model's tool-call format (None: the default)
    reasoning_parser: ReasoningParser | None = None  # splits off the thinking (None: none)
    # guards the admin routes (/flush_cache, profiling, /abort_request) apart from api_key
    admin_api_key: str | None = None
    inflight: InFlight = field(default_factory=InFlight)
    audit: AuditLog | None = None

    def accepts_model(self, name: str | None) -> bool:
        return name is None or name in (
            self.served_model_name,
            self.backend.model_info().model_path,
        )
