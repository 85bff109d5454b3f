"""Quantized checkpoints read as stored (runtime/quantization/checkpoint.py), each format against its
own writer's reference dequantization: compressed-tensors checkpoints written offline by
compressed-tensors itself (tests/quant_checkpoints.py), FP8 with channel and tensor weight scales
and W4A16 (pack-quantized) with and without zero points; and the quantization_configs that are
refused, each naming what is supported."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")

import radixlm  # noqa: E402
from radixlm.runtime.quantization.checkpoint import read_quantization_config  # noqa: E402
from tests.quant_checkpoints import write_compressed_tensors  # noqa: E402

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
FUSED = {"qkv_proj": ("self_attn", ["q_proj", "k_proj", "v_proj"]),
         "gate_up_proj": ("mlp", ["gate_proj", "up_proj"]),
         "o_proj": ("self_attn", ["o_proj"]), "down_proj": ("mlp", ["down_proj"])}  # fmt: skip


@pytest.fixture(scope="module", params=["channel", "tensor"])
def ct_checkpoint(request, tiny_model_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"ct-fp8-{request.param}")
    return request.param, write_compressed_tensors(tiny_model_folder, out, request.param)


def reference_weights(folder) -> dict[str, torch.Tensor]:
    """Each quantized layer's weight as compressed-tensors dequantizes it (its own `dequantize`
    with the checkpoint's scheme), by checkpoint name."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    args = QuantizationConfig.model_validate(qc).config_groups["group_0"].weights
    tensors = load_file(str(folder / "model.safetensors"))
    return {
        name.removesuffix(".weight"): dequantize(t, tensors[name + "_scale"], args=args)
        for name, t in tensors.items()
        if name.endswith(".weight") and name + "_scale" in tensors
    }


def test_compressed_tensors_fp8_loads_as_stored(ct_checkpoint):
    strategy, folder = ct_checkpoint
    reference = reference_weights(folder)
    assert len(reference) == 2 * 7  # 2 layers of 7 linears; the LM head left unquantized
    with radixlm.Engine(str(folder), dtype="float32") as engine:
        model = engine.model
        for i, layer in enumerate(model.layers):
            for ours, (block, parts) in FUSED.items():
                linear = getattr(getattr(layer, block), ours)
                assert linear.weight.dtype == torch.float8_e4m3fn
                got = linear.quant_scheme.dequantized_weight(linear)
                want = torch.cat([reference[f"model.layers.{i}.{block}.{p}"] for p in parts])
                assert torch.equal(got, want), (strategy, i, ours)
        assert engine.model.lm_head.weight.dtype == torch.float32
        outs = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    assert all(len(o) == 8 for o in outs)


def test_quantizing_at_load_stores_what_compressed_tensors_stores(ct_checkpoint, tiny_model_folder):
    """quantization="fp8" on the float checkpoint rounds as compressed-tensors' channel scheme
    did (the same bytes and scales), so the two engines give the same tokens."""
    strategy, folder = ct_checkpoint
    if strategy != "channel":
        pytest.skip("quantization='fp8' keeps a scale per channel")
    with radixlm.Engine(str(folder), dtype="float32") as stored:
        stored_layers = [
            (m.weight.clone(), m.weight_scale.clone())
            for m in stored.model.modules()
            if hasattr(m, "weight_scale")
        ]
        want = [o["output_ids"] for o in stored.generate(PROMPTS, GREEDY)]
    with radixlm.Engine(tiny_model_folder, dtype="float32", quantization="fp8") as at_load:
        layers = [(m.weight, m.weight_scale) for m in at_load.model.modules() if hasattr(m, "weight_scale")]  # fmt: skip
        assert len(layers) == len(stored_layers) == 8
        for (w, s), (w0, s0) in zip(layers, stored_layers):
            assert torch.equal(w.view(torch.uint8), w0.view(torch.uint8))
            torch.testing.assert_close(s, s0, atol=0, rtol=1e-6)
        got = [o["output_ids"] for o in at_load.generate(PROMPTS, GREEDY)]
    assert got == want


