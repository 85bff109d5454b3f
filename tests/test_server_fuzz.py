"""schemathesis fuzzes every route of the server's OpenAPI document against `radixlm serve` (its
engine in a process of its own, the tiny random model): well over a thousand generated requests,
bodies that follow the documented schemas and bodies that break them, and not one 5xx; every
response's status and error body are as documented; and the server still generates afterwards.

The document must describe the request bodies (server/openapi.py), or the fuzzer would send
nothing to the routes' validation code; the first test checks that it does."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import (
    response_schema_conformance,
    status_code_conformance,
)

from tests.test_server_process import Server

# Generation is cheap for the fuzzer: the lengths and sample counts it draws are held down to
# these (a smaller value, a negative one or a wrong type still goes through as drawn).
_TOKEN_FIELDS = ("max_tokens", "max_new_tokens", "max_completion_tokens", "max_output_tokens")
_MAX_TOKENS = 4
_COUNT_FIELDS = ("n", "best_of", "top_logprobs_num", "top_logprobs", "logprobs")
_MAX_COUNT = 2
# and a body that leaves the length out gets the server's limit, not the rest of the tiny model's
# context (some 500 tokens: seconds a request, most of the test's time)
_NEW_TOKENS_LIMIT = 16
# requests per route and kind of input (valid, invalid): a route whose inputs are fewer gets them all
_EXAMPLES = 46
_MIN_CASES = 1000
# the profiler's routes last: while it runs every engine step is recorded
_LAST = ("/start_profile", "/stop_profile")


@pytest.fixture(scope="module")
def server(tiny_model_folder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    srv = Server(
        tiny_model_folder, folder / "server.log", "--request-timeout", "20",
        "--max-new-tokens-limit", str(_NEW_TOKENS_LIMIT),
    )  # fmt: skip
    srv.trace_dir = folder / "traces"
    yield srv
    srv.stop()


def _cheap(value: Any, trace_dir: str) -> Any:
    """The body with its lengths and counts held down and the profiler's folder inside the
    test's own (in place)."""
    if isinstance(value, list):
        for item in value:
            _cheap(item, trace_dir)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key in _TOKEN_FIELDS and _is_int(item) and item > _MAX_TOKENS:
                value[key] = _MAX_TOKENS
            elif key in _COUNT_FIELDS and _is_int(item) and item > _MAX_COUNT:
                value[key] = _MAX_COUNT
            elif key == "output_dir" and isinstance(item, str):
                value[key] = trace_dir
            else:
                _cheap(item, trace_dir)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def test_the_document_describes_every_body_the_routes_read(server):
    document = httpx.get(server.url + "/openapi.json").json()
    paths = document["paths"]
    for path in (
        "/generate",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        "/abort_request",
        "/concate_and_append_request",
    ):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[1]
        assert document["components"]["schemas"][name]["properties"], path
    # the OpenAI structs refuse unknown fields, and the document says so
    assert document["components"]["schemas"]["CompletionRequest"]["additionalProperties"] is False


def _fuzz(operation: Any, mode: Any, url: str, trace_dir: str, cases: dict, failures: list) -> None:
    """Send `_EXAMPLES` generated requests to one operation, counting them in `cases` and
    recording in `failures` each whose response a check refuses."""
    label = f"{operation.method.upper()} {operation.path}"
    checks = [not_a_server_error, status_code_conformance, response_schema_conformance]
    try:
        strategy = operation.as_strategy(generation_mode=mode)
    except Exception:  # nothing to break: no body or parameters
        return

    @settings(
        max_examples=_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests every run: a failure here reproduces
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def fuzz(case: Any) -> None:
        if isinstance(case.body, (dict, list)):
            _cheap(case.body, trace_dir)
        response = case.call(base_url=url, timeout=60)
        cases[label] = cases.get(label, 0) + 1
        try:
            case.validate_response(response, checks=checks)
        except (Failure, FailureGroup) as e:
            body = case.body if isinstance(case.body, (dict, list, str)) else None
            failures.append(
                f"{label} -> {response.status_code} {response.text[:300]!r}\n"
                f"  body: {str(body)[:500]}\n  {str(e)[:500]}"
            )

    try:
        fuzz()
    except Unsatisfiable:  # (negative mode: nothing of the request can be made invalid)
        if mode != schemathesis.GenerationMode.NEGATIVE:
            raise


@pytest.mark.slow  # (over 1,000 generated requests: minutes on two cores)
def test_fuzzed_requests_to_every_route_get_no_5xx_and_the_server_still_generates(server):
    schema = schemathesis.openapi.from_dict(httpx.get(server.url + "/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    operations.sort(key=lambda op: _LAST.index(op.path) + 1 if op.path in _LAST else 0)
    failures: list[str] = []
    cases: dict[str, int] = {}
    started = time.monotonic()
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            _fuzz(operation, mode, server.url, str(server.trace_dir), cases, failures)
    elapsed = time.monotonic() - started
    total = sum(cases.values())
    assert not failures, f"{len(failures)} of {total} fuzzed requests failed:\n" + "\n".join(
        failures[:20]
    )
    assert total >= _MIN_CASES, f"only {total} cases in {elapsed:.0f} s: {cases}"
    assert len(cases) == len({f"{o.method.upper()} {o.path}" for o in operations})

    # healthy afterwards: a real generation, and no request left holding KV
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    reply = httpx.post(
        server.url + "/generate",
        json={"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8}},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["meta_info"]["completion_tokens"] >= 1
