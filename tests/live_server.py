"""Our HTTP server on a free loopback port, in a thread, for tests that use real clients."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
