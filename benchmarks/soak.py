"""A soak: thousands of mixed requests against a small KV pool, then the books must balance.

    python -m benchmarks.soak [--model-path P | --tiny] [--requests 5000] [--concurrency 24]
                              [--max-total-tokens 600] [--warmup-fraction 0.2] [--seed 0]

`radixlm serve --enable-priority-scheduling --max-total-tokens N` (a pool a fraction of what the
clients ask for at once, so requests are preempted and the prefix cache evicts) on a free loopback
port, with its engine in a process of its own. `--concurrency` clients take the requests of one
seeded list in turn: streamed and not; JSON-schema and regex grammars; `n` of 2 or 3; streams the
client drops after a few events and requests it gives up on before the answer; per-request
deadlines that end generations early; random priorities; the native and the OpenAI routes; and
bad requests, which must be 400s. Prompts share a few prefixes, so the radix cache both hits and
evicts.

Checked (the script exits non-zero otherwise):
- no 5xx and no dropped connection; each request answered as its kind expects (a 400 for the bad
  ones, a 200 otherwise; an output that ended by its grammar matches the grammar; a request past
  its deadline ends with finish_reason abort);
- once the load has passed: nothing running or waiting, every KV slot free or in the prefix cache,
  no prefix-cache node locked (`/server_info`'s engine statistics);
- the resident memory of the server and of the engine process, idle after the warm-up (the first
  `--warmup-fraction` of the requests) and idle at the end, grew by less than 5%.

The RSS is also reported idle after each further tenth of the requests, so a slow leak shows as a
rising line. Results print as Markdown rows for benchmarks/RESULTS.md.

`--tiny` serves a tiny random Llama (2 layers, width 64, the default model's tokenizer, as the
tests' fixture): the mechanics at thousands of requests in minutes on a CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from benchmarks.common import commit, device_line, write_tiny_llama
from benchmarks.overload import engine_stats, kv_whole, rss_mib, wait_idle
from benchmarks.serving import start_server, stop_server

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = r"(yes|no|maybe)( [0-9]{1,3})?"
PREFIXES = (
    "You are a careful assistant. Answer in one short sentence.",
    "System: the user asks about the weather in a city; be brief and polite.",
    "Translate the following sentence into French, keeping its tone:",
    "Summarise this text for a child of ten, in plain words:",
)
WORDS = [
    "the",
    "a",
    "river",
    "city",
    "bright",
    "cold",
    "stone",
    "paper",
    "quick",
    "seven",
    "green",
    "tower",
    "music",
    "slow",
]

# The bad requests: (route, body). Each must be answered 400, whatever else is in flight.
BAD = (
    ("/generate", {"text": "Hi", "sampling_params": {"temperature": -1}}),
    ("/generate", {"text": "Hi", "sampling_params": {"regex": "(unclosed"}}),
    ("/generate", {"text": "Hi", "sampling_params": {"json_schema": "{not json"}}),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": "ten"}}),
    ("/generate", {"text": "Hi", "sampling_params": {"n": 0}}),
    ("/generate", {"text": "Hi", "priority": "high"}),
    ("/generate", {"text": "Hi", "request_timeout": -1}),
    ("/generate", {"input_ids": [10**9]}),
    ("/generate", {"text": ""}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": "two"}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": "nope"}},
        },
    ),
)

KINDS = (  # (kind, weight)
    ("plain", 20),
    ("stream", 14),
    ("n", 8),
    ("json", 8),
    ("regex", 8),
    ("drop_stream", 10),
    ("give_up", 5),
    ("deadline", 7),
    ("chat", 8),
    ("chat_stream_n", 5),
    ("completion_n", 4),
    ("bad", 3),
)


@dataclass
class Spec:
    """One request of the workload: what to send and what kind of answer it expects."""

    kind: str
    route: str
    body: dict[str, Any]
    stream: bool = False
    cut_after: int | None = None  # events read before dropping the stream
    client_timeout: float | None = None  # the client gives up after this many seconds


@dataclass
class Outcome:
    kind: str
    status: int | None  # None: the client dropped it on purpose before an answer
    problem: str | None = None  # an answer its kind did not expect
    finish: list[str] = field(default_factory=list)


def prompt(rng: random.Random) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
    return f"{rng.choice(PREFIXES)} {words}"


def workload(count: int, seed: int, max_new: int) -> list[Spec]:
    """`count` requests drawn from KINDS by weight, reproducibly."""
    rng = random.Random(seed)
    names = [k for k, _ in KINDS]
    weights = [w for _, w in KINDS]
    return [make_spec(rng.choices(names, weights)[0], rng, max_new) for _ in range(count)]


def make_spec(kind: str, rng: random.Random, max_new: int) -> Spec:
    def params(**extra: Any) -> dict[str, Any]:
        return {
            "max_new_tokens": rng.randint(1, max_new),
            "temperature": rng.choice([0.0, 0.7, 1.0]),
            **extra,
        }

    priority = rng.randint(0, 30)
    native = {"text": prompt(rng), "priority": priority}
    chat = [{"role": "user", "content": prompt(rng)}]
    if kind == "plain":
        return Spec(kind, "/generate", {**native, "sampling_params": params(ignore_eos=True)})
    if kind == "stream":
        return Spec(
            kind, "/generate", {**native, "sampling_params": params(), "stream": True}, True
        )
    if kind == "n":
        return Spec(kind, "/generate", {**native, "sampling_params": params(n=rng.choice([2, 3]))})
    if kind == "json":
        body = {**native, "sampling_params": params(json_schema=json.dumps(SCHEMA))}
        body["sampling_params"]["max_new_tokens"] = 24
        return maybe_streamed(Spec(kind, "/generate", body), rng.random() < 0.5)
    if kind == "regex":
        body = {**native, "sampling_params": params(regex=REGEX)}
        body["sampling_params"]["max_new_tokens"] = 12
        return maybe_streamed(Spec(kind, "/generate", body), rng.random() < 0.5)
    if kind == "drop_stream":
        body = {**native, "sampling_params": params(ignore_eos=True), "stream": True}
        body["sampling_params"]["max_new_tokens"] = 4 * max_new
        return Spec(kind, "/generate", body, True, cut_after=rng.randint(0, 4))
    if kind == "give_up":
        body = {**native, "sampling_params": params(ignore_eos=True)}
        body["sampling_params"]["max_new_tokens"] = 8 * max_new
        return Spec(kind, "/generate", body, client_timeout=rng.uniform(0.02, 0.3))
    if kind == "deadline":
        body = {**native, "sampling_params": params(ignore_eos=True)}
        body["sampling_params"]["max_new_tokens"] = 400
        body["request_timeout"] = rng.uniform(0.05, 0.4)
        return maybe_streamed(Spec(kind, "/generate", body), rng.random() < 0.3)
    if kind == "chat":
        body: dict[str, Any] = {"messages": chat, "max_tokens": rng.randint(1, max_new)}
        body["priority"] = priority
        if rng.random() < 0.5:
            schema = {"name": "answer", "schema": SCHEMA}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
            body["max_tokens"] = 24
        return Spec(kind, "/v1/chat/completions", body)
    if kind == "chat_stream_n":
        body = {"messages": chat, "max_tokens": rng.randint(1, max_new), "n": 2, "stream": True}
        return Spec(kind, "/v1/chat/completions", {**body, "priority": priority}, True)
    if kind == "completion_n":
        body = {"prompt": prompt(rng), "max_tokens": rng.randint(1, max_new), "n": 3}
        return Spec(kind, "/v1/completions", {**body, "priority": priority})
    if kind == "bad":
        route, bad = rng.choice(BAD)
        return Spec(kind, route, bad)
    raise ValueError(f"unknown kind {kind!r}")


def maybe_streamed(spec: Spec, stream: bool) -> Spec:
    if stream:
        spec.body["stream"] = spec.stream = True
    return spec


# ---- sending ----------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, url: str, spec: Spec) -> Outcome:
    try:
        if spec.stream:
            return await send_stream(client, url, spec)
        if spec.client_timeout is not None:
            try:
                r = await asyncio.wait_for(
                    client.post(url + spec.route, json=spec.body), spec.client_timeout
                )
            except asyncio.TimeoutError:
                return Outcome(spec.kind, None)  # given up: the server aborts it
        else:
            r = await client.post(url + spec.route, json=spec.body)
    except httpx.HTTPError as e:
        return Outcome(spec.kind, 0, f"{type(e).__name__}: {e}")
    return judge(spec, r.status_code, r.text)


async def send_stream(client: httpx.AsyncClient, url: str, spec: Spec) -> Outcome:
    events: list[Any] = []
    async with client.stream("POST", url + spec.route, json=spec.body) as r:
        if r.status_code != 200:
            return judge(spec, r.status_code, (await r.aread()).decode(errors="replace"))
        if spec.cut_after == 0:
            return Outcome(spec.kind, None)  # gone before the first event
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data != "[DONE]":
                events.append(json.loads(data))
            if spec.cut_after is not None and len(events) >= spec.cut_after:
                return Outcome(spec.kind, None)  # dropped mid-stream: the server aborts it
    return judge_stream(spec, events)


# ---- judging ----------------------------------------------------------------------------------


def judge(spec: Spec, status: int, text: str) -> Outcome:
    if spec.kind == "bad":
        problem = None if status == 400 else f"a bad request answered {status}: {text[:200]}"
        return Outcome(spec.kind, status, problem)
    if status != 200:
        return Outcome(spec.kind, status, f"{spec.route} answered {status}: {text[:300]}")
    body = json.loads(text)
    if spec.route == "/generate":
        items = body if isinstance(body, list) else [body]
        texts = [item["text"] for item in items]
        finish = [reason_of(item["meta_info"]["finish_reason"]) for item in items]
        messages = [item["meta_info"]["finish_reason"] for item in items]
    else:
        choices = body["choices"]
        texts = [c.get("text") or (c.get("message") or {}).get("content") or "" for c in choices]
        finish = [c["finish_reason"] for c in choices]
        messages = finish
    return Outcome(spec.kind, status, check_outputs(spec, texts, finish, messages), finish)


def judge_stream(spec: Spec, events: list[Any]) -> Outcome:
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        return Outcome(spec.kind, 200, f"an error in the stream: {errors[0]}")
    if spec.route == "/generate":
        last = events[-1] if events else None
        if last is None:
            return Outcome(spec.kind, 200, "an empty stream")
        reason = last["meta_info"]["finish_reason"]
        texts, finish = [last["text"]], [reason_of(reason)]
        return Outcome(spec.kind, 200, check_outputs(spec, texts, finish, [reason]), finish)
    parts: dict[int, str] = {}
    finish_by: dict[int, str] = {}
    for event in events:
        for choice in event.get("choices", []):
            k = choice["index"]
            parts[k] = parts.get(k, "") + ((choice.get("delta") or {}).get("content") or "")
            if choice.get("finish_reason"):
                finish_by[k] = choice["finish_reason"]
    want = spec.body.get("n", 1)
    if sorted(finish_by) != list(range(want)):
        return Outcome(spec.kind, 200, f"choices finished: {sorted(finish_by)} of {want}")
    finish = [finish_by[k] for k in range(want)]
    return Outcome(
        spec.kind, 200, check_outputs(spec, [parts[k] for k in range(want)], finish, finish), finish
    )


def reason_of(reason: Any) -> str:
    return reason["type"] if isinstance(reason, dict) else str(reason)


def check_outputs(spec: Spec, texts: list[str], finish: list[str], raw: list[Any]) -> str | None:
    grammar = grammar_of(spec)
    for text, reason, detail in zip(texts, finish, raw):
        if reason not in ("stop", "length", "abort"):
            return f"finish_reason {detail!r}"
        if reason == "abort" and spec.kind != "deadline":
            return f"aborted though nobody asked: {detail!r}"
        if spec.kind == "deadline" and reason == "abort" and "timed out" not in json.dumps(detail):
            return f"a deadline's abort without its reason: {detail!r}"
        if grammar == "json" and reason == "stop":
            try:
                value = json.loads(text)
            except ValueError:
                return f"JSON-schema output that is not JSON: {text!r}"
            if set(value) != {"ok", "n"}:
                return f"JSON-schema output off the schema: {text!r}"
        if grammar == "regex" and reason == "stop" and not re.fullmatch(REGEX, text):
            return f"regex output off the regex: {text!r}"
    return None


def grammar_of(spec: Spec) -> str | None:
    sp = spec.body.get("sampling_params") or {}
    if "json_schema" in sp or "response_format" in spec.body:
        return "json"
    if "regex" in sp:
        return "regex"
    return None


async def run_requests(url: str, specs: list[Spec], concurrency: int) -> list[Outcome]:
    """Send `specs` with `concurrency` clients, each taking the next one when it is done."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    outcomes: list[Outcome | None] = [None] * len(specs)
    next_index = 0
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(specs):
                i = next_index
                next_index += 1
                outcomes[i] = await send(client, url, specs[i])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [o for o in outcomes if o is not None]


