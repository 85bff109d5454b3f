"""What a JSON-schema constraint costs, and what jump-forward saves, end to end on the real model.

    python -m benchmarks.constrained_throughput [--batch 32]
    python -m benchmarks.constrained_throughput --distinct 96 [--schemas-dir DIR]

0. (--distinct N) Schema diversity, as JSON-extraction and tool-calling traffic brings it: N
   requests, each with a different real-world schema (MaskBench files from ../shared/data/schemas,
   sorted names, index floor(i * count / N)), all submitted at once as streams on a fresh engine
   (every grammar compiles while the others decode), then the same again (every grammar cached);
   against the same prompts unconstrained, each for as many tokens as its constrained twin made
   (ignore_eos). Output tokens/s of both and the ratio; time to first token of the constrained
   requests; refused schemas (they fail alone) and whether every finished output validates.

1. Mask cost: the same prompts generated under a JSON schema (jump-forward off, so every token is
   sampled under a mask) and unconstrained for the same number of tokens; output tokens/s of both,
   at batch 1 and at --batch.
2. Jump-forward: a schema with long fixed keys, jump-forward off and on: forward steps, output
   tokens, wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import radixlm
from benchmarks.common import commit, device_line

DEFAULT_SCHEMAS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "schemas"

LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 6,
            "maxItems": 6,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "integer", "maximum": 999999},
        "customer_primary_email_address": {"type": "string", "maxLength": 30},
        "customer_preferred_contact_channel": {"enum": ["email", "phone", "post"]},
        "customer_account_creation_year": {"type": "integer", "minimum": 1990, "maximum": 2030},
    },
    "required": [
        "customer_identification_number", "customer_primary_email_address",
        "customer_preferred_contact_channel", "customer_account_creation_year",
    ],
    "additionalProperties": False,
}  # fmt: skip


def run(engine, prompts, params):
    before = engine.get_stats()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    after = engine.get_stats()
    tokens = sum(len(o["output_ids"]) for o in outs)
    return outs, wall, tokens, after["num_steps"] - before["num_steps"]


def check_json(outs) -> None:
    """Every finished output parses; one cut off by max_new_tokens is reported as length."""
    for o in outs:
        if o["meta_info"]["finish_reason"]["type"] != "length":
            json.loads(o["text"])


def distinct_schemas(folder: Path, count: int) -> list[tuple[str, dict]]:
    names = sorted(p.name for p in folder.glob("*.json"))
    picked = [names[(i * len(names)) // count] for i in range(count)]
    return [(n, json.loads((folder / n).read_text())["schema"]) for n in picked]


async def _stream_all(engine, prompts, params_list, arrivals: list | None = None):
    """Every request as its own stream, all at once: (outputs, wall s, first-token latencies).
    arrivals: gets (seconds since the start, output tokens) of each chunk streamed."""

    async def one(prompt, params):
        t0 = time.perf_counter()
        first, last, made = None, None, 0
        try:
            stream = await engine.async_generate(prompt, params, stream=True)
        except ValueError as e:  # a refused grammar: this request alone fails
            abort = {"type": "abort", "message": str(e)}
            return {"text": "", "output_ids": [], "meta_info": {"finish_reason": abort}}, None
        async for snap in stream:
            if first is None and snap["output_ids"]:
                first = time.perf_counter() - t0
            if arrivals is not None and len(snap["output_ids"]) > made:
                arrivals.append((time.perf_counter() - t, len(snap["output_ids"]) - made))
                made = len(snap["output_ids"])
            last = snap
        return last, first

    t = time.perf_counter()
    results = await asyncio.gather(*(one(p, q) for p, q in zip(prompts, params_list)))
    return [r[0] for r in results], time.perf_counter() - t, [r[1] for r in results]


class _FullCollections:
    """Python's full garbage collections (generation 2) while the block runs: how many, and the
    longest (a full pass stops every request; the engine freezes what is alive at start so that
    its passes are short, unless disable_gc_freeze)."""

    def __enter__(self):
        import gc

        self.took: list[float] = []
        self._began = 0.0
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.took.append(time.perf_counter() - self._began)

    def __str__(self) -> str:
        longest = f", the longest {1e3 * max(self.took):.1f} ms" if self.took else ""
        return f"{len(self.took)} full garbage collections{longest}"


def _timeline(arrivals: list, window: float = 0.05) -> str:
    """Output tokens streamed in each `window` seconds from the start, as a list of counts."""
    if not arrivals:
        return "-"
    bins = [0] * (int(max(t for t, _ in arrivals) / window) + 1)
    for t, n in arrivals:
        bins[int(t / window)] += n
    return " ".join(str(b) for b in bins)


def distinct_workload(engine, schemas: list[tuple[str, dict]], max_new_tokens: int):
    """(prompts, constrained params) of the schema-diversity workload: a chat prompt and a greedy
    JSON-schema request per schema, after a warm-up that compiles the device kernels of every
    kind of step it runs (mixed prompt and decode steps, masked sampling) under a schema not
    among them, so that each of theirs still compiles in a first (cold) run."""
    prompts = [
        engine.apply_chat_template(
            [{"role": "user", "content": f"Write one JSON example of {name[:-5]}, as JSON."}]
        )
        for name, _ in schemas
    ]
    listed = {"max_new_tokens": 8, "temperature": 0, "json_schema": json.dumps(LIST_SCHEMA)}
    warm = [listed, {"max_new_tokens": 8}] * 8
    asyncio.run(_stream_all(engine, [prompts[i % len(prompts)] for i in range(16)], warm))
    cons = [
        {"max_new_tokens": max_new_tokens, "temperature": 0, "json_schema": json.dumps(s)}
        for _, s in schemas
    ]
    return prompts, cons


def unconstrained_twins(outs: list[dict]) -> tuple[list[int], list[dict]]:
    """The requests not refused (their indices), and for each the unconstrained params of its
    twin: as many tokens as it made, greedy, EOS ignored."""
    ok = [i for i, o in enumerate(outs) if o["meta_info"]["finish_reason"]["type"] != "abort"]
    free = [
        {"max_new_tokens": max(1, len(outs[i]["output_ids"])), "temperature": 0,
         "ignore_eos": True}
        for i in ok
    ]  # fmt: skip
    return ok, free


def run_distinct(
    model_path,
    folder: Path,
    count: int,
    max_new_tokens: int,
    backend: str,
    profile: int = 0,
    stub_model: bool = False,
    cold_runs: int = 1,
    **engine_args,
) -> None:
    import jsonschema

    schemas = distinct_schemas(folder, count)
    if stub_model:
        engine_args = {"load_format": "dummy", "device": "cpu", **engine_args}
    with radixlm.Engine(model_path, grammar_backend=backend, **engine_args) as eng:
        if stub_model:
            _stub(eng, count)
        prompts, cons = distinct_workload(eng, schemas, max_new_tokens)
        rows, hosts = [], []
        labels = ["cold (compiles)"] * cold_runs + ["warm (cached)"]
        for k, label in enumerate(labels):
            if k and label.startswith("cold"):
                eng.grammar_compiler().clear_cache()  # (cold again: every grammar compiles)
            before = eng.get_stats()
            arrivals: list = []
            with _FullCollections() as collections:
                outs, wall, ttft = asyncio.run(_stream_all(eng, prompts, cons, arrivals))
            host = f"{_host_per_step(before, eng.get_stats(), wall)}; {collections}"
            ok, free = unconstrained_twins(outs)
            tokens = sum(len(outs[i]["output_ids"]) for i in ok)
            invalid = 0
            for i in ok:
                if outs[i]["meta_info"]["finish_reason"]["type"] == "stop":
                    try:
                        jsonschema.validate(json.loads(outs[i]["text"]), schemas[i][1])
                    except Exception:
                        invalid += 1
            before = eng.get_stats()
            f_arrivals: list = []
            with _FullCollections() as collections:
                f_outs, f_wall, _ = asyncio.run(
                    _stream_all(eng, [prompts[i] for i in ok], free, f_arrivals)
                )
            f_host = f"{_host_per_step(before, eng.get_stats(), f_wall)}; {collections}"
            hosts.append((label, host, f_host, _timeline(arrivals), _timeline(f_arrivals)))
            f_tokens = sum(len(o["output_ids"]) for o in f_outs)
            first = sorted(ttft[i] for i in ok if ttft[i] is not None)
            rows.append((label, len(ok), tokens, wall, f_tokens, f_wall, first, invalid))
            refused = [
                (schemas[i][0], outs[i]["meta_info"]["finish_reason"]["message"][:90])
                for i in range(count)
                if i not in ok
            ]
        alone = _compiles_alone(eng, [json.dumps(s) for _, s in schemas])
        profiled = ""
        for label in ("cold", "warm") if profile else ():  # once more each, profiled
            if label == "cold":
                eng.grammar_compiler().clear_cache()
            prof = _profile_core(eng)
            asyncio.run(_stream_all(eng, prompts, cons))
            profiled += f"{label}:\n" + _profile_report(eng, prof, profile)
    extra = "".join(f", {k}={v}" for k, v in engine_args.items())
    print(f"\n{count} requests, {count} distinct schemas, grammar_backend={backend}{extra}")
    print(f"refused (each failed alone): {len(refused)}")
    for name, why in refused:
        print(f"  {name}: {why}")
    print(
        "\n| run | accepted | constrained out tok | wall s | tok/s | unconstrained tok/s | ratio "
        "| TTFT p50 / p99 s | invalid |\n|---|---|---|---|---|---|---|---|---|"
    )
    for label, n, tok, wall, f_tok, f_wall, first, invalid in rows:
        p50 = statistics.median(first) if first else float("nan")
        p99 = first[min(len(first) - 1, int(0.99 * len(first)))] if first else float("nan")
        print(
            f"| {label} | {n} | {tok} | {wall:.2f} | {tok / wall:.0f} | {f_tok / f_wall:.0f} "
            f"| {(tok / wall) / (f_tok / f_wall):.2f}x | {p50:.2f} / {p99:.2f} | {invalid} |"
        )
    print(f"\nthe same grammars compiled alone (engine idle, cache cleared): {alone}")
    print("\nthe engine core's host time (wait: for the device):")
    for label, host, f_host, _, _ in hosts:
        print(f"  {label}: constrained {host}\n  {'':{len(label)}}  unconstrained {f_host}")
    print("\noutput tokens streamed in each 50 ms from the start:")
    for label, _, _, timeline, f_timeline in hosts:
        print(f"  {label}: constrained {timeline}\n  {'':{len(label)}}  unconstrained {f_timeline}")
    if profile:
        print(
            "\nthe engine core thread in a cold and a warm run after the timed ones (cProfile, "
            "by own time):\n"
        )
        print(profiled)


def _compiles_alone(engine, specs: list[str]) -> str:
    """Every spec's compile submitted at once to the engine's grammar compiler (its cache
    cleared) while the engine is idle: when each is done, from the submission. The time to
    first token of a cold run is this plus what sharing the host with the engine adds."""
    from concurrent.futures import wait

    compiler = engine.grammar_compiler()
    compiler.clear_cache()
    time.sleep(1.0)  # (past the engine core's own work as it goes idle: engine_core.py)
    t0 = time.perf_counter()
    done_at: list[float] = []

    def stamp(_):
        done_at.append(time.perf_counter() - t0)

    futures = []
    for spec in specs:
        futures.append(compiler.compile_async("json_schema", spec))
        futures[-1].add_done_callback(stamp)
    submitted = time.perf_counter() - t0
    wait(futures)
    ms = sorted(1e3 * t for t in done_at)
    return (
        f"{len(specs)} compiles submitted in {1e3 * submitted:.0f} ms, all done in {ms[-1]:.0f} "
        f"ms; each done after p50 {statistics.median(ms):.0f} / p90 "
        f"{ms[int(0.9 * (len(ms) - 1))]:.0f} ms"
    )


def _stub(engine, rows: int, bank: int = 16) -> None:
    """Replace the model by one that returns logits at once, so that the wall time is the host's
    work alone (as on a GPU at this batch size, where the device waits for the host): the real
    tokenizer and vocabulary, one of `bank` fixed random logits tensors each step, the decode
    steps through the CUDA-graph code path run eagerly."""
    import torch

    from radixlm.runtime.cuda_graph import DecodeGraphs

    runner = engine._core.runner
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    logits = [torch.randn(rows + 8, vocab, generator=gen) for _ in range(bank)]
    step = [0]

    def model(batch, backend):
        step[0] += 1
        n = batch.num_tokens if batch.logits_indices is None else len(batch.logits_indices)
        if n > rows + 8:
            return torch.randn(n, vocab, generator=gen)
        return logits[step[0] % bank][:n]

    runner.model = model
    runner.graphs = DecodeGraphs(
        model, runner.backend, runner.req_to_token, runner.token_buf, rows + 8, capture=False
    )


def _profile_core(engine):
    """A cProfile of the engine core's thread, started there between two steps."""
    import cProfile

    prof = cProfile.Profile()
    engine._core.call(prof.enable)
    return prof


