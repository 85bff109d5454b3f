"""JSON-schema grammar soundness and speed: radixlm vs plain outlines-core, in one run.

Over the MaskBench schemas in /work/shared/data/schemas (see its README), with the default
model's tokenizer (SmolLM2-135M) and no model: for each schema, compile it (per-schema timeout,
in a child process so a runaway compile is killed), then walk every test instance token by token
(the tokenizer's own tokenization of the instance written as compact JSON, keys in schema order),
timing the next-token mask before each token. A valid instance must be accepted to the end (EOS
allowed), an invalid one refused somewhere.

    coverage: schemas compiled with no false accept and no false reject
    FA: invalid instances accepted      FR: valid instances rejected

    python benchmarks/grammar.py --sample 100
    python benchmarks/grammar.py --sample 400 --timeout 10
    python benchmarks/grammar.py --sample 0 --shard 0/4 --json s0.json   # every 4th of all schemas
    python benchmarks/grammar.py --summarize s0.json s1.json s2.json s3.json
    python benchmarks/grammar.py --suite --sample 0   # the JSON-Schema-Test-Suite's groups
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from radixlm.runtime.model_loader import default_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "schemas"
SUITE_DATA = ROOT.parent / "shared" / "data" / "json-schema-test-suite"


def sample_names(
    data: Path, sample: int | None, limit: int | None, shard: tuple[int, int] = (0, 1)
) -> list[str]:
    names = sorted(p.name for p in data.glob("*.json"))
    if data.name == SUITE_DATA.name:  # one file per keyword, a list of schema groups in each
        names = [f"{n}#{i}" for n in names for i in range(len(json.loads((data / n).read_text())))]
    if sample:
        names = [names[(i * len(names)) // sample] for i in range(sample)]
    names = names[shard[0] :: shard[1]]
    return names[:limit] if limit else names


@dataclass
class Result:
    name: str
    engine: str
    status: str  # ok | refused | timeout | error
    message: str = ""
    compile_s: float = 0.0
    false_accepts: int = 0
    false_rejects: int = 0
    mask_us: list[float] = field(default_factory=list)


# -- engines: each returns a walker(tokens) -> (accepted, [mask seconds]) --------------------------


class RadixEngine:
    name = "radixlm"

    def __init__(self, tokenizer: Any, timeout: float, allow_unlisted: bool = False) -> None:
        from radixlm.constrained import GrammarCompiler

        self.compiler = GrammarCompiler(
            tokenizer,
            compile_timeout=timeout * 10,
            cache_size=1,
            allow_unlisted_properties=allow_unlisted,
        )
        if allow_unlisted:
            self.name = "radixlm (unlisted keys allowed)"
        _ = self.compiler.vocab.trie  # built once per vocabulary, before forking
        # warm what a long-running engine has loaded already (jsonschema for enum filtering, the
        # lazy imports of a first mask), so each forked child measures the compile itself
        self.walk(self.compile('{"enum":["a",1],"type":"string","maxLength":3}'), [])

    def compile(self, schema_text: str):
        return self.compiler.compile("json_schema", schema_text)

    def start_child(self) -> None:
        """In a forked child, before the timed compile: start the process that builds DFAs (a
        long-running engine has it already; a fork starts its own on first use)."""
        self.compiler.compile("regex", "[0-9]+")

    def walk(self, grammar: Any, tokens: list[int]) -> tuple[bool, list[float]]:
        import torch

        from radixlm.constrained import allocate_token_bitmask

        matcher = grammar.matcher()
        row = allocate_token_bitmask(1, self.compiler.vocab_size)[0]
        words = row.numpy().view(np.uint32)
        times = []
        for tok in [*tokens, None]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(row)
            times.append(time.perf_counter() - t0)
            target = self.compiler.vocab.eos_token_ids[0] if tok is None else tok
            if not (words[target >> 5] >> (target & 31)) & 1:
                return False, times
            if not matcher.accept_token(target):
                raise AssertionError("mask allowed a token accept_token refused")
        del torch
        return True, times


class OutlinesEngine:
    name = "outlines-core"

    def __init__(self, tokenizer: Any, timeout: float) -> None:
        from radixlm.constrained import TokenVocabulary

        self.vocab = TokenVocabulary.from_tokenizer(tokenizer)
        self.vocab.outlines_vocabulary()
        self.walk(self.compile('{"type":"string"}'), [])  # warm the lazy imports of a first mask

    def compile(self, schema_text: str):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(schema_text, "")
        return Index(regex, self.vocab.outlines_vocabulary())

    def walk(self, index: Any, tokens: list[int]) -> tuple[bool, list[float]]:
        import torch
        from outlines_core import Guide

        guide = Guide(index)
        words_n = self.vocab.outlines_words
        mask = torch.zeros(words_n, dtype=torch.int32)
        words = mask.numpy().view(np.uint32)
        times = []
        eos = self.vocab.eos_token_ids[0]
        for tok in [*tokens, None]:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), words_n, 4)
            times.append(time.perf_counter() - t0)
            target = eos if tok is None else tok
            if not (words[target >> 5] >> (target & 31)) & 1:
                return False, times
            if tok is None:
                return index.is_final_state(guide.get_state()), times
            guide.advance(tok, return_tokens=False)
        return True, times


class XGrammarEngine:
    """xgrammar (a benchmark-only extra: `pip install xgrammar`), compact JSON, strict mode."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, timeout: float) -> None:
        import xgrammar as xgr

        from radixlm.constrained import TokenVocabulary

        self.eos = TokenVocabulary.from_tokenizer(tokenizer).eos_token_ids[0]
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[self.eos])
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.walk(self.compile('{"type":"string"}'), [])  # warm the lazy imports of a first mask

    def compile(self, schema_text: str):
        return self.compiler.compile_json_schema(
            schema_text, any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def walk(self, grammar: Any, tokens: list[int]) -> tuple[bool, list[float]]:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, self.info.vocab_size)
        words = mask.numpy().view(np.uint32)[0]
        times = []
        for tok in [*tokens, None]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            target = self.eos if tok is None else tok
            if not (words[target >> 5] >> (target & 31)) & 1:
                return False, times
            if not matcher.accept_token(target):
                return False, times
        return True, times


