"""GGUF weights run as stored (`quantization="gguf"` on a GGUF file): each linear layer keeps the
file's raw blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; kernels/gguf_ref.py describes them), a quarter
to a seventh of float32's bytes, and multiplies by them.

- On the CPU: the C++ kernels of kernels/gguf_cpu.cpp (built at first use), which read the blocks
  once a step up to 64 rows of x and dequantize the layer for a matmul past that; float32
  arithmetic throughout, so the result is the dequantized weight's F.linear up to the order of the
  sums. A decode step of up to 64 requests runs in one call of them (`FusedDecode`). Without a
  compiler: the torch dequantization below at every call (correct, slow).
- On a GPU, a layer whose parts are all of the 4-bit types (Q4_0, Q4_1, Q4_K) is put in the
  INT4 layout at load
  (kernels/gguf_ref.py `as_int4`: the same integers, in another order within a row, a float32
  scale and zero point a group of 32) and computed as INT4 W4A16 layers are
  (runtime/quantization/int4.py): the Triton GEMV at batch 1-4, the dequantizing Triton matmul
  past that. That reads 6 bits a weight (4, plus a float32 scale and zero point a group of 32)
  against the file's 4.5-5. A layer with a Q8_0 or Q6_K part (a Q4_K_M file's fused q/k/v, whose
  v is Q6_K; the default model's Q8_0 LM head) is put in the int8 layout at load (`as_int8`: the
  file's integers a byte each with a float32 scale a group, 32 columns for Q8_0 and 16 for Q6_K,
  the values exactly the file's, no zero points but a mixed layer's) and computed by the same
  kernels, which read int8 tiles too: 9 or 10 bits a weight (10 or 12 with zero points) against
  the file's 8.5 or 6.6, and bf16's 16. (Dequantizing blocks at
  every call, as before the INT4 layout, measured 19-25x a bf16 matmul's time at batch 1 for the
  4-bit types: benchmarks/quant_gemv.py.)

The oracle (`reference`) is the gguf package's own dequantization and F.linear (`as_int4`'s test
holds the INT4 layout to it).

Where the weights come from: the model's config, tokenizer and norms are read from the folder the
GGUF is converted to as before (runtime/model_loader.py); the decoder's linear layers, and the LM
head (the output tensor, or the token embedding it shares), from the GGUF file itself
(`GgufWeights`). A tied head's blocks serve the embedding too (`GgufEmbedding`: rows dequantized
as they are looked up); an untied model's embedding is the converted folder's, in float. llama.cpp stores a Llama GGUF's q and k rows permuted for its rotary layout;
they are put back in Hugging Face's order here, as transformers does for the converted folder
(whole rows move: the blocks of a row stay as they are).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import gguf_ref
from radixlm.kernels.gguf_ref import BLOCK_TYPES, row_bytes
from radixlm.runtime.quantization.base import (
    LinearScheme,
    replace_parameter,
    scheme_of,
)
from radixlm.runtime.quantization.int4 import Int4Linear, Int8GroupsLinear

SUPPORTED_TYPES = ", ".join(name for name, _, _ in BLOCK_TYPES.values())
_TYPE_IDS = {name: gtype for gtype, (name, _, _) in BLOCK_TYPES.items()}

# GGUF tensor name (within blk.N) -> Hugging Face's (within model.layers.N)
_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# our fused layers' parts, in order (runtime/models/llama.py STACKED_PARTS)
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class GgufLinear(LinearScheme):
    """One linear layer over GGUF blocks: `types` the block type of each part of the layer (q, k,
    v of a fused projection; one for a plain layer). The weight is (N, bytes a row) uint8, the
    parts' rows one after the other; parts of different types (a Q4_K_M file's Q6_K v among Q4_K
    q and k) are multiplied apart, each row padded to the widest part's bytes."""

    name = "gguf"
    quantized = True
    # (the Triton GEMV does not read GGUF blocks: on a GPU the layer becomes an INT4 or an
    # unquantized one at load, `process_after_loading`)
    has_gemv = False

    def __init__(self, types: tuple[int, ...]) -> None:
        self.types = types
        self.k = 0
        self.bounds: list[tuple[int, int, int]] = []  # (first row, end row, type) runs
        self.runs: list[torch.Tensor] = []  # each run's rows (process_after_loading)

    def create_weights(self, layer: nn.Linear) -> None:
        comm = getattr(layer, "comm", None)
        if comm is not None and comm.size > 1:
            raise ValueError("quantization='gguf' runs with tp_size=1 only for now")
        n, k = layer.weight.shape
        rows = (
            [layer.part_rows(i) for i in range(len(self.types))]
            if len(self.types) > 1
            else [(0, n)]
        )
        self.k, self.bounds = k, []
        for (start, end), gtype in zip(rows, self.types):
            if k % BLOCK_TYPES[gtype][1]:
                raise ValueError(
                    f"a layer's {k} input columns are not whole {BLOCK_TYPES[gtype][0]} blocks"
                )
            if self.bounds and self.bounds[-1][2] == gtype and self.bounds[-1][1] == start:
                self.bounds[-1] = (self.bounds[-1][0], end, gtype)
            else:
                self.bounds.append((start, end, gtype))
        width = max(row_bytes(gtype, k) for gtype in self.types)
        device = layer.weight.device
        layer.compute_dtype = layer.weight.dtype  # (the model's: its inputs' and outputs')
        replace_parameter(layer, "weight", torch.empty(n, width, dtype=torch.uint8, device=device))

    def checkpoint_tensor(self, layer, leaf, tensor, index):
        if leaf != "weight":
            return tensor
        if tensor.dtype != torch.uint8:
            raise ValueError(
                "quantization='gguf' reads a GGUF file's blocks; this layer was given "
                f"{str(tensor.dtype).removeprefix('torch.')} weights"
            )
        width = layer.weight.shape[1]
        if tensor.shape[1] < width:  # a narrower part of a layer of mixed types
            tensor = F.pad(tensor, (0, width - tensor.shape[1]))
        return tensor

    def process_after_loading(self, layer: nn.Linear) -> None:
        if layer.weight.is_cuda:
            if all(gtype in gguf_ref.INT4_TYPES for *_, gtype in self.bounds):
                self._to_int4(layer)
            else:
                self._to_int8(layer)
            return
        # each run of rows of one type as a tensor of its own (contiguous: what the kernels read)
        self.runs = [
            layer.weight.data[start:end, : row_bytes(gtype, self.k)].contiguous()
            if len(self.bounds) > 1
            else layer.weight.data
            for start, end, gtype in self.bounds
        ]

    def _to_int4(self, layer: nn.Linear) -> None:
        """On a GPU, a layer of 4-bit blocks: in the INT4 layout (each run of rows converted by
        its type), and from then on an INT4 layer (`Int4Linear`: its GEMV, its matmul)."""
        parts = [
            gguf_ref.as_int4(layer.weight.data[start:end], gtype, self.k)
            for start, end, gtype in self.bounds
        ]
        packed, scale, zero = (torch.cat(t) if len(t) > 1 else t[0] for t in zip(*parts))
        replace_parameter(layer, "weight", packed)
        replace_parameter(layer, "weight_scale", scale)
        replace_parameter(layer, "weight_zero", zero)
        layer.quant_scheme = Int4Linear()

    def _to_int8(self, layer: nn.Linear) -> None:
        """On a GPU, a layer with a Q8_0 or Q6_K part: in the int8 layout at load (each run of
        rows converted by its type, exactly; the 4-bit parts of a mixed layer as `as_int4` puts
        them, a byte a value), and from then on computed as INT4 layers are
        (`Int8GroupsLinear`)."""
        group = min(gguf_ref.INT8_GROUPS[gtype] for *_, gtype in self.bounds)
        parts = [
            gguf_ref.as_int8(layer.weight.data[start:end], gtype, self.k, group)
            for start, end, gtype in self.bounds
        ]
        replace_parameter(layer, "weight", torch.cat([q for q, _, _ in parts]))
        replace_parameter(layer, "weight_scale", torch.cat([s for _, s, _ in parts]))
        zero = None  # (Q8_0 and Q6_K: symmetric, no zero points read)
        if any(z is not None for _, _, z in parts):  # (a mixed layer: 0 for those parts' rows)
            zero = torch.cat([torch.zeros_like(s) if z is None else z for _, s, z in parts])
        if zero is not None:
            replace_parameter(layer, "weight_zero", zero)
        else:
            layer.weight_zero = None
        layer.quant_scheme = Int8GroupsLinear()

    def apply(self, layer, x, out_dtype=None):
        kernels = _cpu_kernels() if not x.is_cuda else None
        if kernels is not None and len(self.runs) == 1 and layer.bias is None:  # (the usual)
            y = kernels.matmul(x, self.runs[0], self.bounds[0][2], self.k)
            return y if (out_dtype or x.dtype) == torch.float32 else y.to(out_dtype or x.dtype)
        ys = []
        for part, (_, _, gtype) in zip(self.runs, self.bounds):
            if kernels is not None:
                ys.append(kernels.matmul(x, part, gtype, self.k))
            else:  # no compiler: dequantize, then multiply (correct, slow)
                ys.append(F.linear(x.float(), gguf_ref.dequantize(part, gtype, self.k)))
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if layer.bias is not None:
            y = y + layer.bias.float()
        return y.to(out_dtype or x.dtype)

    def reference(self, layer, x):
        return F.linear(x.float(), self.dequantized_weight(layer).to(x.device), _bias(layer))

    def gemv_operands(self, layer):
        raise NotImplementedError(
            "the Triton GEMV reads GGUF blocks only once a GPU converted them"
        )

    def dequantized_rows(self, layer: nn.Linear, ids: torch.Tensor) -> torch.Tensor:
        rows = layer.weight[ids]  # (T, bytes): a copy, contiguous
        kernels = _cpu_kernels() if not rows.is_cuda else None
        if kernels is not None:
            return kernels.dequantize(rows, self.bounds[0][2], self.k)
        return gguf_ref.dequantize(rows, self.bounds[0][2], self.k)

    def dequantized_weight(self, layer: nn.Linear) -> torch.Tensor:
        """The float32 weight (N, K) the layer stands for, by the gguf package (the oracle)."""
        parts = [
            gguf_ref.gguf_package_dequantize(layer.weight[start:end], gtype, self.k)
            for start, end, gtype in self.bounds
        ]
        return torch.cat(parts)


