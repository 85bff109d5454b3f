"""A JSON schema made ready for llguidance: the rewrites of schema_rewrite.py in order, and the
oneOfs it must not judge itself refused. Pure Python over the standard library (and the modules
of this folder that are), so that it also runs in a helper process (dfa_process.py): there it
holds no GIL of the engine's, where many compiles at once would otherwise queue for it."""

from __future__ import annotations

import json

from radixlm.constrained.errors import GrammarError, cannot_enforce
from radixlm.constrained.schema_rewrite import (
    NumberLimits,
    bound_numbers,
    close_objects,
    one_of_as_any_of,
    reachable_subschemas,
    share_numbers,
)

# The widest bounds llguidance reads (as doubles): an integer bound at 2**63 or past it, or a
# number bound past 10**18, is refused or narrowed by llguidance itself
INTEGER_LIMIT = 9 * 10**18
NUMBER_LIMIT = 10**18


def prepare_schema(
    spec: str, lenient: bool, allow_unlisted: bool, numbers: NumberLimits
) -> tuple[str, dict[str, str]]:
    """(the schema llguidance compiles, as JSON text; the oneOfs left as they are: pointer ->
    why their branches may overlap). Those a value is checked against are refused here
    (GrammarError), unless `lenient` (llguidance then generates them as anyOf, and says so):
    llguidance would otherwise judge them itself, on the objects this closed, which can make
    branches exclusive whose values still match two of the branches as written."""
    from radixlm.constrained.json_schema import one_of_exclusivity  # (it imports this folder)

    try:
        schema = json.loads(spec)
    except ValueError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object or a boolean")
    overlapping: dict[str, str] = {}
    if isinstance(schema, dict):
        narrowed = schema if allow_unlisted else close_objects(schema)
        exclusivity = one_of_exclusivity(schema, None if narrowed is schema else narrowed)
        overlapping = {where: why for where, why in exclusivity.items() if why is not None}
        if overlapping and not lenient:
            reachable = reachable_subschemas(schema)
            refused = [
                f"unsupported keyword 'oneOf' at {where}: {why}"
                for where, why in overlapping.items()
                if reachable is None or where in reachable
            ]
            if refused:
                raise GrammarError(cannot_enforce(refused[:1]))
        exclusive = [where for where, why in exclusivity.items() if why is None]
        schema = one_of_as_any_of(narrowed, exclusive)
        schema = bound_numbers(schema, numbers, fit=(INTEGER_LIMIT, NUMBER_LIMIT))
        # (the bounds make llguidance's lexer costlier to build: once per distinct bound)
        schema = share_numbers(schema)
    # as text: a dict with an integer past 64 bits (a bound of 10**20) is refused
    return json.dumps(schema, ensure_ascii=False), overlapping
