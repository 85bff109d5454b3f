"""JSON-schema grammar engines: soundness and speed of radixlm's two backends and the field's.

Over the MaskBench schemas in ../shared/data/schemas (see its README), with the default
model's tokenizer (SmolLM2-135M) and no model: for each schema, compile it (per-schema timeout,
in a child process so a runaway compile is killed), then walk every test instance token by token
(the tokenizer's own tokenization of the instance written as compact JSON, keys in schema order),
timing the next-token mask before each token. A valid instance must be accepted to the end (EOS
allowed), an invalid one refused somewhere.

    coverage: schemas compiled with no false accept and no false reject
    FA: invalid instances accepted      FR: valid instances rejected

Engines (--engines): radixlm (our default backend, llguidance), radixlm-outlines (our own regex
and byte-DFA compiler), and as references plain llguidance, outlines-core and xgrammar; one that
does not import is skipped with a note. Our compiles run with the compiler's cache off.

    python -m benchmarks.grammar --sample 100
    python -m benchmarks.grammar --sample 400 --timeout 10
    python -m benchmarks.grammar --sample 0 --shard 0/4 --json s0.json   # every 4th of all schemas
    python -m benchmarks.grammar --summarize s0.json s1.json s2.json s3.json
    python -m benchmarks.grammar --suite --sample 0   # the JSON-Schema-Test-Suite's groups

Two more measurements, each instead of the table above:

    # 64 requests with 64 distinct schemas: each step fills all rows of one (64, W) bitmask,
    # row by row and (llguidance) with fill_bitmasks in Rust threads; p50/p99 ms per step
    python -m benchmarks.grammar --sample 400 --batch-masks 64
    # compile times in one long-lived process (a server's), no fork per schema
    python -m benchmarks.grammar --sample 400 --compile-in-process --engines radixlm,llguidance
    # compile and mask times as the vocabulary grows: byte-level BPE tokenizers trained here on
    # the schemas' own text (no network), the default backend over 100 schemas
    python -m benchmarks.grammar --sample 100 --vocab-scaling 49152,128000,152064
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from radixlm.runtime.model_loader import default_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "schemas"
SUITE_DATA = ROOT.parent / "shared" / "data" / "json-schema-test-suite"
ENGINES = ("radixlm", "radixlm-outlines", "llguidance", "outlines-core", "xgrammar")
BPE_EOS = "<|endoftext|>"
WARM_SCHEMA = '{"type":"object","properties":{"a":{"type":"string"}},"required":["a"]}'


# -- data ----------------------------------------------------------------------------------------


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


def load_case(path: Path) -> dict[str, Any]:
    """A schema and its tests: a MaskBench file, or `file.json#i`, a suite file's i-th group."""
    file, _, group = str(path).partition("#")
    data = json.loads(Path(file).read_text())
    return data[int(group)] if group else data


def instance_tokens(schema: Any, value: Any, tokenizer: Any) -> list[int]:
    """The tokenizer's tokens of `value` as compact JSON, keys in the schema's order."""
    from radixlm.constrained import dump_json_for_schema

    try:
        text = dump_json_for_schema(schema, value)
    except Exception:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return tokenizer.encode(text, add_special_tokens=False)


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
    wall_s: float = 0.0  # the whole child: fork, compile, walks


# -- engines: compile(schema text) -> grammar; walk(grammar, tokens) -> (accepted, [seconds])


