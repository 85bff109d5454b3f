"""The audit log: one JSON line per request, for the operator's records.

    {"time": "2026-12-01T10:00:00.123Z", "request_id": "3f2a...", "rids": ["9c1e..."],
     "key_id": "a1b2c3d4e5f6", "role": "user", "client": "10.0.0.7", "method": "POST",
     "endpoint": "/generate", "status": 200, "prompt_tokens": 7, "completion_tokens": 32,
     "cached_tokens": 0, "latency_s": 0.412, "finish_reasons": ["length"]}

`key_id` names the API key a request was accepted with by a short slow hash of it (never the key;
null without one); `role` is "user" or "admin" (the key that opened the route). Neither the
prompt nor the output is written unless `log_requests` is set (`--log-requests`, SGLang's name):
then `request` holds the request body as sent and `outputs` the generated texts. The file is
rotated by size (`max_bytes`, `backups` old files kept); `-` writes to standard output.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import logging.handlers
import sys
import time
from typing import Any

DEFAULT_MAX_BYTES = 100 * 2**20
DEFAULT_BACKUPS = 5


# A key's name is a slow hash of it (PBKDF2, fixed salt): stable across restarts, so lines of one
# key can be found again, and costly to test guessed keys against (a plain SHA-256 prefix gave a
# weak key away to a dictionary run over the log)
_KEY_ID_SALT = b"radixlm audit key id"
_KEY_ID_ROUNDS = 20_000  # (~10 ms, once per key: the result is cached)


@functools.lru_cache(maxsize=64)  # (only the server's configured keys are named)
def key_id(key: str) -> str:
    """A short, stable name for an API key that does not give the key away."""
    digest = hashlib.pbkdf2_hmac("sha256", key.encode(), _KEY_ID_SALT, _KEY_ID_ROUNDS)
    return digest.hex()[:12]


class AuditLog:
    """Writes the lines. A logger of its own, outside the logging module's registry (two apps in
    one process write to their own files), that never propagates to the root logger."""

    def __init__(
        self,
        path: str,
        *,
        log_requests: bool = False,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
    ) -> None:
        if path == "-":
            handler: logging.Handler = logging.StreamHandler(sys.stdout)
        else:
            try:
                handler = logging.handlers.RotatingFileHandler(
                    path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8"
                )
            except OSError as e:
                raise ValueError(f"cannot open the audit log {path!r}: {e}") from e
        handler.setFormatter(logging.Formatter("%(message)s"))
        self.log_requests = log_requests
        self._handler = handler
        self._logger = logging.Logger("radixlm.audit", level=logging.INFO)
        self._logger.propagate = False
        self._logger.addHandler(handler)

    def write(self, entry: dict[str, Any]) -> None:
        line = {"time": _utc_now(), **entry}
        self._logger.info(json.dumps(line, ensure_ascii=False, default=str))

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._handler.close()


def _utc_now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
