"""SGLang's own test programs (`sglang/test/test_programs.py`) through its `RuntimeEndpoint`.

Run by tests/test_sglang_client.py with the interpreter of the test-only environment
`.venv-sglang` (the `sglang` pip package without its runtime):

    .venv-sglang/bin/python tests/sglang_test_programs.py URL API_KEY MAX_NEW_TOKENS TIMEOUT [NAME...]

The programs run side by side, each in its own thread (the server batches their requests), with
`check_answer=False` where a program takes it (the answers of a small model are not the point
here). Prints one JSON object: under "available" the names of all of SGLang's test programs, under
"results", for each program run: "passed"; or "failed", with the exception and
whether it was raised by the program's own check of the model's answer (an `assert` or a
`json.loads` in test_programs.py's code) rather than anywhere else (SGLang's client, the
protocol); or "timeout" (still running after TIMEOUT seconds), with where it waits.

Two things are shaped so that the programs fit a test on a CPU, and said here:
- every gen's `max_new_tokens` is capped at MAX_NEW_TOKENS, unless it asks for more than that
  (`min_new_tokens`): the programs check what comes back, not how long it is;
- `test_gen_min_new_tokens` counts the answer's tokens with `sglang.srt`'s `get_tokenizer`, which
  needs the runtime's dependencies; it is given the server's own tokenizer instead, through our
  `/tokenize` (the model's tokenizer, as SGLang's would load it from the model path).
Nothing here imports radixlm: this is a client of the server only.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
import types
import urllib.request

import sglang as sgl
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

# test_programs.py's functions, with the arguments SGLang's own backend test passes
PROGRAMS = {
    "few_shot_qa": {},
    "mt_bench": {},
    "select": {"check_answer": False},
    "decode_int": {},
    "decode_json_regex": {},
    "decode_json": {},
    "expert_answer": {"check_answer": False},
    "tool_use": {},
    "react": {},
    "parallel_decoding": {},
    "parallel_encoding": {"check_answer": False},
    "stream": {},
    "stream_logprobs": {},
    "regex": {},
    "dtype_gen": {},
    "gen_min_new_tokens": {},
}


class _ServerTokenizer:
    """`encode` through the server's /tokenize: the model's tokenizer, as the server runs it."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url, self.api_key = url, api_key

    def encode(self, text: str) -> list[int]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = json.dumps({"prompt": text}).encode()
        request = urllib.request.Request(self.url + "/tokenize", body, headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())["tokens"]


def _install_tokenizer(url: str, api_key: str | None) -> None:
    module = types.ModuleType("sglang.srt.utils.hf_transformers_utils")
    module.get_tokenizer = lambda *args, **kwargs: _ServerTokenizer(url, api_key)
    sys.modules[module.__name__] = module


def _cap_max_new_tokens(backend: RuntimeEndpoint, cap: int) -> None:
    for name in ("generate", "generate_stream"):
        real = getattr(backend, name)

        def capped(s, sampling_params, _real=real):
            if (sampling_params.min_new_tokens or 0) <= cap:  # (else it asks for a long text)
                sampling_params.max_new_tokens = min(sampling_params.max_new_tokens, cap)
            return _real(s, sampling_params)

        setattr(backend, name, capped)


def _outcome(error: BaseException) -> dict:
    frames = traceback.extract_tb(error.__traceback__)
    own = [i for i, f in enumerate(frames) if f.filename.endswith("test_programs.py")]
    # the program's own check of the answer: an assert in test_programs.py's code, or its
    # json.loads of the output (not an error in SGLang's client under it)
    answer_check = bool(own) and (
        (isinstance(error, AssertionError) and own[-1] == len(frames) - 1)
        or (
            isinstance(error, json.JSONDecodeError) and frames[own[-1]].line.find("json.loads") >= 0
        )
    )
    return {
        "status": "failed",
        "error": f"{type(error).__name__}: {error}"[:2000],
        "answer_check": answer_check,
        "where": [f"{f.filename}:{f.lineno} {f.name}" for f in frames[-4:]],
    }


def _run(program, kwargs: dict, result: dict) -> None:
    t0 = time.monotonic()
    try:
        program(**kwargs)
        result["status"] = "passed"
    except BaseException as e:
        result.update(_outcome(e))
    result["seconds"] = round(time.monotonic() - t0, 1)


def main(url: str, api_key: str, cap: str, timeout: str, *names: str) -> None:
    """Run the programs side by side (the server batches them), each in its own thread; one
    still running after `timeout` seconds is reported with where it waits."""
    _install_tokenizer(url, api_key or None)
    from sglang.test import test_programs

    backend = RuntimeEndpoint(url, api_key=api_key or None, chat_template_name="chatml")
    _cap_max_new_tokens(backend, int(cap))
    backend.endpoint = backend  # test_gen_min_new_tokens reads the model path from a Runtime's
    sgl.set_default_backend(backend)
    results: dict[str, dict] = {}
    threads = {}
    for name in names or PROGRAMS:
        results[name] = {"status": "running"}
        program = getattr(test_programs, f"test_{name}")
        thread = threading.Thread(
            target=_run, args=(program, PROGRAMS[name], results[name]), daemon=True
        )
        thread.start()
        threads[name] = thread
    deadline = time.monotonic() + float(timeout)
    for thread in threads.values():
        thread.join(max(0.0, deadline - time.monotonic()))
    frames = sys._current_frames()
    for name, thread in threads.items():
        if thread.is_alive():
            stack = traceback.extract_stack(frames[thread.ident])
            results[name] = {
                "status": "timeout",
                "error": f"still running after {timeout} s",
                "where": [f"{f.filename}:{f.lineno} {f.name}" for f in stack[-4:]],
            }
    available = sorted(n.removeprefix("test_") for n in dir(test_programs) if n.startswith("test_"))
    print(json.dumps({"results": results, "available": available}), flush=True)
    # a program that timed out leaves SGLang's worker threads waiting forever
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