def _profile_report(engine, prof, top: int) -> str:
    import io
    import pstats

    engine._core.call(prof.disable)
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats(os.environ.get("RADIXLM_PROFILE_SORT", "tottime")).print_stats(top)
    return out.getvalue()


def _host_per_step(before: dict, after: dict, wall: float) -> str:
    """The engine core's time per step by phase between two stats snapshots, in ms."""
    steps = max(1, after["num_steps"] - before["num_steps"])
    phases = [k for k in after if k.startswith("host_seconds_")]
    parts = [
        f"{k.removeprefix('host_seconds_')} {(after[k] - before[k]) / steps * 1e3:.2f}"
        for k in phases
    ]
    counts = {
        k: after[k] - before[k]
        for k in ("graph_steps", "prefill_graph_steps", "overlapped_steps", "jump_forward_tokens")
    }
    kinds = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items())
    return f"{steps} steps ({kinds}); ms/step: wall {wall / steps * 1e3:.2f}, " + ", ".join(parts)


def _engine_arg(text: str) -> tuple[str, object]:
    name, _, value = text.partition("=")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--distinct", type=int, default=0, help="run only the distinct-schema workload")
    ap.add_argument("--schemas-dir", type=Path, default=DEFAULT_SCHEMAS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--grammar-backend", default="llguidance")
    ap.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="with --distinct: then a cold and a warm constrained run, profiled: the N "
        "functions of the engine core thread with the most own time (cProfile)",
    )  # fmt: skip
    ap.add_argument(
        "--cold-runs", type=int, default=1,
        help="with --distinct: run cold this many times (the compiled grammars forgotten before "
        "each), each against its own unconstrained twin",
    )  # fmt: skip
    ap.add_argument(
        "--stub-model", action="store_true",
        help="with --distinct: the model replaced by a stub that returns logits at once (the "
        "real tokenizer), so that both sides measure the host's work alone, on any machine",
    )  # fmt: skip
    ap.add_argument(
        "--engine-arg", action="append", default=[], metavar="NAME=VALUE",
        help="an engine option for the --distinct run (VALUE read as JSON, else as text)",
    )  # fmt: skip
    ap.add_argument(
        "--executor-threads", type=int, default=None,
        help="llguidance's threads for a step's tokens and masks (default: its own choice)",
    )  # fmt: skip
    ap.add_argument(
        "--switch-interval", type=float, default=None, metavar="SECONDS",
        help="the interpreter's GIL switch interval for the run (sys.setswitchinterval; "
        "default: as it is, 5 ms)",
    )  # fmt: skip
    args = ap.parse_args()
    print(f"device: {device_line()}  commit: {commit()}")
    if args.switch_interval is not None:
        import sys

        sys.setswitchinterval(args.switch_interval)
        print(f"GIL switch interval: {1e3 * sys.getswitchinterval():g} ms")
    if args.executor_threads is not None:
        from radixlm.constrained.llguidance_backend import LLGuidanceBackend

        LLGuidanceBackend.executor_threads = args.executor_threads
        print(f"llguidance's threads: {args.executor_threads}")
    if args.distinct:
        run_distinct(
            args.model_path, args.schemas_dir, args.distinct, args.max_new_tokens,
            args.grammar_backend, args.profile, args.stub_model, args.cold_runs,
            **dict(_engine_arg(a) for a in args.engine_arg),
        )  # fmt: skip
        return

    rows = []
    with radixlm.Engine(
        args.model_path, enable_jump_forward=False, disable_radix_cache=True
    ) as eng:
        topics = ["fruits", "rivers", "tools", "birds", "colours", "cities", "games", "metals"]
        prompts = [
            eng.apply_chat_template([{"role": "user", "content": f"List six {t} as JSON."}])
            for t in topics
        ]
        eng.generate(
            prompts[0], {"max_new_tokens": 4, "json_schema": LIST_SCHEMA}
        )  # warm-up, compiles
        for batch in (1, args.batch):
            batch_prompts = (prompts * (batch // len(prompts) + 1))[:batch]
            cons = {
                "max_new_tokens": 200,
                "temperature": 0.8,
                "seed": 1,
                "json_schema": LIST_SCHEMA,
            }
            outs, wall_c, tok_c, _ = run(eng, batch_prompts, cons)
            check_json(outs)
            per_req = max(1, tok_c // batch)
            free = {"max_new_tokens": per_req, "temperature": 0.8, "seed": 1, "ignore_eos": True}
            _, wall_f, tok_f, _ = run(eng, batch_prompts, free)
            rows.append((batch, tok_c / wall_c, tok_f / wall_f))

    jump = {}
    for enabled in (False, True):
        with radixlm.Engine(
            args.model_path, enable_jump_forward=enabled, disable_radix_cache=True
        ) as eng:
            prompts = [
                eng.apply_chat_template(
                    [{"role": "user", "content": f"Customer record {i} as JSON."}]
                )
                for i in range(8)
            ]
            eng.generate(prompts[0], {"max_new_tokens": 4, "json_schema": LONG_KEYS_SCHEMA})
            params = {"max_new_tokens": 160, "temperature": 0, "json_schema": LONG_KEYS_SCHEMA}
            outs, wall, tokens, steps = run(eng, prompts, params)
            check_json(outs)
            jump[enabled] = (wall, tokens, steps, eng.get_stats()["jump_forward_tokens"])

    print(
        "\n| batch | constrained out tok/s | unconstrained out tok/s | ratio |\n|---|---|---|---|"
    )
    for batch, c, f in rows:
        print(f"| {batch} | {c:.1f} | {f:.1f} | {c / f:.2f}x |")
    print(
        "\n| jump-forward | wall s | output tokens | forward steps | tokens jumped |\n|---|---|---|---|---|"
    )
    for enabled in (False, True):
        wall, tokens, steps, jumped = jump[enabled]
        print(f"| {'on' if enabled else 'off'} | {wall:.2f} | {tokens} | {steps} | {jumped} |")
    print(
        f"jump-forward speed-up: {jump[False][0] / jump[True][0]:.2f}x, steps saved: {jump[False][2] - jump[True][2]}"
    )


if __name__ == "__main__":
    main()
