"""JSON over HTTP with the standard library (no extra dependency, no torch): requests and
server-sent-event streams, with server errors turned into `BackendError`s that carry the server's
message."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from radixlm.lang.backend import BackendError


class HttpClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def get(self, path: str) -> Any:
        with self._open("GET", path, None) as response:
            return _decode(response.read())

    def post(self, path: str, payload: Any) -> Any:
        with self._open("POST", path, payload) as response:
            return _decode(response.read())

    def status(self, method: str, path: str, payload: Any = None) -> int:
        """The status code of a call whose body does not matter (an error status is returned,
        not raised)."""
        try:
            with self._open(method, path, payload) as response:
                return response.status
        except BackendError as e:
            return e.status or 0

    def stream(self, path: str, payload: Any) -> Iterator[Any]:
        """The decoded `data:` payloads of a server-sent-event stream, up to `[DONE]`. An error
        event, or a stream that ends without `[DONE]` (cut off), is a `BackendError`."""
        with self._open("POST", path, payload) as response:
            for raw in response:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and event.get("error"):
                    raise BackendError(f"{self.base_url}{path}: {_message(event)}")
                yield event
        raise BackendError(f"{self.base_url}{path}: the stream ended without [DONE]")

    def _open(self, method: str, path: str, payload: Any):
        url = self.base_url + path
        headers = {"Accept": "application/json"}
        data = None
        if payload is not None:
            data = json.dumps(payload).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                message = _message(json.loads(body))
            except ValueError:
                message = body.decode("utf-8", "replace").strip() or e.reason
            raise BackendError(f"{method} {url} failed ({e.code}): {message}", e.code) from None
        except urllib.error.URLError as e:
            raise BackendError(f"cannot reach {url}: {e.reason}") from None


def _decode(body: bytes) -> Any:
    return json.loads(body) if body else None


def _message(obj: Any) -> str:
    if isinstance(obj, dict):
        error = obj.get("error", obj)
        if isinstance(error, dict):
            return str(error.get("message") or error)
        return str(error)
    return str(obj)
