"""Quality of quantized schemes against the unquantized model, on the real default model.

    python -m benchmarks.quant_quality [--device cpu|cuda] [--rows fp8-kv] [--chunk 256]
                                       [--greedy-prompts 100] [--what-if]

For each row (a scheme: the engine options that turn it on) and for the unquantized model (the
same options without them: float32 on the CPU, bfloat16 on a GPU), every text of the set
(tests/prompts.py `varied_prompts`: prose, code, lists, chat, 1 to ~1,100 tokens; ~5k tokens in
all) is scored teacher-forced through the engine's own model, KV pool and attention backend, in
prompt chunks of `--chunk` tokens (later chunks read the earlier ones' K/V back from the pool, as
chunked prefill and the radix cache do). The table gives, per row:

- `top-1`: the share of positions whose argmax equals the unquantized model's;
- `mean KL`: KL(unquantized || scheme) of the next-token distributions, in nats, averaged;
- `greedy-32` (with `--greedy-prompts N`): of N prompts (tests/prompts.py `hundred_prompts`),
  how many give the same first 32 greedy tokens as the unquantized engine.

Rows are pluggable: add a `Scheme` to `SCHEMES` (a name, the engine options, a note). With
`--what-if`, rows that no option ships are measured too (`WHAT_IF`): the KV cache rounded to
float8 with a scale per token and head instead of the per-layer one, emulated in a pool of the
model's dtype (each stored K/V row rounded to float8 at its own amax / 448 and back).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

import radixlm
from benchmarks.common import commit, device_line
from tests.prompts import hundred_prompts, varied_prompts


@dataclass(frozen=True)
class Scheme:
    """A row of the table: the engine options that turn the scheme on, and what it is."""

    name: str
    engine_kwargs: dict = field(default_factory=dict)
    note: str = ""
    # for a what-if row: a context manager that patches the unquantized engine into the scheme
    patch: Callable[[], contextlib.AbstractContextManager] | None = None


SCHEMES: dict[str, Scheme] = {
    "fp8": Scheme(
        "FP8 W8A8 weights (quantization=fp8)",
        {"quantization": "fp8"},
        "float8 weights, a scale per output channel; activations per token; LM head unquantized",
    ),
    "w4a16": Scheme(
        "INT4 W4A16 weights (quantization=w4a16)",
        {"quantization": "w4a16"},
        "INT4 weights in groups of 128 (64 where K is not a multiple), min-max, zero points",
    ),
    "fp8-kv": Scheme(
        "FP8 KV cache",
        {"kv_cache_dtype": "fp8_e4m3"},
        "K/V stored as float8_e4m3fn, per-layer scales (1.0, SGLang's default)",
    ),
}


@contextlib.contextmanager
def _per_token_fp8_kv() -> Iterator[None]:
    """The torch backend's K/V store rounding each (token, head) row to float8 at its own scale
    (amax / 448) and back into the model-dtype pool: per-token-head fp8 numerics."""
    from radixlm.kernels import attention_ref

    real = attention_ref.store_kv_ref

    def rounded(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / attention_ref.FP8_E4M3_MAX
        return ((xf / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)

    def store(k_pool, v_pool, loc, k, v, k_scale=1.0, v_scale=1.0):
        real(k_pool, v_pool, loc, rounded(k), rounded(v), k_scale, v_scale)

    attention_ref.store_kv_ref = store
    try:
        yield
    finally:
        attention_ref.store_kv_ref = real


@contextlib.contextmanager
def _fp8_weight_only() -> Iterator[None]:
    """FP8 layers multiplying by the activations as they are (the batch-1 GEMV's numerics, W8A16)
    on every path."""
    from radixlm.kernels.quant_ref import fp8_linear_ref
    from radixlm.runtime.quantization.fp8 import Fp8Linear

    real = Fp8Linear.apply

    def apply(self, layer, x, out_dtype=None):
        w, s, b = layer.weight, layer.weight_scale, layer.bias
        return fp8_linear_ref(x, w, s, b, act_quant=False, out_dtype=out_dtype or x.dtype)

    Fp8Linear.apply = apply
    try:
        yield
    finally:
        Fp8Linear.apply = real


WHAT_IF: dict[str, Scheme] = {
    "fp8-weight-only": Scheme(
        "FP8 weights, activations unquantized (emulated)",
        {"quantization": "fp8"},
        "what-if: W8A16, the batch-1 GEMV's numerics on every path",
        patch=_fp8_weight_only,
    ),
    "fp8-kv-per-token": Scheme(
        "FP8 KV, per-token-head scale (emulated)",
        {"attention_backend": "torch"},
        "what-if: a scale per (token, head) of amax / 448; not shipped",
        patch=_per_token_fp8_kv,
    ),
}


def teacher_forced_logits(engine, ids: list[int], chunk: int) -> torch.Tensor:
    """(len(ids), vocab) float32 logits of `ids` through the engine's model, KV pool and attention
    backend, `chunk` tokens a forward (each chunk attends to the K/V the earlier ones stored).
    Runs on the engine's core thread between steps; the slots and row are handed back after."""
    from radixlm.runtime.forward_batch import ForwardBatch

    core = engine._core

    def run() -> torch.Tensor:
        runner, device = core.runner, core.device
        slots = core.cache._allocate(len(ids))  # (evicting cached prefixes if need be)
        row = core.rows.allocate()
        try:
            core.rows.write(row, 0, slots)
            out = []
            for start in range(0, len(ids), chunk):
                n = min(chunk, len(ids) - start)
                batch = ForwardBatch(
                    input_ids=torch.tensor(ids[start : start + n], device=device),
                    positions=torch.arange(start, start + n, device=device),
                    out_cache_loc=slots[start : start + n].to(device),
                    req_pool_indices=torch.tensor([row], device=device),
                    prefix_lens=torch.tensor([start], device=device),
                    extend_lens=torch.tensor([n], device=device),
                    seq_lens=torch.tensor([start + n], device=device),
                    logits_indices=None,
                    extend_lens_cpu=[n],
                    prefix_lens_cpu=[start],
                    num_multi=1 if n > 1 else 0,
                )
                out.append(runner.model(batch, runner.backend).float().cpu())
            return torch.cat(out)
        finally:
            core.rows.free(row)
            core.allocator.free(slots)

    return core.call(run)


def compare(want: torch.Tensor, got: torch.Tensor) -> tuple[int, int, float]:
    """(positions whose argmax agrees, positions, summed KL(want || got) in nats)."""
    same = int((want.argmax(-1) == got.argmax(-1)).sum())
    lp_want, lp_got = want.log_softmax(-1), got.log_softmax(-1)
    kl = (lp_want.exp() * (lp_want - lp_got)).nan_to_num(0.0).sum(-1)  # (-inf - -inf: 0 weight)
    return same, want.shape[0], float(kl.sum())


def score(engine, texts: list[list[int]], chunk: int) -> list[torch.Tensor]:
    return [teacher_forced_logits(engine, ids, chunk) for ids in texts]


def greedy(engine, prompts: list[str], tokens: int) -> list[list[int]]:
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    return [o["output_ids"] for o in engine.generate(prompts, params)]


@dataclass
class Row:
    name: str
    note: str
    top1: float
    mean_kl: float
    greedy: str
    seconds: float


def measure(
    scheme: Scheme | None,
    base_kwargs: dict,
    texts: list[list[int]],
    chunk: int,
    greedy_prompts: list[str],
    reference: tuple[list[torch.Tensor], list[list[int]]] | None,
):
    """Score one row (None: the unquantized reference); returns its logits and greedy outputs
    and, against `reference`, its Row."""
    kwargs = {**base_kwargs, **(scheme.engine_kwargs if scheme else {})}
    t0 = time.perf_counter()
    patch = scheme.patch() if scheme and scheme.patch else contextlib.nullcontext()
    with patch, radixlm.Engine(**kwargs) as engine:
        logits = score(engine, texts, chunk)
        outs = greedy(engine, greedy_prompts, 32) if greedy_prompts else []
    seconds = time.perf_counter() - t0
    if reference is None or scheme is None:
        return logits, outs, None
    same = total = 0
    kl = 0.0
    for want, got in zip(reference[0], logits):
        s, n, k = compare(want, got)
        same, total, kl = same + s, total + n, kl + k
    agree = (
        f"{sum(a == b for a, b in zip(reference[1], outs))}/{len(outs)}" if greedy_prompts else "-"
    )
    return logits, outs, Row(scheme.name, scheme.note, same / total, kl / total, agree, seconds)


def print_table(rows: list[Row], num_positions: int) -> None:
    print(f"\nteacher-forced over {num_positions} positions; greedy-32 vs the unquantized engine")
    print(f"| {'scheme':<42} | top-1 | mean KL (nats) | greedy-32 | seconds | note")
    print(f"|{'-' * 44}|-------|----------------|-----------|---------|-----")
    for r in rows:
        print(
            f"| {r.name:<42} | {100 * r.top1:5.2f}% | {r.mean_kl:14.5f} | {r.greedy:>9} "
            f"| {r.seconds:7.1f} | {r.note}"
        )


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default=",".join(SCHEMES), help="comma-separated SCHEMES keys")
    ap.add_argument("--chunk", type=int, default=256, help="tokens a forward when scoring")
    ap.add_argument("--texts", type=int, default=0, help="only the first N texts (0: all)")
    ap.add_argument("--greedy-prompts", type=int, default=0, help="also greedy-32 on N prompts")
    ap.add_argument("--what-if", action="store_true", help="the WHAT_IF rows too")
    ap.add_argument("--model-path", default=None, help="default: the embedded default model")
    args = ap.parse_args(argv)

    chosen = {}
    for key in filter(None, args.rows.split(",")):
        if key not in SCHEMES:
            ap.error(f"unknown row {key!r}; the rows are {', '.join(SCHEMES)}")
        chosen[key] = SCHEMES[key]
    if args.what_if:
        chosen.update(WHAT_IF)
    if args.chunk < 1:
        ap.error("--chunk must be at least 1")

    from radixlm.runtime import model_loader
    from radixlm.runtime.config import default_cache_dir

    print(f"# quant_quality: {device_line()}, commit {commit()}")
    folder = model_loader.resolve_model_folder(args.model_path, default_cache_dir())
    tokenizer = model_loader.load_tokenizer(folder)
    base = {"model_path": str(folder), "device": args.device, "max_total_tokens": 4096}
    texts = [tokenizer.encode(t) for t in varied_prompts()]
    if args.texts:
        texts = texts[: args.texts]
    texts = [t[:2048] for t in texts]  # (within the pool and any model's context)
    prompts = hundred_prompts()[: args.greedy_prompts]
    ref_logits, ref_outs, _ = measure(None, base, texts, args.chunk, prompts, None)
    rows = []
    for scheme in chosen.values():
        _, _, row = measure(scheme, base, texts, args.chunk, prompts, (ref_logits, ref_outs))
        rows.append(row)
        print(f"  {row.name}: top-1 {100 * row.top1:.2f}%, mean KL {row.mean_kl:.5f}", flush=True)
    print_table(rows, sum(len(t) for t in texts))
    return rows


if __name__ == "__main__":
    main()
