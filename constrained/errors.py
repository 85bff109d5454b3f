"""The one exception a grammar problem raises."""

from __future__ import annotations


class GrammarError(ValueError):
    """A grammar, schema or regex that cannot be compiled or enforced; the message says why.

    Per-request by nature: the engine turns it into an error for that request only.
    """


def cannot_enforce(unsupported: list[str]) -> str:
    """The refusal of a JSON schema with keywords that cannot be enforced exactly."""
    return (
        f"the JSON schema cannot be enforced exactly: {'; '.join(unsupported)}; remove or "
        "rewrite it, or set json_schema_lenient to generate without it and have the output "
        "validated"
    )