def _eos(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise SystemExit("the tokenizer has no eos_token_id")
    return int(tokenizer.eos_token_id)


def _package(name: str) -> str:
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return name


class RadixEngine:
    """radixlm's GrammarCompiler with one backend, its cache off (every compile is timed)."""

    def __init__(
        self,
        tokenizer: Any,
        backend: str = "llguidance",
        compile_timeout: float = 100.0,
        allow_unlisted: bool = False,
    ) -> None:
        from radixlm.constrained import GrammarCompiler

        self.name = f"radixlm[{backend}]" + (" (unlisted keys allowed)" if allow_unlisted else "")
        self.eos = _eos(tokenizer)
        self.compiler = GrammarCompiler(
            tokenizer,
            eos_token_ids=[self.eos],
            backend=backend,
            compile_timeout=compile_timeout,
            cache_size=0,
            allow_unlisted_properties=allow_unlisted,
        )
        if backend == "outlines":
            _ = self.compiler.vocab.trie  # built once per vocabulary, before forking
        # warm what a long-running engine has loaded already (jsonschema for enum filtering, the
        # lazy imports of a first mask), so each forked child measures the compile itself
        self.walk(self.compile('{"enum":["a",1],"type":"string","maxLength":3}'), [])

    def compile(self, schema_text: str) -> Any:
        return self.compiler.compile("json_schema", schema_text)

    def walk(self, grammar: Any, tokens: list[int]) -> tuple[bool, list[float]]:
        from radixlm.constrained import allocate_token_bitmask

        matcher = grammar.matcher()
        row = allocate_token_bitmask(1, self.compiler.vocab_size)[0]
        words = row.numpy().view(np.uint32)
        times = []
        for token in [*tokens, self.eos]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(row)
            times.append(time.perf_counter() - t0)
            if not (words[token >> 5] >> (token & 31)) & 1:
                return False, times
            if not matcher.accept_token(token):
                raise RuntimeError(f"the mask allowed token {token}, accept_token refused it")
        return True, times


class OutlinesEngine:
    """Plain outlines-core: its JSON-schema regex and an Index over the whole vocabulary."""

    def __init__(self, tokenizer: Any) -> None:
        from radixlm.constrained import TokenVocabulary

        self.name = _package("outlines-core")
        self.vocab = TokenVocabulary.from_tokenizer(tokenizer)
        self.vocab.outlines_vocabulary()
        self.walk(self.compile('{"type":"string"}'), [])  # warm the lazy imports of a first mask

    def compile(self, schema_text: str) -> Any:
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
        for token in [*tokens, None]:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), words_n, 4)
            times.append(time.perf_counter() - t0)
            target = eos if token is None else token
            if not (words[target >> 5] >> (target & 31)) & 1:
                return False, times
            if token is None:
                return index.is_final_state(guide.get_state()), times
            guide.advance(token, return_tokens=False)
        return True, times


class XGrammarEngine:
    """xgrammar (a benchmark-only extra: `pip install xgrammar`), compact JSON, strict mode."""

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar as xgr

        self.name = _package("xgrammar")
        self.eos = _eos(tokenizer)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[self.eos])
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.walk(self.compile('{"type":"string"}'), [])  # warm the lazy imports of a first mask

    def compile(self, schema_text: str) -> Any:
        return self.compiler.compile_json_schema(
            schema_text, any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def walk(self, grammar: Any, tokens: list[int]) -> tuple[bool, list[float]]:
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, self.info.vocab_size)
        words = mask.numpy().view(np.uint32)[0]
        times = []
        for token in [*tokens, self.eos]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            if not (words[token >> 5] >> (token & 31)) & 1:
                return False, times
            if not matcher.accept_token(token):
                return False, times
        return True, times


class LLGuidanceEngine:
    """Plain llguidance (the reference for our default backend, which adds number bounds and
    closed objects), compact JSON, not lenient. Building its matcher and its first mask is the
    compile, as ours does it (the first mask builds the lexer states every request starts from:
    a server makes it before the request's first step); each walk starts from a copy of it."""

    def __init__(self, tokenizer: Any) -> None:
        import llguidance.hf

        self.name = _package("llguidance")
        self.eos = _eos(tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=self.eos)
        self.walk(self.compile('{"type":"string"}'), [])  # warm the lazy imports of a first mask

    def compile(self, schema_text: str) -> Any:
        from llguidance import LLMatcher

        grammar = LLMatcher.grammar_from_json_schema(
            schema_text, defaults={"whitespace_flexible": False}
        )
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def walk(self, grammar: Any, tokens: list[int]) -> tuple[bool, list[float]]:
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        matcher = grammar.deep_copy()
        mask = allocate_token_bitmask(1, self.tokenizer.vocab_size)
        words = mask.view(np.uint32)[0]
        times = []
        for token in [*tokens, None]:
            t0 = time.perf_counter()
            fill_next_token_bitmask(matcher, mask)
            times.append(time.perf_counter() - t0)
            target = self.eos if token is None else token
            if not (words[target >> 5] >> (target & 31)) & 1:
                return False, times
            if token is None:
                return matcher.is_accepting(), times
            if not matcher.consume_token(token):
                return False, times
        return True, times