def test_a_config_that_does_not_match_its_weights_is_refused(tiny_model_folder, tmp_path):
    """config.json says FP8 and the weights are float32: an error, not float8-cast weights."""
    src = tmp_path / "src"
    write_compressed_tensors(tiny_model_folder, src, "channel")
    folder = tmp_path / "mismatch"
    shutil.copytree(tiny_model_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = json.loads((src / "config.json").read_text())[
        "quantization_config"
    ]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a weight is float32: the checkpoint is not as its"):
        radixlm.Engine(str(folder))


def fp8_config(**changes) -> dict:
    """compressed-tensors' quantization_config of an FP8_DYNAMIC checkpoint, with `changes`: a
    dotted key into its config group ("weights.strategy"), or "top." and a key of the config."""
    group = {
        "format": "float-quantized",
        "targets": ["Linear"],
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                              "symmetric": True, "dynamic": True},
        "output_activations": None,
    }  # fmt: skip
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
          "config_groups": {"group_0": group}}  # fmt: skip
    for key, value in changes.items():
        if key.startswith("top."):  # a key of the config itself
            qc[key.removeprefix("top.")] = value
            continue
        *path, leaf = key.split(".")
        target = group
        for part in path:
            target = target[part]
        target[leaf] = value
    return qc


def test_supported_configs_are_read():
    assert read_quantization_config(fp8_config(), 2).scheme == "fp8"
    int4 = fp8_config(**{
        "weights.type": "int", "weights.num_bits": 4, "weights.strategy": "group",
        "weights.group_size": 128, "weights.symmetric": False, "input_activations": None,
        "format": "pack-quantized",
    })  # fmt: skip
    stored = read_quantization_config(int4, 2)
    assert (stored.scheme, stored.group, stored.zero_points) == ("w4a16", 128, True)
    tensor = fp8_config(**{"weights.strategy": "tensor", "input_activations.dynamic": False})
    stored = read_quantization_config(tensor, 2)
    assert stored.unread_suffixes == (".input_scale",)
    regex_ignore = fp8_config(**{"top.ignore": ["re:.*lm_head"]})
    assert read_quantization_config(regex_ignore, 2).scheme == "fp8"


def test_awq_and_gptq_configs_read_and_refused():
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    stored = read_quantization_config(gptq, 2)
    assert (stored.scheme, stored.layout, stored.unread_suffixes) == ("w4a16", "gptq", (".g_idx",))
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    assert read_quantization_config(awq, 2).layout == "awq"
    for bad, what in [
        ({**gptq, "desc_act": True}, "desc_act=true"),
        ({**gptq, "bits": 8}, "bits 8"),
        ({**awq, "version": "gemv"}, "AWQ version 'gemv'"),
        ({**awq, "modules_to_not_convert": ["model.layers.0.mlp"]}, "leaving modules"),
    ]:
        with pytest.raises(ValueError, match=what) as e:
            read_quantization_config(bad, 2)
        assert "AWQ (4-bit, GEMM layout) and GPTQ (4-bit, desc_act false)" in str(e.value)


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"top.quant_method": "marlin"}, "quant_method 'marlin'"),
        ({"weights.strategy": "block"}, "strategy: 'block'"),
        (
            {"weights.type": "int", "weights.num_bits": 4},
            "integer weights in format 'float-quantized'",
        ),
        ({"input_activations": None}, "input activations {}"),
        ({"top.kv_cache_scheme": {"num_bits": 8}}, "kv_cache_dtype='fp8_e4m3'"),
        ({"top.ignore": []}, "quantized LM head"),
        ({"top.ignore": ["lm_head", "re:.*down_proj"]}, "leaving decoder layers unquantized"),
        ({"top.quantization_status": "frozen"}, "quantization_status 'frozen'"),
        ({"format": "pack-quantized"}, "format 'pack-quantized'"),
        (
            {
                "weights.type": "int",
                "weights.num_bits": 8,
                "weights.strategy": "channel",
                "format": "pack-quantized",
            },
            "num_bits: 8",
        ),
        (
            {
                "weights.type": "int",
                "weights.num_bits": 4,
                "weights.strategy": "group",
                "weights.group_size": 128,
                "weights.actorder": "group",
                "input_activations": None,
                "format": "pack-quantized",
            },
            "actorder 'group'",
        ),
        (
            {
                "weights.type": "int",
                "weights.num_bits": 4,
                "weights.strategy": "group",
                "weights.group_size": 128,
                "format": "pack-quantized",
            },
            "with quantized activations",
        ),
    ],
)
def test_unsupported_configs_are_refused_naming_what_is_supported(changes, what):
    with pytest.raises(ValueError) as e:
        read_quantization_config(fp8_config(**changes), 2)
    assert what in str(e.value)
    assert "Supported quantized checkpoints: compressed-tensors FP8" in str(e.value)