class GgufEmbedding(nn.Module):
    """The token embedding of a GGUF whose LM head is the embedding (a tied head: token_embd):
    its rows looked up in the head's blocks and dequantized as they are read, so that one copy of
    the blocks serves both (the float conversion kept a float32 embedding of its own). The values
    are the float conversion's: float32 products of the same scales and integers."""

    def __init__(self, head: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = [head]  # (not a submodule: the head's parameter is the LM head's alone)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        x = scheme_of(head).dequantized_rows(head, ids.reshape(-1))
        return x.view(*ids.shape, head.in_features).to(self.dtype)


# steps of at most this many tokens (decode steps) run torch's own ops on one thread
SMALL_STEP_TOKENS = 8


def wrap_cpu_forward(model: nn.Module) -> None:
    """On the CPU, the model's forward for GGUF blocks: a step that `FusedDecode` covers runs as
    one call of the kernels; any other goes through the layers. And a step of few tokens, and
    what the engine does after it (sampling), runs
    torch's ops (norms, rotary, attention, sampling's) on the calling thread alone, while the
    GGUF matmuls keep their own threads (kernels/gguf_cpu.py); a larger step (a prompt, whose
    matmuls are torch's over dequantized layers) takes torch's threads back. At batch 1 those ops
    are tiny, and spreading each over torch's threads costs more than it saves: on the 2-core
    machine a default-model decode step took 6.5 ms outside the matmuls on one thread against 12
    on two, and the engine decoded 50 tokens/s against 28. The count is set for each step and left
    as it is (setting it back after every step cost most of the gain: the next step then woke
    torch's sleeping workers)."""
    real = model.forward
    threads = torch.get_num_threads()  # (the engine's: this is the thread that loads it)
    fused = FusedDecode(model, _cpu_kernels())

    def forward(batch, backend, *args, **kwargs):
        want = 1 if batch.num_tokens <= SMALL_STEP_TOKENS else threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
        if not args and not kwargs and fused.applies(batch, backend):
            return fused(batch, backend)
        return real(batch, backend, *args, **kwargs)

    model.forward = forward


class FusedDecode:
    """On the CPU, a step of up to 64 token rows (decodes of up to 64 requests, a verify step, a
    short prompt chunk; hidden states kept for a drafter too) of a Llama model whose linear
    layers are all GGUF blocks runs as one call of the kernels (gguf_cpu.cpp `DecodePlan`): the
    decoder's ~40 torch ops a layer each cost microseconds of dispatch, more than the layer's
    arithmetic, at this size (the default model spent 9 ms of a 22 ms batch-1 step outside its
    matmuls). Every other step, and a model or pool the call does not cover (another
    architecture, biases, a float8 or bfloat16 pool, tensor parallelism), runs the model's own
    forward, which is also the oracle the call is checked against. `enabled` switches it off
    (comparisons)."""

    enabled = True

    def __init__(self, model: nn.Module, kernels) -> None:
        self.model, self.kernels = model, kernels
        self.plan, self.plan_for = None, None  # (the pool the plan was made for)
        self.supported: bool | None = None  # (known at the first step: the rotary tables and
        # the pool are made after the weights load)

    @staticmethod
    def _supported(model: nn.Module) -> bool:
        from radixlm.runtime.models.llama import DecoderLayer

        def single(layer) -> bool:
            scheme = getattr(layer, "quant_scheme", None)
            return (
                isinstance(scheme, GgufLinear) and layer.bias is None
                and getattr(getattr(layer, "comm", None), "size", 1) == 1
            )  # fmt: skip

        layers = list(getattr(model, "layers", []))
        return (
            bool(layers)
            and all(type(layer) is DecoderLayer for layer in layers)
            and all(not layer.self_attn.qk_norm for layer in layers)
            and all(single(m) for layer in layers for m in _layer_linears(layer))
            and single(model.lm_head)
            and model.rope.cos.dtype == torch.float32
            and model.rope.cos.shape[-1] * 2 == layers[0].self_attn.head_dim
            and all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point())
        )

    def applies(self, batch, backend) -> bool:
        from radixlm.runtime.attention import TorchAttentionBackend

        if self.supported is None:
            self.supported = self._supported(self.model)
        return (
            self.enabled
            and self.supported
            and 1 <= batch.num_tokens <= self.kernels.tiled_rows
            and batch.padding == 0
            and batch.extend_blocks is None
            and not batch.input_ids.is_cuda
            and type(backend) is TorchAttentionBackend
            and backend.kv_pool.dtype == torch.float32
            and not batch.aux_layers  # (an EAGLE-3 draft's features: the model's own forward)
        )

    def _plan_for(self, backend):
        pool = backend.kv_pool
        key = (id(pool), pool.k[0].data_ptr())
        if self.plan_for != key:
            model = self.model
            layers = list(model.layers)
            attn = layers[0].self_attn
            norms = [n.weight.data for layer in layers
                     for n in (layer.input_layernorm, layer.post_attention_layernorm)]  # fmt: skip
            norms.append(model.norm.weight.data)
            linears = [*(m for layer in layers for m in _layer_linears(layer)), model.lm_head]
            self.plan = self.kernels.DecodePlan(
                norms,
                [[torch.tensor(m.quant_scheme.k), *m.quant_scheme.runs] for m in linears],
                [[gtype for _, _, gtype in m.quant_scheme.bounds] for m in linears],
                list(pool.k), list(pool.v), model.rope.cos, model.rope.sin,
                attn.num_heads, attn.num_kv_heads, attn.head_dim,
                float(layers[0].input_layernorm.eps), float(attn.scale),
            )  # fmt: skip
            self.plan_for = key
        return self.plan

    def __call__(self, batch, backend) -> torch.Tensor:
        """Logits (L, vocab) in float32 at `batch.logits_indices`, as the model's forward gives
        them for this step (and its hidden states, where a drafter keeps them)."""
        model = self.model
        x = model.embed_tokens(batch.input_ids).reshape(batch.num_tokens, -1).float()
        # each token row's request and its keys' count: a prompt chunk's (or a verify's) rows
        # see the prefix and the chunk up to themselves
        if batch.num_multi == 0:
            lens = [p + 1 for p in batch.prefix_lens_cpu]
            requests = batch.req_pool_indices
        else:
            lens, of = [], []
            for i, (p, e) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
                lens.extend(range(p + 1, p + e + 1))
                of.extend([i] * e)
            requests = batch.req_pool_indices[torch.tensor(of)]
        keys = backend.req_to_token[requests, : max(lens)]
        rows = batch.logits_indices
        if rows is None:
            rows = torch.arange(batch.num_tokens)
        keep = batch.hidden_indices is not None
        logits, hidden = self._plan_for(backend).run(
            x, batch.positions, batch.out_cache_loc, keys, torch.tensor(lens), rows, keep
        )
        if keep:  # (for a drafter's heads: the final norm's output at its rows)
            batch.hidden_states = hidden[batch.hidden_indices]
        if model.sampled_vocab < logits.shape[-1]:
            logits[:, model.sampled_vocab :] = float("-inf")
        return logits


