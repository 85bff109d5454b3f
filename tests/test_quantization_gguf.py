"""GGUF blocks run as stored (`quantization="gguf"`, runtime/quantization/gguf.py): each block
type's dequantization (plain torch, kernels/gguf_ref.py, and the CPU kernels, kernels/gguf_cpu.cpp)
against the gguf package's own, bit for bit; the CPU matmul against its oracle (the gguf package's
dequantization and F.linear) at decode and prompt sizes; a fused layer of parts of different block
types; a tiny Llama GGUF of Q4_0, Q4_1 and Q8_0 tensors and the default model (Q4_1, its LM head
the Q8_0 embedding) greedy-equal to their float32 dequantization (`quantization="none"`); and the
refusals. The CPU kernels are compiled on first use (about 30 s once per machine; torch caches the
build)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import radixlm
from radixlm.kernels import gguf_cpu, gguf_ref
from radixlm.kernels.gguf_ref import BLOCK_TYPES
from radixlm.kernels.quant_ref import dequantize_groups
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.model_loader import default_model_path
from radixlm.runtime.parallel import ColumnParallelLinear, Part
from radixlm.runtime.quantization.base import scheme_of
from radixlm.runtime.quantization.gguf import GgufLinear, GgufWeights, read_tensor_table
from radixlm.runtime.quantization.int4 import Int4Linear, Int8GroupsLinear
from radixlm.runtime.quantization.plan import plan_for
from tests.test_gguf_conversion import TINY, tokenizer_fields, weights, write_gguf  # noqa: F401

Q = gguf.GGMLQuantizationType
# where each block type keeps its float16 scales (bytes): made finite in the random blocks
HALF_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(gtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """n rows of K values of random blocks (every bit pattern of the integers and 6-bit scales;
    finite float16 scales): (n, row bytes) uint8."""
    _, qk, nbytes = BLOCK_TYPES[gtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // qk, nbytes), dtype=np.uint8)
    for at in HALF_AT[Q(gtype)]:
        halves = rng.normal(0, 0.02, size=(n, k // qk)).astype(np.float16)
        raw[..., at : at + 2] = halves.view(np.uint8).reshape(n, k // qk, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def kernels():
    module = gguf_cpu.load()
    if module is None:
        pytest.skip("the GGUF CPU kernels could not be built here (no C++ compiler)")
    return module


@pytest.mark.parametrize("gtype", sorted(BLOCK_TYPES), ids=lambda t: BLOCK_TYPES[t][0])
def test_dequantize_is_the_gguf_packages(gtype):
    k = 512
    w = random_blocks(gtype, 6, k)
    want = gguf_ref.gguf_package_dequantize(w, gtype, k)
    assert torch.equal(gguf_ref.dequantize(w, gtype, k), want)
    assert torch.equal(kernels().dequantize(w, gtype, k), want)


@pytest.mark.parametrize("gtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: Q(t).name)
def test_dequantize_blocks_the_gguf_package_quantized(gtype):
    """Blocks as llama.cpp's quantizer writes them (the gguf package's port of it)."""
    src = np.random.default_rng(1).normal(size=(8, 256)).astype(np.float32)
    w = torch.from_numpy(gguf.quants.quantize(src, Q(gtype)))
    want = torch.from_numpy(gguf.quants.dequantize(w.numpy(), Q(gtype)))
    assert torch.equal(kernels().dequantize(w, int(gtype), 256), want)
    assert (want - torch.from_numpy(src)).abs().max() < 0.5  # (they are its blocks)


@pytest.mark.parametrize("gtype", sorted(BLOCK_TYPES), ids=lambda t: BLOCK_TYPES[t][0])
@pytest.mark.parametrize("rows", [1, 3, 64, 65])  # 1: dot products; 3, 64: tiles; 65: dequantize
def test_cpu_matmul_against_oracle(gtype, rows):
    assert kernels().tiled_rows == 64
    k, n = 512, 37  # 37: rows that are not whole groups of four
    w = random_blocks(gtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = gguf_ref.gguf_linear_ref(x, w, gtype, k)
    got = kernels().matmul(x, w, gtype, k)
    assert got.shape == want.shape and got.dtype == torch.float32
    scale = (x.abs() @ gguf_ref.gguf_package_dequantize(w, gtype, k).abs().T).max()
    assert (got - want).abs().max() <= 1e-5 * scale  # float32 sums in another order
    # any leading shape, any float dtype of x
    got3 = kernels().matmul(x.double().view(1, rows, k), w, gtype, k)
    assert got3.shape == (1, rows, n)


def test_kernels_run_in_a_forked_child():
    """The kernels' threads are not inherited by a forked child: it makes its own."""
    import os

    k = kernels()
    w = random_blocks(int(Q.Q4_1), 64, 256)
    x = torch.randn(1, 256)
    want = k.matmul(x, w, int(Q.Q4_1), 256)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the same product, or exit 1
        os.close(read)
        ok = torch.equal(k.matmul(x, w, int(Q.Q4_1), 256), want)
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    got = os.read(read, 1)
    os.waitpid(pid, 0)
    assert got == b"1"