class LLGuidanceEngine:
    """llguidance (a benchmark-only extra: `pip install llguidance`), compact JSON, not lenient.
    Building its matcher is the compile; each walk starts from a copy of it."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, timeout: float) -> None:
        import llguidance.hf

        from radixlm.constrained import TokenVocabulary

        self.eos = TokenVocabulary.from_tokenizer(tokenizer).eos_token_ids[0]
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=self.eos)
        self.walk(self.compile('{"type":"string"}'), [])  # warm the lazy imports of a first mask

    def compile(self, schema_text: str):
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_json_schema(
            schema_text, defaults={"whitespace_flexible": False}
        )
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def walk(self, grammar: Any, tokens: list[int]) -> tuple[bool, list[float]]:
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        matcher = grammar.deep_copy()
        mask = allocate_token_bitmask(1, self.tokenizer.vocab_size)
        words = mask.view(np.uint32)[0]
        times = []
        for tok in [*tokens, None]:
            t0 = time.perf_counter()
            fill_next_token_bitmask(matcher, mask)
            times.append(time.perf_counter() - t0)
            target = self.eos if tok is None else tok
            if not (words[target >> 5] >> (target & 31)) & 1:
                return False, times
            if tok is None:
                return matcher.is_accepting(), times
            if not matcher.consume_token(tok):
                return False, times
        return True, times


# -- one schema, in a child process ------------------------------------------------------------

_STATE: dict[str, Any] = {}


def _evaluate(engine_name: str, path: str, conn) -> None:
    from radixlm.constrained import GrammarError, dump_json_for_schema

    engine, tokenizer = _STATE[engine_name], _STATE["tokenizer"]
    file, _, group = path.partition("#")
    data = json.loads(Path(file).read_text())
    if group:
        data = data[int(group)]
    schema_text = json.dumps(data["schema"])
    r = Result(Path(path).name, engine.name, "ok")
    if hasattr(engine, "start_child"):
        engine.start_child()
    t0 = time.perf_counter()
    try:
        grammar = engine.compile(schema_text)
    except GrammarError as e:
        r.status, r.message = "refused", str(e)
        conn.send(r)
        return
    except BaseException as e:  # outlines-core raises its own errors for what it refuses
        r.status, r.message = "refused", f"{type(e).__name__}: {str(e)[:200]}"
        conn.send(r)
        return
    r.compile_s = time.perf_counter() - t0
    conn.send(("compiled", r.compile_s))
    for test in data["tests"]:
        try:
            text = dump_json_for_schema(data["schema"], test["data"])
        except Exception:
            text = json.dumps(test["data"], ensure_ascii=False, separators=(",", ":"))
        tokens = tokenizer.encode(text, add_special_tokens=False)
        accepted, times = engine.walk(grammar, tokens)
        r.mask_us.extend(t * 1e6 for t in times)
        if accepted and not test["valid"]:
            r.false_accepts += 1
        elif not accepted and test["valid"]:
            r.false_rejects += 1
    conn.send(r)


def run_one(engine_name: str, path: Path, timeout: float) -> Result:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_evaluate, args=(engine_name, str(path), child))
    proc.start()
    child.close()
    result: Result | None = None
    compile_s = None
    deadline = time.monotonic() + timeout
    walk_deadline = None
    while True:
        remaining = (walk_deadline or deadline) - time.monotonic()
        if remaining <= 0 or not parent.poll(remaining):
            if parent.poll(0):
                continue
            proc.kill()
            proc.join()
            if compile_s is None:
                return Result(path.name, engine_name, "timeout", f"compile over {timeout:g} s")
            return Result(path.name, engine_name, "error", "walking the tests timed out", compile_s)
        try:
            msg = parent.recv()
        except EOFError:
            break
        if isinstance(msg, tuple):
            compile_s = msg[1]
            walk_deadline = time.monotonic() + max(60.0, timeout)
            continue
        result = msg
        break
    proc.join()
    if result is None:
        return Result(path.name, engine_name, "error", f"child exited with {proc.exitcode}")
    return result


# -- report --------------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def summarize(engine: str, results: list[Result]) -> dict[str, Any]:
    n = len(results)
    ok = [r for r in results if r.status == "ok"]
    covered = [r for r in ok if r.false_accepts == 0 and r.false_rejects == 0]
    compiles = [r.compile_s for r in ok]
    masks = [m for r in ok for m in r.mask_us]
    return {
        "engine": engine,
        "schemas": n,
        "coverage": 100.0 * len(covered) / max(n, 1),
        "refused": sum(r.status == "refused" for r in results),
        "timeouts": sum(r.status == "timeout" for r in results),
        "errors": sum(r.status == "error" for r in results),
        "FA": sum(r.false_accepts for r in ok),
        "FR": sum(r.false_rejects for r in ok),
        "compile_p50_ms": 1e3 * percentile(compiles, 50),
        "compile_p99_ms": 1e3 * percentile(compiles, 99),
        "mask_p50_us": percentile(masks, 50),
        "mask_p99_us": percentile(masks, 99),
        "mask_p999_us": percentile(masks, 99.9),
        "masks": len(masks),
    }


def print_common_compiles(results: dict[str, list[Result]]) -> None:
    """Compile times over the schemas that every engine compiled (the same work for each)."""
    compiled = [{r.name for r in rs if r.status == "ok"} for rs in results.values()]
    common = set.intersection(*compiled) if compiled else set()
    if not common or len(results) < 2:
        return
    print(f"\ncompile time on the {len(common)} schemas every engine compiled:")
    for engine, rs in results.items():
        times = [r.compile_s for r in rs if r.name in common]
        print(
            f"  {engine}: p50 {1e3 * percentile(times, 50):.1f} ms, "
            f"p99 {1e3 * percentile(times, 99):.0f} ms, max {1e3 * max(times):.0f} ms"
        )


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| engine | coverage | FA | FR | refused | timeouts | compile p50 / p99 | mask p50 / p99 / p99.9 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for s in rows:
        print(
            f"| {s['engine']} | {s['coverage']:.1f}% | {s['FA']} | {s['FR']} | {s['refused']} | "
            f"{s['timeouts']} | {s['compile_p50_ms']:.1f} ms / {s['compile_p99_ms']:.0f} ms | "
            f"{s['mask_p50_us']:.1f} / {s['mask_p99_us']:.1f} / {s['mask_p999_us']:.1f} µs |"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", type=Path, default=None, help=f"default: {DEFAULT_DATA}")
    ap.add_argument(
        "--suite",
        action="store_true",
        help=f"the JSON-Schema-Test-Suite's schema groups ({SUITE_DATA}) instead",
    )
    ap.add_argument(
        "--sample",
        type=int,
        default=100,
        help="N schemas evenly spaced over the sorted names (0: all)",
    )
    ap.add_argument(
        "--shard", default="0/1", help="K/N: only every N-th schema of the sample, from the K-th"
    )
    ap.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        default=None,
        help="print the table of --json files written by earlier runs (shards) and exit",
    )
    ap.add_argument("--limit", type=int, default=None, help="only the first N of the sample")
    ap.add_argument("--timeout", type=float, default=10.0, help="per-schema compile timeout (s)")
    ap.add_argument(
        "--engines",
        default="radixlm,outlines-core",
        help="also: xgrammar, llguidance (where they install)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write per-schema results here")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument(
        "--allow-unlisted",
        action="store_true",
        help="radixlm generates keys the schema does not list when additionalProperties is unset",
    )
    args = ap.parse_args(argv)

    if args.summarize:
        merged: dict[str, list[Result]] = {}
        for path in args.summarize:
            for engine, rows in json.loads(path.read_text()).items():
                merged.setdefault(engine, []).extend(Result(**r) for r in rows)
        print(f"{len(next(iter(merged.values()), []))} schemas from {len(args.summarize)} file(s)")
        print_table([summarize(e, rs) for e, rs in merged.items()])
        print_common_compiles(merged)
        return
    k, _, n = args.shard.partition("/")
    shard = (int(k), int(n or 1))
    if not 0 <= shard[0] < shard[1]:
        raise SystemExit(f"--shard wants K/N with 0 <= K < N, got {args.shard}")
    if args.data is None:
        args.data = SUITE_DATA if args.suite else DEFAULT_DATA
    if not args.data.exists():
        raise SystemExit(f"no data at {args.data}")
    names = sample_names(args.data, args.sample, args.limit, shard)
    try:
        tokenizer = default_tokenizer()
    except ValueError as e:  # the embedded model package is missing
        raise SystemExit(str(e)) from e
    _STATE["tokenizer"] = tokenizer
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e == "radixlm":
            _STATE[e] = RadixEngine(tokenizer, args.timeout, args.allow_unlisted)
        elif e == "xgrammar":
            _STATE[e] = XGrammarEngine(tokenizer, args.timeout)
        elif e == "llguidance":
            _STATE[e] = LLGuidanceEngine(tokenizer, args.timeout)
        else:
            _STATE[e] = OutlinesEngine(tokenizer, args.timeout)

    all_results: dict[str, list[Result]] = {e: [] for e in engines}
    t0 = time.time()
    for i, name in enumerate(names):
        for e in engines:
            r = run_one(e, args.data / name, args.timeout)
            all_results[e].append(r)
            if args.verbose or r.false_accepts or r.status == "error":
                print(
                    f"[{i + 1}/{len(names)}] {e:14s} {name:50s} {r.status:8s} "
                    f"{r.compile_s * 1e3:8.1f} ms FA={r.false_accepts} FR={r.false_rejects} {r.message[:120]}",
                    flush=True,
                )
    rows = [summarize(_STATE[e].name, rs) for e, rs in all_results.items()]
    print()
    print(
        f"{len(names)} schemas, {time.time() - t0:.0f} s; SmolLM2-135M tokenizer; compact JSON, keys in schema order"
    )
    print_table(rows)
    print_common_compiles(all_results)
    print()
    print(
        "command: python "
        + " ".join(
            [f"benchmarks/{Path(__file__).name}", *(argv if argv is not None else sys.argv[1:])]
        )
    )
    if args.json:
        args.json.write_text(
            json.dumps({e: [r.__dict__ for r in rs] for e, rs in all_results.items()}, indent=1)
        )
    refusals: dict[str, int] = {}
    for r in all_results.get("radixlm", []):
        if r.status == "refused":
            key = r.message.split(" at ")[0][:80]
            refusals[key] = refusals.get(key, 0) + 1
    if refusals:
        print("\nradixlm refusals:")
        for k, v in sorted(refusals.items(), key=lambda kv: -kv[1]):
            print(f"  {v:4d}  {k}")


if __name__ == "__main__":
    main()