def make_engines(
    keys: list[str], tokenizer: Any, compile_timeout: float, allow_unlisted: bool = False
) -> dict[str, Any]:
    """The engines named in `keys`; one whose package does not import is left out, with a note."""
    engines: dict[str, Any] = {}
    for key in keys:
        try:
            if key == "radixlm":
                engines[key] = RadixEngine(tokenizer, "llguidance", compile_timeout, allow_unlisted)
            elif key == "radixlm-outlines":
                engines[key] = RadixEngine(tokenizer, "outlines", compile_timeout, allow_unlisted)
            elif key == "llguidance":
                engines[key] = LLGuidanceEngine(tokenizer)
            elif key == "outlines-core":
                engines[key] = OutlinesEngine(tokenizer)
            elif key == "xgrammar":
                engines[key] = XGrammarEngine(tokenizer)
            else:
                raise SystemExit(f"unknown engine {key!r}; choose from {', '.join(ENGINES)}")
        except (ImportError, OSError) as e:
            print(f"{key}: skipped, it does not import ({e}); `pip install {key}` to include it")
    return engines


# -- one schema, in a child process ------------------------------------------------------------


def _evaluate(engine: Any, tokenizer: Any, path: str, conn: Any) -> None:
    from radixlm.constrained import GrammarError

    case = load_case(Path(path))
    r = Result(Path(path).name, engine.name, "ok")
    # A compile before the timed one, as a long-running engine has done: it starts what a fork
    # lacks (our compile thread and DFA-building process) and pays the child's first-use costs
    # (copied memory pages, lazy imports), so that the timed compile is the schema's own work.
    engine.compile(WARM_SCHEMA)
    t0 = time.perf_counter()
    try:
        grammar = engine.compile(json.dumps(case["schema"]))
    except GrammarError as e:
        r.status, r.message = "refused", str(e)
        conn.send(r)
        return
    except BaseException as e:  # the other engines raise their own errors for what they refuse
        r.status, r.message = "refused", f"{type(e).__name__}: {str(e)[:200]}"
        conn.send(r)
        return
    r.compile_s = time.perf_counter() - t0
    conn.send(("compiled", r.compile_s))
    for test in case["tests"]:
        tokens = instance_tokens(case["schema"], test["data"], tokenizer)
        try:
            accepted, times = engine.walk(grammar, tokens)
        except Exception as e:  # an engine inconsistent with itself: reported, not a crash
            r.status, r.message = "error", f"{type(e).__name__}: {e}"
            break
        r.mask_us.extend(t * 1e6 for t in times)
        if accepted and not test["valid"]:
            r.false_accepts += 1
        elif not accepted and test["valid"]:
            r.false_rejects += 1
    conn.send(r)


def run_one(engine: Any, tokenizer: Any, path: Path, timeout: float) -> Result:
    # fork: the child shares the engine as built (no pickling), and is killed at the deadline
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_evaluate, args=(engine, tokenizer, str(path), child))
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
                return Result(path.name, engine.name, "timeout", f"compile over {timeout:g} s")
            return Result(path.name, engine.name, "error", "walking the tests timed out", compile_s)
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
        return Result(path.name, engine.name, "error", f"child exited with {proc.exitcode}")
    return result


def run_sample(
    engines: dict[str, Any],
    tokenizer: Any,
    data: Path,
    names: list[str],
    timeout: float,
    verbose: bool = False,
) -> dict[str, list[Result]]:
    """Every schema of `names` with every engine, each in its own child process."""
    results: dict[str, list[Result]] = {key: [] for key in engines}
    for i, name in enumerate(names):
        for key, engine in engines.items():
            t0 = time.perf_counter()
            r = run_one(engine, tokenizer, data / name, timeout)
            r.wall_s = time.perf_counter() - t0
            results[key].append(r)
            if verbose or r.false_accepts or r.status == "error":
                print(
                    f"[{i + 1}/{len(names)}] {key:16s} {name:50s} {r.status:8s} "
                    f"{r.compile_s * 1e3:8.1f} ms FA={r.false_accepts} FR={r.false_rejects} {r.message[:120]}",
                    flush=True,
                )
    return results


# -- a batch of requests with distinct schemas: the masks of one decode step ---------------------