def test_tensor_parallel_ranks_hold_their_rows_and_columns_with_their_scales(ct_checkpoint):
    """Under tp_size=2, rank 0's column-parallel layers hold its rows of each part with their
    scales (a tensor scale widened to its rows first), its row-parallel ones its columns with
    every row's scale; and the engine generates."""
    strategy, folder = ct_checkpoint
    if strategy != "tensor":
        pytest.skip("the tensor scales are the harder case; one tensor-parallel start suffices")
    reference = reference_weights(folder)
    with radixlm.Engine(str(folder), dtype="float32", tp_size=2) as engine:
        attn = engine.model.layers[1].self_attn
        q, k, v = (reference[f"model.layers.1.self_attn.{p}_proj"] for p in "qkv")
        heads, kv_heads = q.shape[0] // 2, k.shape[0] // 2  # rank 0: the first half of each
        want = torch.cat([q[:heads], k[:kv_heads], v[:kv_heads]])
        got = attn.qkv_proj.quant_scheme.dequantized_weight(attn.qkv_proj)
        assert torch.equal(got, want)
        o = reference["model.layers.1.self_attn.o_proj"]
        got = attn.o_proj.quant_scheme.dequantized_weight(attn.o_proj)
        assert torch.equal(got, o[:, : o.shape[1] // 2])
        outs = engine.generate(PROMPTS, GREEDY)
    assert all(len(o["output_ids"]) == 8 for o in outs)


@pytest.fixture(scope="module", params=["w4a16", "w4a16-asym"])
def ct_int4_checkpoint(request, tiny_model_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"ct-{request.param}")
    return request.param, write_compressed_tensors(tiny_model_folder, out, request.param)


def reference_int4_weights(folder) -> dict[str, torch.Tensor]:
    """Each quantized layer's weight as compressed-tensors' own pack-quantized compressor
    decompresses it, by checkpoint name."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]
    tensors = load_file(str(folder / "model.safetensors"))
    out = {}
    for name in tensors:
        if name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            state = {k.removeprefix(module + "."): t for k, t in tensors.items() if k.startswith(module + ".")}  # fmt: skip
            out[module] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
    return out


def test_compressed_tensors_w4a16_loads_as_stored(ct_int4_checkpoint):
    scheme, folder = ct_int4_checkpoint
    reference = reference_int4_weights(folder)
    assert len(reference) == 2 * 7
    with radixlm.Engine(str(folder), dtype="float32") as engine:
        for i, layer in enumerate(engine.model.layers):
            for ours, (block, parts) in FUSED.items():
                linear = getattr(getattr(layer, block), ours)
                assert linear.weight.dtype == torch.uint8
                got = linear.quant_scheme.dequantized_weight(linear)
                want = torch.cat([reference[f"model.layers.{i}.{block}.{p}"] for p in parts])
                torch.testing.assert_close(got, want, atol=0, rtol=1e-6, msg=f"{scheme} {i} {ours}")
        outs = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    assert all(len(o) == 8 for o in outs)


def _int4_layers(engine, i: int = 1) -> dict[str, torch.Tensor]:
    """Layer i's dequantized weights (a rank's part under tensor parallelism), by our name."""
    layer = engine.model.layers[i]
    return {
        ours: getattr(getattr(layer, block), ours).quant_scheme.dequantized_weight(
            getattr(getattr(layer, block), ours)
        )
        for ours, (block, _) in FUSED.items()
    }


def _rank0_part(name: str, whole: torch.Tensor, cfg) -> torch.Tensor:
    """Rank 0's part of a whole layer's weight at tp_size=2: the first half of each fused part's
    rows (column-parallel), or of the input columns (row-parallel)."""
    if name in ("o_proj", "down_proj"):
        return whole[:, : whole.shape[1] // 2]
    sizes = (
        [cfg.num_heads * cfg.head_dim, *[cfg.num_kv_heads * cfg.head_dim] * 2]
        if name == "qkv_proj"
        else [cfg.intermediate_size] * 2
    )
    return torch.cat([p[: p.shape[0] // 2] for p in whole.split(sizes)])


def _assert_split_over_two_ranks(folder) -> None:
    """Under tp_size=2 a stored INT4 checkpoint's layers are split as unquantized ones are:
    rank 0's column-parallel layers hold its rows of each part with their scales and zero
    points, its row-parallel ones its input columns (packed two a byte) with their groups'
    scales; each exactly the single process's dequantized weight's part. The engine generates."""
    with radixlm.Engine(str(folder), dtype="float32") as engine:
        whole, cfg = _int4_layers(engine), engine.model_config
    with radixlm.Engine(str(folder), dtype="float32", tp_size=2) as engine:
        part = _int4_layers(engine)
        outs = engine.generate(PROMPTS, GREEDY)
    for name, weight in whole.items():
        assert torch.equal(part[name], _rank0_part(name, weight, cfg)), name
    assert all(len(o["output_ids"]) == 8 for o in outs)


def test_compressed_tensors_w4a16_splits_over_tensor_parallel_ranks(ct_int4_checkpoint):
    scheme, folder = ct_int4_checkpoint
    if scheme != "w4a16-asym":
        pytest.skip("the zero points are the harder case; one start suffices")
    _assert_split_over_two_ranks(folder)


def test_awq_splits_over_tensor_parallel_ranks(awq_gptq_checkpoint):
    kind, folder = awq_gptq_checkpoint
    if kind != "awq":
        pytest.skip("AWQ's and GPTQ's layouts meet in ours before the split; one suffices")
    _assert_split_over_two_ranks(folder)


@pytest.fixture(scope="module", params=["awq", "gptq"])
def awq_gptq_checkpoint(request, tiny_model_folder, tmp_path_factory):
    from tests.quant_checkpoints import write_awq_gptq

    out = tmp_path_factory.mktemp(f"{request.param}-checkpoint")
    return request.param, write_awq_gptq(tiny_model_folder, out, request.param)


def test_awq_and_gptq_layouts_load_as_their_reference_dequantization_says(awq_gptq_checkpoint):
    """An AWQ (GEMM) or GPTQ checkpoint, written from the formats' documented layouts
    (tests/quant_checkpoints.py): every layer's weight equals the formats' element-by-element
    definition of it; the layouts' packing is read, not trusted, and the engine generates."""
    from safetensors.torch import load_file

    from tests.quant_checkpoints import reference_awq_gptq_dequantize

    layout, folder = awq_gptq_checkpoint
    tensors = load_file(str(folder / "model.safetensors"))
    with radixlm.Engine(str(folder), dtype="float32") as engine:
        for i, layer in enumerate(engine.model.layers):
            for ours, (block, parts) in FUSED.items():
                linear = getattr(getattr(layer, block), ours)
                got = linear.quant_scheme.dequantized_weight(linear)
                want = []
                for p in parts:
                    pre = f"model.layers.{i}.{block}.{p}"
                    want.append(
                        reference_awq_gptq_dequantize(
                            layout,
                            tensors[f"{pre}.qweight"],
                            tensors[f"{pre}.qzeros"],
                            tensors[f"{pre}.scales"],
                        )  # fmt: skip
                    )
                torch.testing.assert_close(got, torch.cat(want), atol=0, rtol=1e-6)
        outs = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    assert all(len(o) == 8 for o in outs)


def test_sglangs_names_of_a_checkpoints_format_run_it_as_stored_or_say_what_it_is(
    awq_gptq_checkpoint, tiny_model_folder
):
    """quantization="awq" / "awq_marlin" / "gptq" / "gptq_marlin" / "compressed-tensors" (SGLang's
    names) run a checkpoint of that format as leaving it unset does; a checkpoint of another
    format, or an unquantized one, is refused saying what it is."""
    layout, folder = awq_gptq_checkpoint
    other = "gptq" if layout == "awq" else "awq"
    with radixlm.Engine(str(folder), dtype="float32") as engine:
        want = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    with radixlm.Engine(str(folder), dtype="float32", quantization=f"{layout}_marlin") as engine:
        assert [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)] == want
    with pytest.raises(
        ValueError, match=rf"quantization='{other}' runs a .* this one is {layout.upper()}"
    ):
        radixlm.Engine(str(folder), dtype="float32", quantization=other)
    with pytest.raises(ValueError, match="this one is not quantized: use quantization='fp8'"):
        radixlm.Engine(tiny_model_folder, dtype="float32", quantization="compressed-tensors")


def test_a_split_off_the_groups_is_refused_saying_why(tiny_model_folder, tmp_path):
    """Groups of 64 input features: o_proj's 64 split over two ranks leave each 32, half a
    group, refused at start-up naming the split and the groups."""
    from tests.quant_checkpoints import write_awq_gptq

    folder = write_awq_gptq(tiny_model_folder, tmp_path / "awq64", "awq", group=64)
    with pytest.raises(
        ValueError, match=r"a rank's input features .* \[0, 32\) of 64, are not whole groups of 64"
    ):
        radixlm.Engine(str(folder), dtype="float32", tp_size=2)