def gguf_layer(k: int, types: tuple[int, ...], blocks: list[torch.Tensor]) -> torch.nn.Linear:
    """A fused layer of one part for each of `blocks` (rows of GGUF blocks of `types`), on the
    CPU, loaded as a checkpoint loads it, before `process_after_loading`."""
    with torch.device("meta"):
        parts = [Part(b.shape[0], 0, b.shape[0]) for b in blocks]
        layer = ColumnParallelLinear(k, parts, bias=False)
    scheme = GgufLinear(types)
    layer.quant_scheme = scheme
    scheme.create_weights(layer)
    layer = layer.to_empty(device="cpu")
    with torch.no_grad():
        for i, b in enumerate(blocks):
            lo, hi = layer.part_rows(i)
            layer.weight[lo:hi].copy_(scheme.checkpoint_tensor(layer, "weight", b, i))
    return layer


def test_fused_layer_of_mixed_block_types():
    """A Q4_K_M file's fused q/k/v: parts of different block types, each multiplied by its own."""
    k, sizes, types = 256, [64, 32, 32], (int(Q.Q4_K), int(Q.Q4_K), int(Q.Q6_K))
    blocks = [random_blocks(t, size, k, seed=i) for i, (t, size) in enumerate(zip(types, sizes))]
    layer = gguf_layer(k, types, blocks)
    scheme = layer.quant_scheme
    scheme.process_after_loading(layer)
    assert [(lo, hi) for lo, hi, _ in scheme.bounds] == [(0, 96), (96, 128)]
    x = torch.randn(2, k)
    want = torch.cat([gguf_ref.gguf_linear_ref(x, b, t, k) for b, t in zip(blocks, types)], -1)
    torch.testing.assert_close(scheme.apply(layer, x), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(scheme.reference(layer, x), want, rtol=1e-5, atol=1e-4)


# ---- on a GPU: the 4-bit types in the INT4 layout, the others dequantized once --------------

FOUR_BIT = [Q.Q4_0, Q.Q4_1, Q.Q4_K]


def blocks_with_a_flat_group(gtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Random blocks, the first block of row 0 with a zero scale (d = 0: one value, or zero)."""
    w = random_blocks(gtype, n, k, seed)
    w[0, 0:2] = 0
    return w


@pytest.mark.parametrize("gtype", FOUR_BIT, ids=lambda t: Q(t).name)
def test_int4_layout_holds_the_blocks_values(gtype):
    k = 512
    w = blocks_with_a_flat_group(int(gtype), 9, k, seed=3)
    packed, scale, zero = gguf_ref.as_int4(w, int(gtype), k)
    assert packed.shape == (9, k // 2) and scale.shape == zero.shape == (9, k // 32)
    want = gguf_ref.gguf_package_dequantize(w, int(gtype), k)
    got = dequantize_groups(packed, scale, zero)
    assert (want[0, :32] == want[0, 0]).all()  # (the flat group: one value)
    # the same values up to float32 rounding of (q - (-c / s)) * s against s * q + c
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_int4_layout_refuses_other_blocks():
    with pytest.raises(ValueError, match="not 4-bit"):
        gguf_ref.as_int4(random_blocks(int(Q.Q8_0), 2, 512), int(Q.Q8_0), 512)


def check_converted_layer(layer, weight: torch.Tensor, row_tol: float) -> None:
    """A converted layer's matmul (its float32 head path too), the Triton GEMV over its operands
    and the rows an embedding looks up in it, against `weight`, the blocks' float32 values."""
    from radixlm.kernels.gemv import GemvConfig, gemv
    from radixlm.runtime.layers import float32_linear

    scheme = scheme_of(layer)
    assert scheme.has_gemv
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
    want = x @ weight.T
    tol = {"rtol": 1e-5, "atol": 1e-5 * want.abs().max().item()}
    torch.testing.assert_close(scheme.apply(layer, x), want, **tol)
    torch.testing.assert_close(float32_linear(x, layer), want, **tol)
    w, quant = scheme.gemv_operands(layer)
    got = gemv(x[:1], w, None, GemvConfig(8, 64, 4, 1, 1), torch.float32, **quant)
    torch.testing.assert_close(got, want[:1], **tol)
    ids = torch.tensor([0, weight.shape[0] // 2, weight.shape[0] - 1])
    torch.testing.assert_close(
        scheme.dequantized_rows(layer, ids), weight[ids], rtol=row_tol, atol=row_tol
    )


def package_weight(blocks, types, k: int) -> torch.Tensor:
    return torch.cat([gguf_ref.gguf_package_dequantize(b, t, k) for b, t in zip(blocks, types)])


def test_gguf_layer_of_four_bit_blocks_becomes_an_int4_layer():
    """A fused layer of Q4_0, Q4_K and Q4_1 parts as a GPU holds it (`_to_int4`, which loading
    runs where the weights are on a GPU): an INT4 layer, against the gguf package's values."""
    k, sizes, types = 256, [24, 16, 8], (int(Q.Q4_0), int(Q.Q4_K), int(Q.Q4_1))
    blocks = [blocks_with_a_flat_group(t, n, k, seed=i) for i, (t, n) in enumerate(zip(types, sizes))]  # fmt: skip
    layer = gguf_layer(k, types, blocks)
    assert not layer.quant_scheme.has_gemv
    layer.quant_scheme._to_int4(layer)
    assert isinstance(layer.quant_scheme, Int4Linear) and layer.weight.shape == (48, k // 2)
    check_converted_layer(layer, package_weight(blocks, types, k), row_tol=1e-6)


def test_int8_layout_holds_the_blocks_values():
    """Q8_0's and Q6_K's values exactly (their integers and scales as they are), in groups of
    their own or of 16 columns (a mixed layer's); the 4-bit types' as their INT4 layout holds
    them."""
    k = 512
    for gtype in [*FOUR_BIT, Q.Q8_0, Q.Q6_K]:
        w = blocks_with_a_flat_group(int(gtype), 9, k, seed=4)
        want = gguf_ref.gguf_package_dequantize(w, int(gtype), k)
        q, scale, zero = gguf_ref.as_int8(w, int(gtype), k)
        group = gguf_ref.INT8_GROUPS[int(gtype)]
        assert q.dtype == torch.int8 and q.shape == (9, k) and scale.shape == (9, k // group)
        got = dequantize_groups(q, scale, zero)
        if gtype in (Q.Q8_0, Q.Q6_K):  # (symmetric: no zero points)
            assert torch.equal(got, want), Q(gtype).name
            assert zero is None
        else:
            assert zero.shape == scale.shape
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
        q16, scale16, zero16 = gguf_ref.as_int8(w, int(gtype), k, group=16)
        assert torch.equal(q16, q) and scale16.shape == (9, k // 16)
        assert torch.equal(dequantize_groups(q16, scale16, zero16), got)
    with pytest.raises(ValueError, match="do not split"):
        gguf_ref.as_int8(w, int(Q.Q6_K), k, group=32)


def test_gguf_layer_of_other_blocks_on_a_gpu_is_an_int8_layer():
    """A fused layer with a Q6_K part beside a Q4_K one, and a Q8_0 layer, as a GPU holds them
    (`_to_int8`, which loading runs where the weights are on a GPU and not all 4-bit): int8
    integers with a scale and zero point a group (16 columns for the mixed layer), computed by
    the INT4 paths, against the gguf package's values (Q8_0's exactly)."""
    k = 256
    for sizes, types in (([16, 8], (int(Q.Q4_K), int(Q.Q6_K))), ([12], (int(Q.Q8_0),))):
        blocks = [random_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(zip(types, sizes))]
        layer = gguf_layer(k, types, blocks)
        layer.quant_scheme._to_int8(layer)
        assert isinstance(layer.quant_scheme, Int8GroupsLinear)
        assert layer.weight.dtype == torch.int8 and layer.weight.shape == (sum(sizes), k)
        assert layer.weight_scale.shape == (sum(sizes), k // (16 if len(types) > 1 else 32))
        weight = package_weight(blocks, types, k)
        if len(types) == 1:  # (Q8_0 alone: no zero points)
            assert layer.weight_zero is None
            assert torch.equal(layer.quant_scheme.dequantized_weight(layer), weight)
        else:  # (the Q4_K part's, 0 for the Q6_K part's rows)
            assert layer.weight_zero.shape == layer.weight_scale.shape
            assert not layer.weight_zero[16:].any()
        check_converted_layer(layer, weight, row_tol=1e-6)


# ---- whole models --------------------------------------------------------------------------

TINY_TYPES = {  # a block type per decoder linear layer: q, k, v of three types (one fused layer)
    "q_proj": Q.Q4_0, "k_proj": Q.Q8_0, "v_proj": Q.Q4_1, "o_proj": Q.Q4_1,
    "gate_proj": Q.Q4_1, "up_proj": Q.Q4_1, "down_proj": Q.Q8_0, "lm_head": Q.Q8_0,
}  # fmt: skip


def write_quantized_tiny(path: Path, weights, tokenizer_fields) -> Path:  # noqa: F811
    """The tests' tiny random Llama as llama.cpp would write it quantized: its linear layers and
    LM head in TINY_TYPES."""
    return write_gguf(path, weights, tokenizer_fields, block_types=TINY_TYPES)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about tea."]


def greedy(eng, tokens: int, prompts=None, input_ids=None):
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    return eng.generate(prompts, params, input_ids=input_ids, return_logprob=True)


def logprobs(out) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def test_tiny_gguf_as_stored_equals_dequantized(
    tmp_path,
    weights,  # noqa: F811
    tokenizer_fields,  # noqa: F811
    monkeypatch,
):
    """Untied LM head (an output tensor), q and k permuted by llama.cpp, a fused q/k/v of three
    block types (its decode steps in one call, FusedDecode, each part's rows its own matmul): the
    same tokens as the float32 dequantization, log-probabilities within 1e-4."""
    from radixlm.runtime.quantization import gguf as gguf_scheme

    kernels()
    calls = []
    real = gguf_scheme.FusedDecode.__call__
    monkeypatch.setattr(
        gguf_scheme.FusedDecode, "__call__", lambda self, *a: calls.append(1) or real(self, *a)
    )
    path = write_quantized_tiny(tmp_path / "tiny-q.gguf", weights, tokenizer_fields)
    kw = {"model_path": str(path), "cache_dir": str(tmp_path / "cache"), "max_total_tokens": 512}
    ids = [[1, 5, 9, 300, 17], [2, 700, 44, 8]]
    with radixlm.Engine(quantization="none", **kw) as eng:
        want = greedy(eng, 12, input_ids=ids)
    with radixlm.Engine(quantization="gguf", **kw) as eng:
        assert eng.model.lm_head.weight.dtype == torch.uint8  # the output tensor's Q8_0 blocks
        assert eng.model.layers[0].self_attn.qkv_proj.quant_scheme.types == (2, 8, 3)
        got = greedy(eng, 12, input_ids=ids)
    assert len(calls) == 12  # (the prompts' step and both requests' decode steps)
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_allclose(logprobs(a), logprobs(b), atol=1e-4)


def test_default_model_as_stored_equals_dequantized():
    """The default model (Q4_1 layers, its LM head the Q8_0 embedding): greedy text equal to its
    float32 dequantization's, in under a quarter of the float32 weight bytes (the embedding looked
    up in the head's blocks, the float conversion's values)."""
    kernels()
    kw = {"max_total_tokens": 2048}
    with radixlm.Engine(quantization="none", **kw) as eng:
        want = [o["output_ids"] for o in greedy(eng, 16, PROMPTS)]
        float_bytes = sum(p.numel() * p.element_size() for p in eng.model.layers.parameters())
        all_float = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    with radixlm.Engine(quantization="gguf", **kw) as eng:
        got = [o["output_ids"] for o in greedy(eng, 16, PROMPTS)]
        ours = sum(p.numel() * p.element_size() for p in eng.model.layers.parameters())
        assert eng.model.lm_head.weight.dtype == torch.uint8
        # the embedding is looked up in the head's blocks: the model's weights are those blocks,
        # the layers' and the norms'
        all_ours = sum(p.numel() * p.element_size() for p in eng.model.parameters())
        ids = torch.tensor([[0, 5, 49151]])
        rows = eng.model.embed_tokens(ids)
        head = eng.model.lm_head
        want_rows = head.quant_scheme.dequantized_weight(head)[ids[0]]
        assert torch.equal(rows[0], want_rows)
    assert got == want
    assert ours < float_bytes / 4
    assert all_ours < all_float / 4


def test_tensor_table_is_the_gguf_readers(tmp_path, weights, tokenizer_fields):  # noqa: F811
    """The header walk that finds the tensors (without building the vocabulary's arrays) finds
    what the gguf package's GGUFReader finds: names, types, dimensions and bytes."""
    tiny = write_quantized_tiny(tmp_path / "tiny-q.gguf", weights, tokenizer_fields)
    for path in (tiny, default_model_path()):
        fields, infos = read_tensor_table(path)
        reader = gguf.GGUFReader(str(path))
        assert fields["general.architecture"] == "llama"
        assert len(infos) == len(reader.tensors)
        for info, t in zip(infos, reader.tensors):
            assert (info.name, info.gtype) == (t.name, int(t.tensor_type))
            assert info.dims == tuple(int(d) for d in t.shape)
            ours = np.asarray(reader.data[info.offset : info.offset + info.nbytes])
            assert np.array_equal(ours, np.asarray(t.data).reshape(-1).view(np.uint8))


def test_refusals(tmp_path):
    assert EngineConfig(quantization="gguf").quantization == "gguf"
    assert EngineConfig(quantization="none").quantization == "none"
    with pytest.raises(ValueError, match="not a .gguf file"):
        plan_for("gguf", None, None)
    # a GGUF whose linear layer is of a block type without a kernel
    path = tmp_path / "q5.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    blocks = gguf.quants.quantize(np.ones((4, 64), np.float32), Q.Q5_0)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=Q.Q5_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="Q5_0; supported: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K"):
        GgufWeights(path)


def test_decode_step_in_one_call_equals_the_layers(monkeypatch):
    """On the CPU a decode step of up to 8 requests of the default model runs as one call of the
    kernels (FusedDecode): the same tokens and log-probabilities (1e-4) as the model's forward
    layer by layer, over a short prompt, a prompt of 300+ tokens (attention over the kernels'
    threads), a request whose prefix came from the radix cache (its keys' slots not one run),
    and four requests decoding together. 65 requests at once, and a float8 pool, run the
    layers."""
    from radixlm.runtime.quantization import gguf as gguf_scheme

    kernels()
    calls = []
    real = gguf_scheme.FusedDecode.__call__

    def counted(self, batch, backend):
        calls.append(batch.num_tokens)
        return real(self, batch, backend)

    monkeypatch.setattr(gguf_scheme.FusedDecode, "__call__", counted)
    long_prompt = " ".join(f"item {i}," for i in range(120)) + " and the last item is"
    prompts = [PROMPTS[0], long_prompt, PROMPTS[0] + " not Berlin but"]  # (the last: cached prefix)
    many = [f"Question {i}: what is {i} plus {i}?" for i in range(65)]
    with radixlm.Engine(quantization="gguf", max_total_tokens=4096) as eng:
        assert len(eng.tokenizer.encode(long_prompt)) > 256
        outs = {}
        for fused in (False, True):
            monkeypatch.setattr(gguf_scheme.FusedDecode, "enabled", fused)
            eng.flush_cache()
            alone = [greedy(eng, 10, p) for p in prompts]  # (each alone: batch 1)
            outs[fused] = alone + greedy(eng, 8, many[:4])  # (four together)
        assert calls.count(1) >= 9 * len(prompts) and 4 in calls
        for a, b in zip(outs[False], outs[True]):
            assert a["output_ids"] == b["output_ids"]
            np.testing.assert_allclose(logprobs(a), logprobs(b), atol=1e-4)
        calls.clear()
        steps = []
        inner = eng.model.forward

        def every_step(batch, backend):
            steps.append(batch.num_tokens)
            return inner(batch, backend)

        monkeypatch.setattr(eng.model, "forward", every_step)
        greedy(eng, 3, many)  # 65 at once: past the call's rows
        assert 65 in steps and 65 not in calls
    calls.clear()
    with radixlm.Engine(
        quantization="gguf", max_total_tokens=1024, kv_cache_dtype="fp8_e4m3"
    ) as eng:
        greedy(eng, 4, PROMPTS[0])
    assert not calls


@pytest.mark.parametrize("algorithm", ["NGRAM", "MEDUSA"])
def test_speculative_steps_in_one_call_equal_the_layers(monkeypatch, algorithm):
    """A verify step's rows of one request (NGRAM) and the hidden states MEDUSA's heads read run
    in the one-call step too: the same tokens as with the layers (NGRAM: and log-probabilities
    within 1e-4)."""
    from radixlm.runtime.quantization import gguf as gguf_scheme

    kernels()
    steps = []
    real = gguf_scheme.FusedDecode.__call__

    def counted(self, batch, backend):
        logits = real(self, batch, backend)
        requests = len(set(batch.req_pool_indices.tolist()))
        steps.append((batch.num_tokens, requests, batch.hidden_states is not None))
        return logits

    monkeypatch.setattr(gguf_scheme.FusedDecode, "__call__", counted)
    prompt = "Count: one two three, one two three, one two three, one two"
    kw = {"speculative_algorithm": algorithm, "speculative_adaptive": False}  # (draft every step)
    with radixlm.Engine(max_total_tokens=2048, **kw) as eng:
        outs = {}
        for fused in (False, True):
            monkeypatch.setattr(gguf_scheme.FusedDecode, "enabled", fused)
            eng.flush_cache()
            if algorithm == "NGRAM":
                outs[fused] = greedy(eng, 24, prompt)
            else:  # (MEDUSA drafts for requests without log-probabilities only)
                params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
                outs[fused] = eng.generate(prompt, params)
    assert outs[False]["output_ids"] == outs[True]["output_ids"]
    if algorithm == "NGRAM":
        np.testing.assert_allclose(logprobs(outs[False]), logprobs(outs[True]), atol=1e-4)
    if algorithm == "NGRAM":  # several rows of the one request: a verify step
        assert any(rows > 1 and requests == 1 for rows, requests, _ in steps)
    else:  # the heads' hidden states
        assert any(hidden for _, _, hidden in steps)


@pytest.mark.gpu
def test_default_model_on_a_gpu_runs_its_four_bit_blocks_as_int4():
    """On a GPU the default model's Q4_1 layers are held in the INT4 layout and run the INT4
    kernels (the GEMV tuned per shape, CUDA graphs), its Q8_0 head in the int8 layout through
    the same kernels; in float32 its greedy text is the float32 dequantization's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kw = {"max_total_tokens": 4096, "device": "cuda", "dtype": "float32"}
    with radixlm.Engine(quantization="none", **kw) as eng:
        want = [o["output_ids"] for o in greedy(eng, 16, PROMPTS)]
    with radixlm.Engine(quantization="gguf", **kw) as eng:
        down = eng.model.layers[0].mlp.down_proj
        assert isinstance(down.quant_scheme, Int4Linear)
        assert down.weight.shape[1] == down.in_features // 2
        head = eng.model.lm_head  # (Q8_0: int8 integers, a scale a group of 32)
        assert isinstance(head.quant_scheme, Int8GroupsLinear) and head.weight.dtype == torch.int8
        got = [o["output_ids"] for o in greedy(eng, 16, PROMPTS)]
    assert got == want