# ---- the soak ---------------------------------------------------------------------------------


@dataclass
class SoakResult:
    requests: int
    seconds: float
    outcomes: list[Outcome]
    stats_after: dict[str, Any]
    rss: dict[str, list[float]]  # per process: idle after the warm-up, then after each tenth
    failures: list[str]

    def growth(self, name: str) -> float:
        marks = self.rss[name]
        return marks[-1] / marks[0] - 1


def soak(
    url: str,
    pids: dict[str, int],
    requests: int,
    concurrency: int = 24,
    warmup_fraction: float = 0.2,
    seed: int = 0,
    max_new: int = 16,
    idle_timeout: float = 120,
    max_growth: float = 0.05,
) -> SoakResult:
    """Run the soak against the server at `url` (its processes' ids in `pids`) and check it:
    each process's idle RSS may grow by less than `max_growth` from the warm-up's end."""
    specs = workload(requests, seed, max_new)
    warm = max(1, int(requests * warmup_fraction))
    chunks = [specs[:warm]] + split(specs[warm:], 10)
    rss: dict[str, list[float]] = {name: [] for name in pids}
    outcomes: list[Outcome] = []
    failures: list[str] = []
    start = time.perf_counter()
    for chunk in chunks:
        outcomes += asyncio.run(run_requests(url, chunk, concurrency))
        stats = wait_idle(url, idle_timeout)
        if not kv_whole(stats):
            failures.append(f"KV not whole while idle: {stats}")
        time.sleep(1.5)  # (the engine gives its free heap back after 0.5 s idle)
        for name, pid in pids.items():
            rss[name].append(rss_mib(pid))
    seconds = time.perf_counter() - start
    stats_after = engine_stats(url)
    result = SoakResult(requests, seconds, outcomes, stats_after, rss, failures)
    five = [o for o in outcomes if o.status is not None and o.status >= 500]
    dropped = [o for o in outcomes if o.status == 0]
    wrong = [o for o in outcomes if o.problem]
    if five:
        failures.append(f"{len(five)} answers 5xx, e.g. {five[0]}")
    if dropped:
        failures.append(f"{len(dropped)} connections failed, e.g. {dropped[0]}")
    if wrong:
        failures.append(f"{len(wrong)} answers not as their kind expects, e.g. {wrong[0]}")
    if stats_after["num_running_reqs"] or stats_after["num_waiting_reqs"]:
        failures.append(f"requests still running or waiting: {stats_after}")
    if not kv_whole(stats_after):
        failures.append(f"KV slots leaked or prefix-cache nodes locked: {stats_after}")
    for name in pids:
        if result.growth(name) >= max_growth:
            failures.append(
                f"{name} RSS grew {100 * result.growth(name):.1f}% after the warm-up: "
                f"{rss[name]} MiB"
            )
    return result


