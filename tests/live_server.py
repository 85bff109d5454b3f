"""Our HTTP server on a free loopback port, in a thread, for tests that use real clients."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sse_payloads(lines: Iterable[str]) -> list[Any]:
    """The `data:` payloads of an SSE body's lines, decoded, with the final [DONE] kept as a
    string."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.05)


def wait_idle(get_stats: Callable[[], dict], timeout: float) -> dict:
    """Poll the engine's stats until no request runs or waits; its stats then."""
    deadline = time.monotonic() + timeout
    while True:
        stats = get_stats()
        if stats["num_running_reqs"] + stats["num_waiting_reqs"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine still runs requests: {stats}")
        time.sleep(0.05)


@contextlib.contextmanager
def serve_in_thread(engine, api_key: str | None = None) -> Iterator[str]:
    """Serve `engine` (not shut down afterwards) with uvicorn; yields the base URL."""
    import uvicorn

    from radixlm.server.app import create_app

    port = free_port()
    app = create_app(engine, api_key=api_key, owns_engine=False)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
