"""A JSON extraction pipeline: facts from a list of texts, each answer constrained by a JSON schema.

    python examples/json_extraction.py                           # the embedded default model, in-process
    python examples/json_extraction.py --url http://127.0.0.1:30000   # a running `radixlm serve`

The programs of a batch run concurrently and share their constant prefix (the instructions and the
worked examples) in the prefix cache; every answer parses, because decoding follows the schema.

What makes this reliable on a small model (the default, SmolLM2-135M-Instruct):
- worked examples as chat turns (a text, then its JSON), compact as the output will be: the model
  copies their shape;
- a schema per text whose values can only be copied from that text: the name and the city are
  runs of capitalized words in it (and not the same run), the year one of its four-digit numbers.
  Left free, a 135M model writes fluent, well-formed and wrong values ("born in 1815" read as
  1802, "Ulm" as "Alberta"); made to choose among the text's own words, it chooses well.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import radixlm as sgl

# The shape every answer has; `schema_for` narrows its values to those a given text contains.
# (A dict, a JSON string or a pydantic model class all work as a schema.)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "birth_year": {"type": "integer", "minimum": 0, "maximum": 2100},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "birth_year", "city"],
    "additionalProperties": False,
}

TEXTS = [
    "Ada Lovelace was born in 1815 in London.",
    "Alan Turing, born 1912 in London, founded computer science.",
    "Marie Curie was born in Warsaw in 1867.",
    "Albert Einstein was born in 1879 in Ulm, Germany.",
    "Grace Hopper (born 1906, New York City) wrote one of the first compilers.",
]

INSTRUCTIONS = (
    "You extract facts about a person from a text as JSON: name, birth_year, city. "
    "Copy each value from the text."
)
WORKED_EXAMPLES = [
    (
        "Isaac Newton was born in 1643 in Woolsthorpe.",
        {"name": "Isaac Newton", "birth_year": 1643, "city": "Woolsthorpe"},
    ),
    (
        "Louis Pasteur was born in 1822 in Dole, France.",
        {"name": "Louis Pasteur", "birth_year": 1822, "city": "Dole"},
    ),
    (
        "Born 1756 in Salzburg, Wolfgang Amadeus Mozart composed over 600 works.",
        {"name": "Wolfgang Amadeus Mozart", "birth_year": 1756, "city": "Salzburg"},
    ),
]

_CAPITALIZED_RUN = re.compile(r"[A-Z][\w'-]*(?: [A-Z][\w'-]*)*")
_YEAR = re.compile(r"\b[0-9]{4}\b")


def schema_for(text: str) -> dict[str, Any]:
    """PERSON, with each value one that `text` contains: one schema per possible name, in which
    the city is any other run of capitalized words. Where the text has no candidates for a field,
    that field stays as free as in PERSON."""
    runs = list(dict.fromkeys(_CAPITALIZED_RUN.findall(text)))
    years = list(dict.fromkeys(int(y) for y in _YEAR.findall(text)))
    free = PERSON["properties"]

    def person(name: str | None, cities: list[str]) -> dict[str, Any]:
        properties = {
            "name": {"const": name} if name else free["name"],
            "birth_year": {"enum": years} if years else free["birth_year"],
            "city": {"enum": cities} if cities else free["city"],
        }
        return {**PERSON, "properties": properties}

    if not runs:
        return person(None, [])
    return {"anyOf": [person(name, [r for r in runs if r != name]) for name in runs]}


@sgl.function
def extract(s, text):
    s += sgl.system(INSTRUCTIONS)
    for example, facts in WORKED_EXAMPLES:
        s += sgl.user(example)
        s += sgl.assistant(json.dumps(facts, separators=(",", ":")))
    s += sgl.user(text)
    s += sgl.assistant(sgl.gen("info", max_tokens=64, json_schema=schema_for(text)))


def main(backend=None, texts: list[str] = TEXTS, progress_bar: bool = True) -> list[dict | None]:
    """One dict per text (None where the program failed)."""
    states = extract.run_batch(
        [{"text": t} for t in texts], backend=backend, temperature=0, progress_bar=progress_bar
    )
    results: list[dict | None] = []
    for text, state in zip(texts, states):
        if state.error() is not None:
            print(f"{text!r}: failed: {state.error()}")
            results.append(None)
            continue
        info = json.loads(state["info"])
        print(f"{text!r}\n  -> {info}")
        results.append(info)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a radixlm server (default: an in-process engine)")
    args = parser.parse_args()
    if args.url:
        main(sgl.RuntimeEndpoint(args.url))
    else:
        with sgl.Engine() as engine:  # shut down when done
            main(engine)