def _layer_linears(layer) -> tuple[nn.Linear, ...]:
    """A decoder layer's linear layers in the order DecodePlan takes them."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _bias(layer: nn.Linear) -> torch.Tensor | None:
    return None if layer.bias is None else layer.bias.float()


def _cpu_kernels():
    from radixlm.kernels import gguf_cpu

    return gguf_cpu.load()


@dataclass
class GgufTensor:
    name: str  # Hugging Face's
    gtype: int
    shape: tuple[int, int]  # (N, K)
    data: np.ndarray  # (N, row bytes) uint8, a view of the file's memory map


# GGUF metadata value types (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str  # the GGUF's
    gtype: int  # ggml's type id
    dims: tuple[int, ...]  # fastest-varying first, as GGUF lists them
    offset: int  # bytes from the start of the file
    nbytes: int


def read_tensor_table(path: str | Path) -> tuple[dict[str, object], list[TensorInfo]]:
    """A GGUF file's scalar metadata (arrays left out) and its tensors, read from its header
    alone: the gguf package's GGUFReader also builds every array (the vocabulary's 49,152
    tokens and their merges), seconds for the default model on a small CPU; this walks past them.
    The layout (GGUF v2 and v3, little-endian): magic, version, tensor and key counts; each key,
    its value type and value; each tensor's name, dimensions, type and offset; the data, aligned
    to `general.alignment` (32 unless given)."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        buf = f.read(1 << 20)
        pos = 0

        def need(n: int) -> None:
            nonlocal buf
            while pos + n > len(buf):
                more = f.read(max(n, 1 << 20))
                if not more:
                    raise ValueError("the file ends inside its header")
                buf += more

        def take(fmt: str):
            nonlocal pos
            size = struct.calcsize("<" + fmt)
            need(size)
            value = struct.unpack_from("<" + fmt, buf, pos)
            pos += size
            return value[0] if len(value) == 1 else value

        def string() -> str:
            nonlocal pos
            n = take("Q")
            need(n)
            text = bytes(buf[pos : pos + n]).decode("utf-8", errors="replace")
            pos += n
            return text

        def skip(vtype: int, count: int) -> None:
            nonlocal pos
            if vtype == _STRING:
                for _ in range(count):
                    n = take("Q")
                    need(n)
                    pos += n
            elif vtype == _ARRAY:
                for _ in range(count):
                    item, n = take("I"), take("Q")
                    skip(item, n)
            else:
                size = struct.calcsize("<" + _SCALARS[vtype]) * count
                need(size)
                pos += size

        if take("4s") != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        version = take("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read)")
        n_tensors, n_kv = take("Q"), take("Q")
        fields: dict[str, object] = {}
        for _ in range(n_kv):
            key, vtype = string(), take("I")
            if vtype == _STRING:
                fields[key] = string()
            elif vtype == _ARRAY:
                item, count = take("I"), take("Q")
                skip(item, count)
            else:
                fields[key] = take(_SCALARS[vtype])
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = tuple(take("Q") for _ in range(take("I")))
            gtype, offset = take("I"), take("Q")
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
            count = int(np.prod(dims))
            infos.append(TensorInfo(name, gtype, dims, offset, count // block * size))
    align = int(fields.get("general.alignment", 32))
    start = (pos + align - 1) // align * align
    for info in infos:
        info.offset += start
    return fields, infos


class GgufWeights:
    """The GGUF file's linear-layer tensors, under Hugging Face's names, as raw blocks."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGMLQuantizationType

        self.path = Path(path)
        try:
            fields, infos = read_tensor_table(path)
            data = np.memmap(path, dtype=np.uint8, mode="r")
        except Exception as e:  # corrupt or not a GGUF file
            raise ValueError(f"cannot read GGUF file {str(path)!r}: {e}") from e
        arch = str(fields.get("general.architecture"))
        self.arch = arch
        self.num_heads = fields.get(f"{arch}.attention.head_count")
        self.num_kv_heads = fields.get(f"{arch}.attention.head_count_kv") or self.num_heads
        self.tensors: dict[str, GgufTensor] = {}
        self.head: GgufTensor | None = None
        tied_head = None
        for t in infos:
            hf = _hf_name(t.name)
            if hf is None and t.name not in ("token_embd.weight", "output.weight"):
                continue
            if len(t.dims) != 2:
                raise ValueError(f"GGUF tensor {t.name} has {len(t.dims)} dimensions, not 2")
            n, k = t.dims[1], t.dims[0]  # GGUF lists the fastest dimension first
            raw = data[t.offset : t.offset + t.nbytes].reshape(n, -1)
            tensor = GgufTensor(hf or t.name, t.gtype, (n, k), raw)
            if t.name == "output.weight":
                self.head = tensor
            elif t.name == "token_embd.weight":
                tied_head = tensor
            else:
                if t.gtype not in BLOCK_TYPES:
                    raise ValueError(
                        f"quantization='gguf': GGUF tensor {t.name} is of type "
                        f"{GGMLQuantizationType(t.gtype).name}; supported: {SUPPORTED_TYPES} (or "
                        "quantization='none' to run the GGUF dequantized to float)"
                    )
                self.tensors[hf] = tensor
        self.head_tied = self.head is None  # the LM head is the token embedding
        if self.head is None:
            self.head = tied_head
        if not self.tensors:
            raise ValueError(f"GGUF file {str(path)!r} has no decoder linear layers")

    def layer_types(self, layer_name: str) -> tuple[int, ...]:
        """Our layer's (e.g. "layers.0.self_attn.qkv_proj") parts' block types."""
        prefix, _, rest = layer_name.partition(".self_attn.")
        if not rest:
            prefix, _, rest = layer_name.partition(".mlp.")
            rest = "mlp." + rest
        else:
            rest = "self_attn." + rest
        parts = _FUSED.get(rest, (rest,))
        return tuple(self.tensors[f"model.{prefix}.{p}.weight"].gtype for p in parts)

    def embedding_in_head(self) -> bool:
        """Whether the embedding is looked up in the LM head's blocks (a tied head whose blocks
        are of a supported type: `GgufEmbedding`)."""
        return self.head_tied and self.head_supported()

    def share_embedding(self, model: nn.Module) -> None:
        """Before loading: the model's embedding looked up in its LM head's blocks, where it can
        be (`embedding_in_head`)."""
        if self.embedding_in_head() and hasattr(model, "embed_tokens"):
            comm = getattr(model.embed_tokens, "comm", None)
            if comm is not None and comm.size > 1:
                raise ValueError("quantization='gguf' runs with tp_size=1 only for now")
            model.embed_tokens = GgufEmbedding(model.lm_head, model.embed_tokens.weight.dtype)

    def head_supported(self) -> bool:
        return self.head is not None and self.head.gtype in BLOCK_TYPES

    def raw(self, tensor: GgufTensor) -> torch.Tensor:
        """The tensor's blocks (N, row bytes) uint8; a Llama GGUF's q and k rows in Hugging
        Face's order again."""
        data = torch.from_numpy(np.array(tensor.data)).reshape(tensor.shape[0], -1)  # (a copy)
        if self.arch == "llama" and tensor.name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.num_heads if tensor.name.endswith("q_proj.weight") else self.num_kv_heads
            n = data.shape[0]
            data = data.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)
        return data.contiguous()

    def weights(
        self, others: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's checkpoint: `others` (the converted folder's tensors) for all but the linear
        layers, whose blocks come from the GGUF."""
        head = self.head_supported()
        skip = {"lm_head.weight"} if head else set()
        if self.embedding_in_head():
            skip.add("model.embed_tokens.weight")
        for name, tensor in others:
            if name not in self.tensors and name not in skip:
                yield name, tensor
        for name, tensor in self.tensors.items():
            yield name, self.raw(tensor)
        if head and not self.head_tied:
            yield "lm_head.weight", self.raw(self.head)

    @torch.no_grad()
    def load_head(self, model: nn.Module) -> None:
        """After loading: a tied LM head's blocks (the token embedding's), which the model's own
        loading skips (a tied head shares the embedding's tensor: here it has its own)."""
        head = model.lm_head
        if self.head_supported() and self.head_tied:
            raw = self.raw(self.head)
            if tuple(head.weight.shape) != tuple(raw.shape):
                raise ValueError(
                    f"GGUF token_embd has {tuple(raw.shape)} bytes, the LM head expects "
                    f"{tuple(head.weight.shape)}"
                )
            head.weight.copy_(raw)


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LINEARS:
        return f"model.layers.{parts[1]}.{_LINEARS[parts[2]]}.weight"
    return None


def type_name(gtype: int) -> str:
    return BLOCK_TYPES[gtype][0] if gtype in BLOCK_TYPES else str(gtype)