def split(items: list, parts: int) -> list[list]:
    size = -(-len(items) // parts)
    return [items[i : i + size] for i in range(0, len(items), size)] if items else []


def serve_options(model_path: str | None, max_total_tokens: int) -> list[str]:
    model = ["--model-path", model_path] if model_path else []
    return [*model, "--max-total-tokens", str(max_total_tokens), "--enable-priority-scheduling"]


def report(result: SoakResult, argv: list[str]) -> None:
    kinds = Counter(o.kind for o in result.outcomes)
    statuses = Counter(
        "dropped by the client" if o.status is None else o.status for o in result.outcomes
    )
    finish = Counter(f for o in result.outcomes for f in o.finish)
    stats = result.stats_after
    print(f"\n`python -m benchmarks.soak {' '.join(argv)}`".rstrip())
    print(f"{time.strftime('%Y-%m-%d')}, commit {commit()}, {device_line()}\n")
    print("| measure | value |\n|---|---|")
    print(f"| requests | {result.requests} in {result.seconds:.0f} s "
          f"({result.requests / result.seconds:.1f} req/s) |")  # fmt: skip
    print(f"| by kind | {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} |")
    print(f"| answers | {', '.join(f'{k}: {v}' for k, v in sorted(statuses.items(), key=str))} |")
    print(
        f"| finish reasons (per choice) | {', '.join(f'{k} {v}' for k, v in sorted(finish.items()))} |"
    )
    print(f"| answers not as expected | {sum(1 for o in result.outcomes if o.problem)} |")
    print(f"| preemptions (of them for priority) | {stats['num_preemptions']} "
          f"({stats['num_priority_preemptions']}) |")  # fmt: skip
    print(f"| prompt tokens; from the prefix cache | {stats['prompt_tokens']}; "
          f"{stats['cached_tokens']} |")  # fmt: skip
    print(
        f"| KV after | {'whole' if kv_whole(stats) else 'NOT whole'} "
        f"({stats['kv_pool_free_tokens']} free + {stats['radix_cache_tokens']} cached of "
        f"{stats['kv_pool_capacity_tokens']}; {stats['radix_cache_protected_tokens']} locked; "
        f"{stats['num_running_reqs']} running, {stats['num_waiting_reqs']} waiting) |"
    )
    for name, marks in result.rss.items():
        line = " / ".join(f"{m:.0f}" for m in marks)
        print(
            f"| {name} RSS idle after the warm-up, then after each tenth | {line} MiB "
            f"({100 * result.growth(name):+.1f}%) |"
        )
    print(json.dumps({"failures": result.failures}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the embedded model")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (mechanics)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--max-total-tokens", type=int, default=600)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--warmup-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-in-process", action="store_true")
    args = parser.parse_args()
    model_path = args.model_path
    if args.tiny:
        model_path = str(write_tiny_llama(Path(tempfile.mkdtemp(prefix="radixlm-soak-tiny-"))))
    serve = SimpleNamespace(engine_in_process=args.engine_in_process)
    with tempfile.NamedTemporaryFile(
        "w", prefix="radixlm-soak-", suffix=".log", delete=False
    ) as log:
        proc, url = start_server(serve, serve_options(model_path, args.max_total_tokens), log)
        try:
            info = httpx.get(url + "/server_info", timeout=30).json()
            pids = {"server": proc.pid}
            if info.get("engine_pid") not in (None, proc.pid):
                pids["engine"] = info["engine_pid"]
            result = soak(
                url, pids, args.requests, args.concurrency, args.warmup_fraction, args.seed,
                args.max_new_tokens,
            )  # fmt: skip
        finally:
            stop_server(proc)
    report(result, sys.argv[1:])
    if result.failures:
        raise SystemExit("FAILED: " + "; ".join(result.failures))


if __name__ == "__main__":
    main()
