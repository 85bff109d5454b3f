"""The one exception a grammar problem raises."""

from __future__ import annotations


class GrammarError(ValueError):
    """A grammar, schema or regex that cannot be compiled or enforced; the message says why.

    Per-request by nature: the engine turns it into an error for that request only.
    """
