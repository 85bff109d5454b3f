"""Exceptions of the engine that callers tell apart (torch-free: the server imports them)."""

from __future__ import annotations


class EngineShutDown(RuntimeError):
    """The engine was shut down (or its process was lost): it takes no more requests. The HTTP
    server answers 503 for it; any other RuntimeError from the engine is a failure (500). A
    RuntimeError, so code that caught that before still does."""


class GrammarRefused(ValueError):
    """A request's grammar (regex, JSON schema, EBNF) was refused, or did not compile in time;
    the message says why. How the server's backends report the engine's `GrammarError` (which
    lives with the grammar code, behind torch): in a list of prompts it ends only its own item,
    aborted with the message; for a single request it is a 400 like any other bad input."""
