"""SGLang frontend programs run against our server through SGLang's own `RuntimeEndpoint`.

Run by tests/test_sglang_client.py with the interpreter of the test-only environment
`.venv-sglang` (the `sglang` pip package without its runtime):

    .venv-sglang/bin/python tests/sglang_programs.py http://127.0.0.1:PORT [API_KEY]

Prints one JSON object: for each program the values it produced and the text SGLang sent (the
prompt of each `gen` is the state's text just before it), and under "requests" every HTTP request
SGLang's client made (url, body, status, and the response body where it was not a stream), for the
test to check against our engine. Nothing here imports radixlm: this is a client of the server only.
"""

from __future__ import annotations

import json
import sys

import sglang as sgl
import sglang.lang.backend.runtime_endpoint as runtime_endpoint
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

REQUESTS: list[dict] = []
_http_request = runtime_endpoint.http_request


def _logged_http_request(url, json=None, stream=False, **kwargs):
    """SGLang's own http_request, recording what was sent and what came back."""
    res = _http_request(url, json=json, stream=stream, **kwargs)
    entry = {"url": url, "body": json, "stream": stream, "status": res.status_code}
    if not stream:
        try:
            entry["response"] = res.json()
        except ValueError:
            entry["response"] = res.text
    REQUESTS.append(entry)
    return res


runtime_endpoint.http_request = _logged_http_request

MAX = 8  # max_tokens of the plain gens: the test must stay fast on a CPU
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@sgl.function
def plain_gen(s, question):
    s += "Q: " + question + "\nA:"
    s["prompt"] = s.text()
    s += sgl.gen("answer", max_tokens=MAX, stop="\n", temperature=0)


@sgl.function
def stop_gen(s):
    s += "Count: one, two, three,"
    s["prompt"] = s.text()
    s += sgl.gen("answer", max_tokens=MAX, stop=[","], temperature=0)


@sgl.function
def logprobs(s):
    s += "The capital of France is"
    s["prompt"] = s.text()
    s += sgl.gen(
        "answer",
        max_tokens=4,
        temperature=0,
        return_logprob=True,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
    )


@sgl.function
def pick(s):
    s += "Q: Is the sky blue on a clear day? Answer yes or no.\nA:"
    s["prompt"] = s.text()
    s += sgl.select("answer", choices=[" yes", " no", " maybe"])
    s += "\nQ: Is fire cold?\nA:"
    s += sgl.select("greedy", choices=[" yes", " no"], choices_method=sgl.greedy_token_selection)


@sgl.function
def chat(s):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user("Name one primary color.")
    s += sgl.assistant_begin()
    s["prompt"] = s.text()
    s += sgl.gen("answer", max_tokens=MAX, temperature=0)
    s += sgl.assistant_end()
    s += sgl.user("And another one?")
    s += sgl.assistant(sgl.gen("second", max_tokens=MAX, temperature=0))


@sgl.function
def branches(s):
    s += "Give two tips for staying healthy.\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"{i + 1}."
        f["prompt"] = f.text()
        f += sgl.gen("tip", max_tokens=MAX, stop=[",", "\n"], temperature=0)
    s["tips"] = [f["tip"] for f in forks]
    s["prompts"] = [f["prompt"] for f in forks]
    for i, f in enumerate(forks):
        s += f"{i + 1}." + f["tip"] + "\n"


@sgl.function
def constrained(s):
    s += "Q: How many legs does a spider have?\nA: "
    s["prompt"] = s.text()
    s += sgl.gen("number", regex=r"[0-9]{1,2}", max_tokens=MAX, temperature=0)
    s += "\nQ: What is the IP address of localhost?\nA: "
    s["ip_prompt"] = s.text()
    s += sgl.gen(
        "ip",
        regex=r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
        max_tokens=16,
        temperature=0,
    )
    s += "\nQ: How many days are in a week?\nA: "
    s["int_prompt"] = s.text()
    s += sgl.gen("as_int", dtype=int, max_tokens=4, temperature=0)
    s += "\nQ: Describe a cat as JSON.\nA: "
    s["json_prompt"] = s.text()
    s += sgl.gen("json", json_schema=json.dumps(SCHEMA), max_tokens=16, temperature=0)


def result(state, *names):
    out = {name: state[name] for name in names}
    out["text"] = state.text()
    return out


def main(url: str, api_key: str | None = None) -> None:
    # SmolLM2 speaks ChatML; SGLang's guess from the model path would be its plain default
    backend = RuntimeEndpoint(url, api_key=api_key, chat_template_name="chatml")
    sgl.set_default_backend(backend)
    results = {"model_path": backend.get_model_name()}

    results["plain_gen"] = result(
        plain_gen.run(question="What is the capital of France?"), "prompt", "answer"
    )
    results["stop_gen"] = result(stop_gen.run(), "prompt", "answer")
    s = logprobs.run()
    results["logprobs"] = {**result(s, "prompt", "answer"), "meta_info": s.get_meta_info("answer")}
    s = pick.run()
    results["pick"] = {
        **result(s, "prompt", "answer", "greedy"),
        "meta_info": s.get_meta_info("answer"),
    }
    s = chat.run()
    results["chat"] = {
        **result(s, "prompt", "answer", "second"),
        "messages": s.messages(),
    }
    results["branches"] = result(branches.run(), "prompts", "tips")
    results["constrained"] = result(
        constrained.run(),
        *("prompt", "number", "ip_prompt", "ip", "int_prompt", "as_int", "json_prompt", "json"),
    )

    questions = ["What is 2 + 2?", "Name a fruit.", "What color is grass?"]
    states = plain_gen.run_batch([{"question": q} for q in questions], num_threads=3)
    results["batch"] = [result(st, "prompt", "answer") for st in states]

    stream = plain_gen.run(question="What is the capital of France?", stream=True)
    pieces = list(stream.text_iter(var_name="answer"))
    results["stream"] = {"pieces": pieces, **result(stream, "answer")}

    backend.flush_cache()
    results["server_info_keys"] = sorted(backend.get_server_info())
    results["requests"] = REQUESTS
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:3])