@dataclass
class Pick:
    """A schema of the batch and the tokens of one of its valid instances, then EOS."""

    name: str
    schema_text: str
    tokens: list[int]


@dataclass
class Request:
    """One request of the batch: walks its instance token by token and starts again at its end,
    so the batch stays full."""

    name: str
    grammar: Any
    tokens: list[int]
    matcher: Any = None
    at: int = 0

    def __post_init__(self) -> None:
        self.matcher = self.grammar.matcher()

    def advance(self, allowed: np.ndarray) -> None:
        """Take the next token, which the (W,) uint32 row `allowed` must allow."""
        token = self.tokens[self.at]
        if not (allowed[token >> 5] >> (token & 31)) & 1 or not self.matcher.accept_token(token):
            raise RuntimeError(f"{self.name}: token {self.at} of a valid instance refused")
        self.at += 1
        if self.at == len(self.tokens):
            self.matcher, self.at = self.grammar.matcher(), 0


def pick_batch(
    engines: dict[str, Any], tokenizer: Any, data: Path, names: list[str], batch: int
) -> list[Pick]:
    """`batch` schemas spread over `names`: cut into `batch` runs of consecutive names, the first
    of each run that every engine compiles and whose first valid instance every engine accepts
    (the sorted names group by source: the first `batch` would all be function-calling ones);
    for a run with none, the first such schema among the names not tried yet."""
    picks: list[Pick] = []
    tried: set[str] = set()

    def first_of(run: list[str]) -> None:
        for name in run:
            if name in tried:
                continue
            tried.add(name)
            pick = _pick(engines, tokenizer, data, name)
            if pick is not None:
                picks.append(pick)
                return

    for i in range(batch):
        first_of(names[(i * len(names)) // batch : ((i + 1) * len(names)) // batch])
    while len(picks) < batch and len(tried) < len(names):
        first_of(names)
    return picks


def _pick(engines: dict[str, Any], tokenizer: Any, data: Path, name: str) -> Pick | None:
    from radixlm.constrained import GrammarError

    case = load_case(data / name)
    valid = [t for t in case["tests"] if t["valid"]]
    if not valid:
        return None
    tokens = instance_tokens(case["schema"], valid[0]["data"], tokenizer)
    schema_text = json.dumps(case["schema"])
    for engine in engines.values():
        try:
            if not engine.walk(engine.compile(schema_text), tokens)[0]:
                return None
        except GrammarError:
            return None
    return Pick(name, schema_text, tokens)


def fresh_requests(engine: Any, picks: list[Pick]) -> list[Request]:
    """The batch's requests, each from a compile of its own (no mask cached by an earlier walk)."""
    return [Request(p.name, engine.compile(p.schema_text), [*p.tokens, engine.eos]) for p in picks]


def time_batch_fill(
    requests: list[Request], vocab_size: int, steps: int, executor: Any = None
) -> tuple[list[float], list[bytes]]:
    """Seconds per step to fill the (B, W) bitmask of all `requests`, row by row or, given an
    llguidance executor, with fill_bitmasks; and a digest of each step's bitmask (the two fills
    must agree)."""
    from radixlm.constrained import allocate_token_bitmask
    from radixlm.constrained.llguidance_backend import fill_bitmasks

    bitmask = allocate_token_bitmask(len(requests), vocab_size)  # (B, W)
    allowed = bitmask.numpy().view(np.uint32)  # (B, W)
    times, digests = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        if executor is None:
            for row, r in enumerate(requests):
                r.matcher.fill_next_token_bitmask(bitmask, row)
        else:
            fill_bitmasks([(r.matcher, row) for row, r in enumerate(requests)], bitmask, executor)
        times.append(time.perf_counter() - t0)
        digests.append(hashlib.blake2b(allowed.tobytes(), digest_size=16).digest())
        for row, r in enumerate(requests):
            r.advance(allowed[row])
    return times, digests


def batch_masks(
    keys: list[str], tokenizer: Any, data: Path, names: list[str], args: argparse.Namespace
) -> None:
    """--batch-masks: the step time of filling one (B, W) bitmask for B distinct schemas. Each
    fill runs over all the steps on its own, from fresh compiles (llguidance's threads, which
    spin a while after each fill, would otherwise take the CPU from the row-by-row fill)."""
    import llguidance

    engines = make_engines(
        [k for k in keys if k.startswith("radixlm")], tokenizer, args.timeout, args.allow_unlisted
    )
    if not engines:
        raise SystemExit("--batch-masks measures radixlm's backends: radixlm, radixlm-outlines")
    picks = pick_batch(engines, tokenizer, data, names, args.batch_masks)
    print(
        f"{len(picks)} requests, each its own schema (spread over the {len(names)} sampled, ones "
        f"that {' and '.join(e.name for e in engines.values())} compile and accept), "
        f"{args.steps} steps; each request walks one valid instance and starts again at its end"
    )
    print("| engine | fill | threads | step p50 / p99 / max | step p50 per row |")
    print("|---|---|---|---|---|")
    for engine in engines.values():
        fills: list[tuple[str, Any]] = [("one by one", None)]
        if engine.compiler.backend == "llguidance":
            fills.append(("fill_bitmasks", llguidance.LLExecutor(args.fill_threads)))
        oracle = None
        for label, executor in fills:
            requests = fresh_requests(engine, picks)
            ts, digests = time_batch_fill(
                requests, engine.compiler.vocab_size, args.steps, executor
            )
            if oracle is not None and digests != oracle:
                raise RuntimeError(f"{engine.name}: {label} and the row-by-row fill disagree")
            oracle = digests
            ms = [1e3 * t for t in ts]
            threads = (args.fill_threads or "default") if executor is not None else 1
            print(
                f"| {engine.name} | {label} | {threads} | {percentile(ms, 50):.2f} / "
                f"{percentile(ms, 99):.2f} / {max(ms):.2f} ms | "
                f"{1e3 * percentile(ms, 50) / len(picks):.1f} µs |",
                flush=True,
            )


# -- how compile and mask times grow with the vocabulary -----------------------------------------


def _training_text(data: Path) -> Iterator[str]:
    """The schemas' own JSON and test instances, then pseudo-words (so the largest vocabularies
    find enough merges): all made here, nothing downloaded."""
    for path in sorted(data.glob("*.json")):
        case = json.loads(path.read_text())
        yield json.dumps(case["schema"], ensure_ascii=False)
        for test in case["tests"]:
            yield json.dumps(test["data"], ensure_ascii=False, separators=(",", ":"))
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    for _ in range(100_000):
        words = ("".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(16))
        yield " ".join(words)


def _train_bpe(vocab_size: int, data: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # like real tokenizers (SmolLM2's longest token has 81 bytes; the schemas' test data has
        # runs that would make 2 kB tokens, past llguidance's token trie, which takes 1 kB)
        max_token_length=64,
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(data), trainer)
    tmp = out.with_suffix(".tmp")
    tok.save(str(tmp))
    os.replace(tmp, out)


def bpe_tokenizer(vocab_size: int, data: Path) -> Any:
    """A byte-level BPE tokenizer of (up to) `vocab_size` tokens, trained on `data` once and kept
    in the temp directory, as a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    path = Path(tempfile.gettempdir()) / f"radixlm-bench-bpe-{vocab_size}-max64.json"
    if not path.exists():
        # trained in a child: the tokenizers library's threads never run in this process, which
        # forks a child per schema next
        proc = mp.get_context("fork").Process(target=_train_bpe, args=(vocab_size, data, path))
        proc.start()
        proc.join()
        if proc.exitcode:
            raise SystemExit(f"training the {vocab_size}-token BPE failed ({proc.exitcode})")
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=BPE_EOS)


def compile_in_process(engines: dict[str, Any], data: Path, names: list[str]) -> None:
    """Compile times in one long-lived process: each engine compiles the sample's schemas one
    after another (ours with its cache off), as a server does, where the table's fork per schema
    also pays a fresh child's first-use costs (page faults on memory the parent built). A
    refused schema is left out of the times; a runaway compile is not stopped here."""
    print("\n| engine | compiled | refused | compile p50 / p90 / p99 / max ms |\n|---|---|---|---|")
    for engine in engines.values():
        times, refused = [], 0
        for name in names:
            text = json.dumps(load_case(data / name)["schema"])
            t0 = time.perf_counter()
            try:
                engine.compile(text)
            except Exception:  # (each engine's own refusal)
                refused += 1
                continue
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        at = [times[min(len(times) - 1, int(q * len(times)))] for q in (0.5, 0.9, 0.99)] + [
            times[-1]
        ]
        print(
            f"| {engine.name} | {len(times)} | {refused} | "
            + " / ".join(f"{t:.2f}" for t in at)
            + " |"
        )


def vocab_scaling(
    sizes: list[int], tokenizer: Any, data: Path, names: list[str], args: argparse.Namespace
) -> None:
    """The default backend's soundness table over `names` with SmolLM2's tokenizer and with BPE
    tokenizers of each size: how its setup, compile and mask times grow with the vocabulary."""
    tokenizers = [("SmolLM2-135M", tokenizer)]
    for size in sizes:
        t0 = time.perf_counter()
        tokenizers.append((f"BPE {size} (trained here)", bpe_tokenizer(size, DEFAULT_DATA)))
        print(f"BPE {size}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for label, tok in tokenizers:
        t0 = time.perf_counter()
        engine = RadixEngine(tok, "llguidance", 10 * args.timeout, args.allow_unlisted)
        setup_s = time.perf_counter() - t0
        results = run_sample({"radixlm": engine}, tok, data, names, args.timeout, args.verbose)
        rows.append((label, len(tok), setup_s, summarize(engine.name, results["radixlm"])))
    print(f"\n{engine.name} over {len(names)} schemas; setup: the GrammarCompiler (tokenizer read)")
    print(
        "| tokenizer | vocab | setup | coverage | FA | FR | compile p50 / p99 | mask p50 / p99 / p99.9 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, vocab, setup_s, s in rows:
        print(
            f"| {label} | {vocab:,} | {setup_s:.2f} s | {s['coverage']:.1f}% | {s['FA']} | "
            f"{s['FR']} | {s['compile_p50_ms']:.2f} / {s['compile_p99_ms']:.1f} ms | "
            f"{s['mask_p50_us']:.1f} / {s['mask_p99_us']:.0f} / {s['mask_p999_us']:.0f} µs |"
        )


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
        "wall_s": sum(r.wall_s for r in results),
    }


def print_common_compiles(results: dict[str, list[Result]]) -> None:
    """Compile times over the schemas that every engine compiled (the same work for each)."""
    compiled = [{r.name for r in rs if r.status == "ok"} for rs in results.values()]
    common = set.intersection(*compiled) if compiled else set()
    if not common or len(results) < 2:
        return
    print(f"\ncompile time on the {len(common)} schemas every engine compiled:")
    for rs in results.values():
        times = [r.compile_s for r in rs if r.name in common]
        print(
            f"  {rs[0].engine}: p50 {1e3 * percentile(times, 50):.2f} ms, "
            f"p99 {1e3 * percentile(times, 99):.1f} ms, max {1e3 * max(times):.0f} ms"
        )


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| engine | coverage | FA | FR | refused | timeouts | errors | compile p50 / p99 "
        "| mask p50 / p99 / p99.9 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        print(
            f"| {s['engine']} | {s['coverage']:.1f}% | {s['FA']} | {s['FR']} | {s['refused']} | "
            f"{s['timeouts']} | {s['errors']} | "
            f"{s['compile_p50_ms']:.2f} / {s['compile_p99_ms']:.1f} ms | "
            f"{s['mask_p50_us']:.1f} / {s['mask_p99_us']:.0f} / {s['mask_p999_us']:.0f} µs |"
        )


def print_wall_times(rows: list[dict[str, Any]]) -> None:
    spent = ", ".join(f"{s['engine']} {s['wall_s']:.0f} s" for s in rows)
    print(f"\ntime per engine (children, fork to result): {spent}")


def print_targets(s: dict[str, Any]) -> None:
    """The default backend against the issue's targets."""
    checks = [
        ("0 false accepts", s["FA"] == 0, f"{s['FA']}"),
        ("coverage >= 85%", s["coverage"] >= 85.0, f"{s['coverage']:.1f}%"),
        ("compile p50 <= 1 ms", s["compile_p50_ms"] <= 1.0, f"{s['compile_p50_ms']:.2f} ms"),
        ("compile p99 <= 10 ms", s["compile_p99_ms"] <= 10.0, f"{s['compile_p99_ms']:.1f} ms"),
        ("mask p99 <= 300 µs", s["mask_p99_us"] <= 300.0, f"{s['mask_p99_us']:.0f} µs"),
    ]
    print(f"\ntargets, {s['engine']}:")
    for what, met, got in checks:
        print(f"  {what:22s} {got:>10s}  {'met' if met else 'NOT met'}")


def print_refusals(results: list[Result]) -> None:
    refusals: dict[str, int] = {}
    for r in results:
        if r.status == "refused":
            key = r.message.split(" at ")[0][:100]
            refusals[key] = refusals.get(key, 0) + 1
    if refusals:
        print(f"\n{results[0].engine} refusals:")
        for k, v in sorted(refusals.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {v:4d}  {k}")


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
        default=",".join(ENGINES),
        help="a list of: radixlm (the llguidance backend), radixlm-outlines, llguidance, "
        "outlines-core, xgrammar (those that do not import are skipped)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write per-schema results here")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument(
        "--allow-unlisted",
        action="store_true",
        help="radixlm generates keys the schema does not list when additionalProperties is unset",
    )
    ap.add_argument(
        "--batch-masks",
        type=int,
        default=0,
        metavar="B",
        help="instead: time filling the masks of B requests with B distinct schemas per step",
    )
    ap.add_argument("--steps", type=int, default=500, help="decode steps of --batch-masks")
    ap.add_argument(
        "--fill-threads",
        type=int,
        default=None,
        help="llguidance.LLExecutor threads of --batch-masks (default: llguidance's own choice)",
    )
    ap.add_argument(
        "--compile-in-process",
        action="store_true",
        help="instead: each engine compiles every schema of the sample in this one process, one "
        "after another, as a long-running server does (no fork per schema; no walks)",
    )
    ap.add_argument(
        "--vocab-scaling",
        default=None,
        metavar="SIZES",
        help="instead: the default backend with BPE tokenizers of these vocabulary sizes",
    )
    args = ap.parse_args(argv)

    if args.summarize:
        merged: dict[str, list[Result]] = {}
        for path in args.summarize:
            for engine, rows in json.loads(path.read_text()).items():
                merged.setdefault(engine, []).extend(Result(**r) for r in rows)
        print(f"{len(next(iter(merged.values()), []))} schemas from {len(args.summarize)} file(s)")
        rows = [summarize(rs[0].engine, rs) for rs in merged.values() if rs]
        print_table(rows)
        print_common_compiles(merged)
        print_wall_times(rows)
        if merged.get("radixlm"):
            print_targets(summarize(merged["radixlm"][0].engine, merged["radixlm"]))
            print_refusals(merged["radixlm"])
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
    keys = [e.strip() for e in args.engines.split(",") if e.strip()]
    command = " ".join(["python -m benchmarks.grammar", *(sys.argv[1:] if argv is None else argv)])
    print(f"load average (1 min) at the start: {os.getloadavg()[0]:.1f}", flush=True)

    if args.batch_masks:
        batch_masks(keys, tokenizer, args.data, names, args)
    elif args.vocab_scaling:
        sizes = [int(s) for s in args.vocab_scaling.split(",")]
        vocab_scaling(sizes, tokenizer, args.data, names, args)
    elif args.compile_in_process:
        engines = make_engines(keys, tokenizer, 10 * args.timeout, args.allow_unlisted)
        compile_in_process(engines, args.data, names)
    else:
        engines = make_engines(keys, tokenizer, 10 * args.timeout, args.allow_unlisted)
        t0 = time.time()
        results = run_sample(engines, tokenizer, args.data, names, args.timeout, args.verbose)
        rows = [summarize(engines[key].name, rs) for key, rs in results.items()]
        print(
            f"\n{len(names)} schemas, {time.time() - t0:.0f} s; SmolLM2-135M tokenizer; "
            f"compact JSON, keys in schema order; {args.timeout:g} s per-schema compile timeout"
        )
        print_table(rows)
        print_common_compiles(results)
        print_wall_times(rows)
        if "radixlm" in results:
            print_targets(rows[list(results).index("radixlm")])
            print_refusals(results["radixlm"])
        if args.json:
            args.json.write_text(
                json.dumps({k: [r.__dict__ for r in rs] for k, rs in results.items()}, indent=1)
            )
    print(f"\nload average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    print(f"command: {command}")


if __name__ == "__main__":
    main()
