"""A JSON extraction pipeline: facts from a list of texts, each answer constrained by a JSON schema.

    python examples/json_extraction.py                           # the embedded default model, in-process
    python examples/json_extraction.py --url http://127.0.0.1:30000   # a running `radixlm serve`

The programs of a batch run concurrently and share their constant prefix (the system prompt) in the
prefix cache; every answer parses, because decoding follows the schema.
"""

from __future__ import annotations

import argparse
import json

import radixlm as sgl

# a dict, a JSON string or a pydantic model class all work as a schema
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
]


@sgl.function
def extract(s, text):
    s += sgl.system(
        "You extract facts about a person as JSON: name, birth_year, city. Example: "
        '"Isaac Newton was born in 1643 in Woolsthorpe." -> '
        '{"name":"Isaac Newton","birth_year":1643,"city":"Woolsthorpe"}'
    )
    s += sgl.user(text)
    s += sgl.assistant(sgl.gen("info", max_tokens=64, json_schema=PERSON))


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
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine()
    main(backend)
