"""SGLang's router (`sglang-router`, cache-aware policy) in front of two radixlm workers: it takes
them as healthy, its forwarded requests are served (native /generate and the OpenAI API through
the `openai` client), and requests that share a prefix land on the worker that holds it, so the
workers hit their prefix caches more than under round robin. Loopback only; the router is a
subprocess, the two workers are servers in this process over the tiny random model."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.live_server import free_port, serve_in_thread

pytest.importorskip(
    "sglang_router", reason="sglang-router is not installed (pip install sglang-router)"
)

GROUPS = 3  # odd: round robin over two workers then sends each group to both
PER_GROUP = 4
STARTUP_S = 60
# distinct opening words per group, so that groups share no prefix with each other
TOPICS = ["Rivers", "Volcanoes", "Lighthouses", "Glaciers", "Orchards", "Comets"]


@pytest.fixture(scope="module")
def workers(tiny_model_folder) -> Iterator[list[str]]:
    import radixlm

    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(2):
            engine = stack.enter_context(
                radixlm.Engine(tiny_model_folder, dtype="float32", max_total_tokens=8192)
            )
            urls.append(stack.enter_context(serve_in_thread(engine)))
        yield urls


@contextlib.contextmanager
def router(workers: list[str], policy: str) -> Iterator[str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--worker-urls", *workers, "--policy", policy,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_workers(proc, url, len(workers))
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_workers(proc: subprocess.Popen, url: str, count: int) -> None:
    deadline = time.monotonic() + STARTUP_S
    with httpx.Client(timeout=2) as poller:  # (one SSL context for all the polls)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"the router exited ({proc.returncode}): {proc.stdout.read()}")
            with contextlib.suppress(httpx.HTTPError):
                listed = poller.get(f"{url}/workers").json()["workers"]
                if sum(w["is_healthy"] for w in listed) == count:
                    return
            time.sleep(0.2)
    raise AssertionError(f"the router did not take {count} healthy workers in {STARTUP_S} s")


def prompts(run: str) -> list[tuple[int, str, str]]:
    """(group, shared prefix, prompt) of a shared-prefix workload, interleaved across groups."""
    prefixes = [
        f"{TOPICS[g]} of the {run} atlas. "
        + " ".join(f"{TOPICS[g].lower()}-{run}-{i}" for i in range(24))
        for g in range(GROUPS)
    ]
    return [
        (g, prefixes[g], f"{prefixes[g]}\nQuestion {r}: what comes next?")
        for r in range(PER_GROUP)
        for g in range(GROUPS)
    ]


def counter(metrics: str, name: str) -> float:
    return sum(
        float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", metrics, re.M)
    )


def cache_totals(workers: list[str]) -> tuple[float, float]:
    """(cached prompt tokens, prompt tokens) over the workers, from their /metrics."""
    cached = prompt = 0.0
    for url in workers:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        cached += counter(text, "sglang:cached_tokens_total")
        prompt += counter(text, "sglang:prompt_tokens_total")
    return cached, prompt


def run_workload(url: str, run: str) -> list[tuple[int, str, int]]:
    """Sends the workload through the router, even rounds with the openai client's completions,
    odd rounds to the native /generate; (group, prefix, cached tokens) for each request."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    out = []
    for i, (group, prefix, text) in enumerate(prompts(run)):
        if (i // GROUPS) % 2 == 0:
            done = client.completions.create(model=model, prompt=text, max_tokens=2, temperature=0)
            cached = done.usage.prompt_tokens_details.cached_tokens
        else:
            body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
            r = httpx.post(f"{url}/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            cached = r.json()["meta_info"]["cached_tokens"]
        out.append((group, prefix, cached))
    return out


def holders(workers: list[str], prefix: str) -> list[bool]:
    """Which workers hold `prefix` in their prefix cache: asked directly, bypassing the router."""
    held = []
    for url in workers:
        body = {"text": prefix + "\nProbe.", "sampling_params": {"max_new_tokens": 1}}
        meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
        held.append(meta["cached_tokens"] > meta["prompt_tokens"] // 2)
    return held


def test_the_router_takes_radixlm_workers_and_serves_each_api(workers):
    import openai

    with router(workers, "cache_aware") as url:
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert models and models[0]["id"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        chat = client.chat.completions.create(
            model=models[0]["id"], messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3
        stream = client.chat.completions.create(
            model=models[0]["id"],
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 3
        done = client.completions.create(model=models[0]["id"], prompt="Hello", max_tokens=2)
        assert done.usage.completion_tokens == 2
        body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}, "stream": True}
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 2
        # a field SGLang's own server would act on and radixlm cannot: refused, through the router
        body = {"model": models[0]["id"], "prompt": "Hi", "return_hidden_states": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "return_hidden_states" in r.text, r.text


def test_cache_aware_routing_keeps_each_prefix_group_on_one_worker(workers):
    results = {}
    for policy in ("cache_aware", "round_robin"):
        before = cache_totals(workers)
        with router(workers, policy) as url:
            sent = run_workload(url, policy)
        after = cache_totals(workers)
        cached, prompt = after[0] - before[0], after[1] - before[1]
        # (each probe puts its prefix in both workers' caches: one probe a group, after the run)
        groups = {
            prefix: holders(workers, prefix) for prefix in dict.fromkeys(p for _, p, _ in sent)
        }
        results[policy] = (cached / prompt, groups, sent)

    aware_rate, aware_groups, aware_sent = results["cache_aware"]
    robin_rate, robin_groups, _ = results["round_robin"]
    # cache-aware: each group on exactly one worker (which one, the router decides: while the
    # load is balanced, a new prefix goes where the router's tree is smallest)
    assert all(sum(held) == 1 for held in aware_groups.values()), aware_groups
    # round robin: each group computed on both workers
    assert all(all(held) for held in robin_groups.values()), robin_groups
    # every request after its group's first hit the cache for most of its prompt
    seen = set()
    for group, _, cached in aware_sent:
        if group in seen:
            assert cached > 0, aware_sent
        seen.add(group)
    assert aware_rate > robin_rate + 0.1, (aware_rate, robin_rate)
