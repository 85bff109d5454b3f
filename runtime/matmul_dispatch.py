"""Which kernel runs each matmul of a decode step: cuBLAS or a tuned Triton GEMV (kernels/gemv.py).

`LinearDispatch` is the model's matmul hook (`runtime.layers.PlainMatmuls`, whose torch code stays
the oracle and the default): per op (a plain linear, or one with the RMSNorm or SiLU-and-mul before
it as the kernel's prologue), rows of x and weight shape, the plain path or the GEMV tile that
measured faster when `tune` timed them at start-up, replayed from CUDA graphs as a decode step runs
them.

A quantized layer (runtime/quantization/) runs its scheme's plain path (FP8: `torch._scaled_mm`)
or the GEMV over its stored weights and their scales; tiles are checked against the scheme's
`reference` (the GEMV's own numerics), so FP8 and unquantized layers of one shape have their own
choices (the key holds the weight's dtype).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import SimpleNamespace

import torch

from radixlm.kernels import gemv
from radixlm.kernels.gemv import (
    CONFIGS,
    FP8_CONFIGS,
    FUSED_CONFIGS,
    HALF_CONFIGS,
    INT4_CONFIGS,
    MAX_ROWS,
    MAX_ROWS_WITHOUT_DOT,
    OPS,
    GemvConfig,
)
from radixlm.runtime.layers import PlainMatmuls, float32_linear
from radixlm.runtime.quantization.base import scheme_of

# (op, rows of x, N, K, whether the linear has a bias, the weight's dtype)
ChoiceKey = tuple[str, int, int, int, bool, str]


def choice_key(op: str, rows: int, linear: torch.nn.Linear) -> ChoiceKey:
    """The key of `LinearDispatch.choice` and `.timings` for `op` at `rows` rows before `linear`."""
    n, k = linear.weight.shape
    return (op, rows, n, k, linear.bias is not None, str(linear.weight.dtype))


class LinearDispatch(PlainMatmuls):
    """Per (op, rows of x, weight shape, bias or not: `choice_key`): the plain path (cuBLAS, after
    a separate norm or SiLU kernel for the fused ops) or a Triton kernel with its best tile,
    whichever measured faster. Empty (everything on the plain path) until `tune` has run for a
    shape."""

    def __init__(self) -> None:
        self.choice: dict[ChoiceKey, GemvConfig | None] = {}
        # per choice key, (ms, tile) of each tile that ran and matched the plain path, fastest first
        self.timings: dict[ChoiceKey, list[tuple[float, GemvConfig]]] = {}
        self.plain_ms: dict[ChoiceKey, float] = {}  # per choice key, the plain path's time

    def _chosen(
        self, op: str, x: torch.Tensor, linear: torch.nn.Linear, rows: torch.Tensor | None = None
    ) -> GemvConfig | None:
        m = x.shape[0] if rows is None else rows.shape[0]
        if x.dim() != 2 or m > MAX_ROWS or x.stride(-1) != 1:
            return None
        config = self.choice.get(choice_key(op, m, linear))
        if config is not None and m > MAX_ROWS_WITHOUT_DOT and not config.dot:
            return None  # (only the dot tiles take that many rows)
        return config

    def has_kernel(self, x: torch.Tensor, linear: torch.nn.Linear) -> bool:
        return self._chosen("linear", x, linear) is not None

    def __call__(self, x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
        config = self._chosen("linear", x, linear)
        if config is not None:
            w, quant = scheme_of(linear).gemv_operands(linear)
            return gemv.gemv(x, w, linear.bias, config, **quant)
        return scheme_of(linear).apply(linear, x)

    def float32(self, x, linear):
        config = self._chosen("linear", x, linear)
        if config is not None:
            w, quant = scheme_of(linear).gemv_operands(linear)
            return gemv.gemv(x, w, linear.bias, config, out_dtype=torch.float32, **quant)
        return super().float32(x, linear)

    def norm_linear(self, x, residual, norm, linear, rows=None, float32=False):
        op = "rms_norm" if residual is None else "rms_norm_residual"
        # with `rows`, the kernel takes only those rows (the norm is per row)
        config = self._chosen(op, x, linear, rows)
        if (
            config is None
            or norm.weight.dtype != x.dtype
            or (residual is not None and residual.shape != x.shape)
        ):
            return super().norm_linear(x, residual, norm, linear, rows, float32)
        if rows is not None:
            x, residual = x[rows], None if residual is None else residual[rows]
        elif residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        w, quant = scheme_of(linear).gemv_operands(linear)
        y, summed = gemv.gemv_rms_norm(
            x, residual, norm.weight, norm.eps, w, linear.bias, config,
            out_dtype=torch.float32 if float32 else None, **quant,
        )  # fmt: skip
        if rows is not None:
            return y, None
        return y, x if summed is None else summed

    def silu_linear(self, gate_up, linear):
        config = self._chosen("silu_and_mul", gate_up, linear)
        if config is None:
            return super().silu_linear(gate_up, linear)
        w, quant = scheme_of(linear).gemv_operands(linear)
        return gemv.gemv_silu_and_mul(gate_up, w, linear.bias, config, **quant)

    def tune(
        self,
        linear: torch.nn.Linear,
        rows: int,
        op: str = "linear",
        norm=None,
        float32: bool = False,
        dot_only: bool = False,
    ) -> tuple[float, float]:
        """Time the plain path of `op` and each candidate kernel on random input of `rows` rows (in
        a CUDA graph: `graph_ms`) and keep the fastest (a kernel only on a clear win). For the
        fused ops the plain path is the norm (`norm`, the model's RMSNorm) or SiLU kernel and then
        this dispatch's linear, so tune "linear" for the shape first. `float32`: the layer's output
        is float32 (the LM head: `float32_linear`), on both paths. `dot_only`: only the tl.dot
        tiles (as always above MAX_ROWS_WITHOUT_DOT rows), whose compiled kernels are shared by
        every row count of the same power of two. Returns (plain ms, chosen ms)."""
        key = choice_key(op, rows, linear)
        plain, kernel, oracle = self._candidate_calls(op, linear, rows, norm, float32)
        want = oracle(linear).float()
        base = self.plain_ms[key] = graph_ms(plain, linear)
        stored = _weights(linear)[0].dtype  # packed INT4 and float8 weights: their tiles too
        candidates = CONFIGS + {
            torch.uint8: INT4_CONFIGS + HALF_CONFIGS,
            torch.float8_e4m3fn: FP8_CONFIGS + HALF_CONFIGS,
        }.get(stored, [])
        if os.environ.get("RADIXLM_DISABLE_HALF_TILES") == "1":  # (an ablation's switch)
            candidates = [c for c in candidates if not c.half]
        if op != "linear":
            ranked = self.timings.get(choice_key("linear", rows, linear), [])
            fastest = [c for _, c in ranked[:2]]
            candidates = fastest + [c for c in FUSED_CONFIGS if c not in fastest]
        if rows > MAX_ROWS_WITHOUT_DOT:
            dot_only = True
        if dot_only:
            candidates = [c for c in candidates if c.dot]
        timed = []
        for config in candidates:
            call = functools.partial(kernel, config)
            try:
                got = call(linear)
            except Exception:  # a tile this GPU cannot run (shared memory, registers)
                continue
            if not torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2):
                continue
            timed.append((graph_ms(call, linear), config))
        timed.sort(key=lambda t: t[0])
        self.timings[key] = timed
        best, best_ms = None, base
        if timed and timed[0][0] < base * 0.97:  # a clear win only
            best_ms, best = timed[0]
        self.choice[key] = best
        return base, best_ms

    def _candidate_calls(
        self, op: str, linear: torch.nn.Linear, rows: int, norm, float32: bool = False
    ):
        """(the plain path, a kernel given its tile, the oracle the kernel must match) of `op` on
        fixed random inputs, each a function of the linear layer (or a copy of its weight: see
        `graph_ms`) returning y. The oracle is the plain path with the scheme's `reference`
        matmul (for an unquantized layer, the plain path in float32)."""
        w = linear.weight
        dtype = norm.weight.dtype if norm is not None else _activation_dtype(linear)
        k = linear.in_features  # (a packed weight has fewer columns)
        x = torch.randn(rows, k, device=w.device, dtype=dtype)
        out = torch.float32 if float32 else None
        oracle = _ReferenceMatmuls()
        if op == "linear":
            return (
                (lambda lin: float32_linear(x, lin))
                if float32
                else (lambda lin: scheme_of(lin).apply(lin, x)),
                lambda c, lin: gemv.gemv(
                    x, _weights(lin)[0], lin.bias, c, out_dtype=out, **_weights(lin)[1]
                ),
                lambda lin: oracle(x, lin),
            )
        if op == "silu_and_mul":
            gate_up = torch.randn(rows, 2 * k, device=w.device, dtype=dtype)
            return (
                lambda lin: PlainMatmuls.silu_linear(self, gate_up, lin),
                lambda c, lin: gemv.gemv_silu_and_mul(
                    gate_up, _weights(lin)[0], lin.bias, c, **_weights(lin)[1]
                ),
                lambda lin: oracle.silu_linear(gate_up, lin),
            )
        if op not in OPS or norm is None:
            raise ValueError(f"unknown op {op!r} (one of {OPS}; the norm ops need the norm)")
        res = torch.randn_like(x) if op == "rms_norm_residual" else None
        return (
            lambda lin: PlainMatmuls.norm_linear(self, x, res, norm, lin, float32=float32)[0],
            lambda c, lin: gemv.gemv_rms_norm(
                x, res, norm.weight, norm.eps, _weights(lin)[0], lin.bias, c, out_dtype=out,
                **_weights(lin)[1],
            )[0],
            lambda lin: oracle.norm_linear(x, res, norm, lin, float32=float32)[0],
        )  # fmt: skip


class _ReferenceMatmuls(PlainMatmuls):
    """The plain path with each layer's `reference` matmul (float32 out): a GEMV tile's oracle."""

    def __call__(self, x, linear):
        return scheme_of(linear).reference(linear, x)

    def float32(self, x, linear):
        return scheme_of(linear).reference(linear, x)


def _weights(linear) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return scheme_of(linear).gemv_operands(linear)


def _activation_dtype(linear: torch.nn.Linear) -> torch.dtype:
    """The dtype the layer's input has: the model's (a quantized layer records it)."""
    return getattr(linear, "compute_dtype", linear.weight.dtype)


_L2_SPILL_BYTES = 256 << 20  # weight copies read per replay: beyond any GPU's L2


def graph_ms(call: Callable[[torch.nn.Linear], object], linear: torch.nn.Linear) -> float:
    """Milliseconds per `call(linear)` as a decode step's CUDA graph runs it: replayed from a graph,
    back to back with no host in between, over copies of the weight that together overflow L2 (in
    a step each layer's weights come from memory)."""
    w, b = linear.weight, linear.bias
    copies = max(1, min(512, _L2_SPILL_BYTES // (w.numel() * w.element_size())))
    linears = [linear]
    # (a quantized layer's copy keeps its scheme and scales)
    extra = {
        k: getattr(linear, k)
        for k in ("quant_scheme", "weight_scale", "weight_zero", "compute_dtype")
        if hasattr(linear, k)
    }
    try:
        while len(linears) < copies:
            linears.append(SimpleNamespace(weight=w.clone(), bias=b, **extra))
    except torch.cuda.OutOfMemoryError:  # fewer copies: some reads may hit L2
        pass
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for lin in linears[:2]:
            call(lin)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # A stream of our own: torch's default capture stream belongs to whichever GPU first captured
    # in this process, and capturing on it moves the work there (a second engine on "cuda:1").
    with torch.cuda.graph(graph, stream=stream):
        for lin in linears:
            call(lin)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (reps * len(linears))
