"""GGUF files converted to Hugging Face folders: rope scaling as llama.cpp applies it (a linear
factor, Llama 3.1's per-frequency factors) gives transformers' log-probabilities for the same model,
scaling the runtime cannot run is refused by its GGUF key, and the weights of a large model are half
precision (a small one's float32, exact). The GGUFs are tiny random Llamas written here, with the
default model's tokenizer cut to its first 1024 tokens (a whole vocabulary takes seconds to read,
each time a GGUF is opened)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import radixlm
from radixlm.runtime import model_loader
from radixlm.runtime.model_loader import default_model_path, resolve_model_folder

VOCAB = 1024
TINY = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip
HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]
# wavelengths 6 to 20k positions against 16 and 64: every branch of llama3 scaling is taken
LLAMA3 = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_fields() -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The default GGUF's tokenizer metadata, its vocabulary cut to the first VOCAB tokens (special
    tokens, the 256 bytes, the first merges' results) and the merges among those."""
    reader = gguf.GGUFReader(default_model_path())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    kept = set(tokens)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:VOCAB]
        elif key == "tokenizer.ggml.merges":
            pairs = (m.split(" ") for m in value)
            value = [f"{a} {b}" for a, b in pairs if {a, b, a + b} <= kept]
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        fields.append((key, value, field.types[0], sub_type))
    return fields


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    """A random tiny Llama's weights, rounded to float16 (the GGUFs store them so, exactly)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, initializer_range=0.2))
    return {name: w.half() for name, w in model.state_dict().items()}


def transformers_model(weights: dict[str, torch.Tensor], rope_scaling: dict | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**TINY, rope_scaling=rope_scaling))
    model.load_state_dict({name: w.float() for name, w in weights.items()})
    return model.eval()


def write_gguf(
    path: Path,
    weights: dict[str, torch.Tensor],
    tokenizer_fields,
    scaling: tuple[gguf.RopeScalingType, float] | None = None,
    rope_freqs: np.ndarray | None = None,
    block_types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """The tiny Llama as llama.cpp's converter writes it: its tensor names, q and k rows permuted
    for its rope layout, norms in float32; with `block_types` (a layer's last name, `q_proj`, ->
    a GGML block type) those layers quantized as llama.cpp's quantizer stores them."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    writer.add_vocab_size(VOCAB)
    for key, value, vtype, sub_type in tokenizer_fields:
        writer.add_key_value(key, value, vtype, sub_type)
    if scaling is not None:
        writer.add_rope_scaling_type(scaling[0])
        writer.add_rope_scaling_factor(scaling[1])
        writer.add_rope_scaling_orig_ctx_len(64)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, TINY["num_hidden_layers"])
    for hf_name, w in weights.items():
        base, suffix = hf_name.rsplit(".", 1)
        if base.endswith("q_proj"):
            w = permute_for_llama_cpp(w, TINY["num_attention_heads"])
        elif base.endswith("k_proj"):
            w = permute_for_llama_cpp(w, TINY["num_key_value_heads"])
        name = f"{names.get_name(base)}.{suffix}"
        gtype = (block_types or {}).get(base.rpartition(".")[2])
        if gtype is not None:
            writer.add_tensor(name, gguf.quants.quantize(w.float().numpy(), gtype), raw_dtype=gtype)
        else:
            writer.add_tensor(name, w.numpy() if w.dim() > 1 else w.float().numpy())
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def permute_for_llama_cpp(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows from the half-split rope layout to llama.cpp's interleaved one."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
    )


def llama_cpp_llama3_factors(
    scaling: dict, head_dim: int = HEAD_DIM, theta: float = TINY["rope_theta"]
) -> np.ndarray:
    """llama.cpp's converter's rope_freqs for a llama3 rope scaling: a divisor per frequency."""
    old_context = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def max_logprob_difference(gguf_path: Path, reference, cache_dir: Path) -> float:
    """The largest difference between the engine's prompt and output log-probabilities on the
    GGUF and the reference model's (teacher-forced), over prompts reaching position 200."""
    prompts = [
        [(37 * i + 11 * j) % (VOCAB - 300) + 300 for j in range(n)] for i, n in ((0, 5), (1, 200))
    ]
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(str(gguf_path), cache_dir=str(cache_dir)) as eng:
        outs = eng.generate(
            input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0
        )
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        full = prompt + out["output_ids"]
        with torch.inference_mode():
            ref = torch.log_softmax(reference(input_ids=torch.tensor([full])).logits[0].float(), -1)
        ours = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
        ours += [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        theirs = [ref[i - 1, full[i]].item() for i in range(1, len(full))]
        worst = max(worst, *(abs(a - b) for a, b in zip(ours, theirs)))
    return worst


def test_linear_rope_scaling_in_a_gguf_gives_transformers_logprobs(
    tmp_path, weights, tokenizer_fields
):
    path = write_gguf(
        tmp_path / "linear.gguf", weights, tokenizer_fields, (gguf.RopeScalingType.LINEAR, 4.0)
    )
    reference = transformers_model(weights, {"rope_type": "linear", "factor": 4.0})
    assert max_logprob_difference(path, reference, tmp_path / "cache") < 1e-4


def test_llama3_rope_freqs_in_a_gguf_give_transformers_llama3_logprobs(
    tmp_path, weights, tokenizer_fields
):
    factors = llama_cpp_llama3_factors(LLAMA3)
    assert {1.0, LLAMA3["factor"]} < set(factors.tolist())  # high, low and medium frequencies
    path = write_gguf(tmp_path / "llama3.gguf", weights, tokenizer_fields, rope_freqs=factors)
    reference = transformers_model(weights, LLAMA3)
    assert max_logprob_difference(path, reference, tmp_path / "cache") < 1e-4


def rope_scaling_of(path: Path, rope_freqs: np.ndarray, head_dim: int, theta: float):
    """What the conversion makes of a GGUF's rope_freqs tensor (a GGUF of rope metadata only)."""
    from radixlm.runtime.model_loader import _gguf_rope_scaling

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_rope_freq_base(theta)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _gguf_rope_scaling(gguf.GGUFReader(str(path)))


def test_llama_3_1_rope_freqs_convert_back_to_its_llama3_parameters(tmp_path):
    llama_3_1 = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    factors = llama_cpp_llama3_factors(llama_3_1, head_dim=128, theta=500000.0)
    assert rope_scaling_of(tmp_path / "rope.gguf", factors, 128, 500000.0) == llama_3_1


def test_rope_freqs_other_than_llama3_are_refused(tmp_path):
    factors = llama_cpp_llama3_factors(LLAMA3)
    factors[-3] += 0.5  # one low frequency off the llama3 curve
    with pytest.raises(ValueError, match="rope_freqs.weight .* other than llama3"):
        rope_scaling_of(tmp_path / "rope.gguf", factors, HEAD_DIM, TINY["rope_theta"])


def test_a_gguf_without_rope_scaling_converts_to_plain_rope(tmp_path, weights, tokenizer_fields):
    path = write_gguf(tmp_path / "plain.gguf", weights, tokenizer_fields)
    reference = transformers_model(weights, None)
    assert max_logprob_difference(path, reference, tmp_path / "cache") < 1e-4


def test_yarn_rope_scaling_in_a_gguf_is_refused_by_its_key(tmp_path, weights, tokenizer_fields):
    path = write_gguf(
        tmp_path / "yarn.gguf", weights, tokenizer_fields, (gguf.RopeScalingType.YARN, 4.0)
    )
    with pytest.raises(ValueError, match=r"'yarn' \(llama\.rope\.scaling\.type\) is not supported"):
        radixlm.Engine(str(path), cache_dir=str(tmp_path / "cache"))


def saved_dtypes(folder: Path) -> tuple[set[torch.dtype], str]:
    """The dtypes of a converted folder's tensors, and the dtype its config.json names."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118
    config = json.loads((folder / "config.json").read_text())
    return dtypes, config.get("dtype", config.get("torch_dtype"))


def test_the_default_gguf_converts_exactly_to_float32(default_model_folder):
    # small: its dequantized Q4_1 and Q8_0 values kept exactly
    assert saved_dtypes(Path(default_model_folder)) == ({torch.float32}, "float32")


def test_a_large_gguf_converts_to_float16(tmp_path, weights, tokenizer_fields, monkeypatch):
    # float16 is closer than bfloat16 to Q4_1 and Q8_0 values (as "large": the bound lowered)
    monkeypatch.setattr(model_loader, "EXACT_GGUF_BYTES", 0)
    path = write_gguf(tmp_path / "large.gguf", weights, tokenizer_fields)
    folder = resolve_model_folder(str(path), str(tmp_path / "cache"))
    assert saved_dtypes(folder) == ({torch.float16}, "float16")


def test_a_gguf_with_values_beyond_float16_converts_to_bfloat16(
    tmp_path, weights, tokenizer_fields, monkeypatch
):
    monkeypatch.setattr(model_loader, "EXACT_GGUF_BYTES", 0)
    huge = dict(weights, **{"model.norm.weight": torch.full((TINY["hidden_size"],), 1e5)})
    path = write_gguf(tmp_path / "huge.gguf", huge, tokenizer_fields)
    folder = resolve_model_folder(str(path), str(tmp_path / "cache"))
    assert saved_dtypes(folder) == ({torch.bfloat16}, "bfloat16")


def test_a_reinstalled_gguf_finds_its_conversion_and_a_new_version_replaces_it(
    tmp_path, weights, tokenizer_fields
):
    """The converted folder is keyed by the file's content, not its path or time (a fresh virtual
    environment installs the same file again); converting another version of the file at the
    same path, or where the one before is gone, removes the folder of the one before, while a
    different file of the same name elsewhere keeps its own."""
    cache = tmp_path / "cache"
    for sub in "abcd":
        (tmp_path / sub).mkdir()
    first = write_gguf(tmp_path / "a" / "tiny.gguf", weights, tokenizer_fields)
    folder = resolve_model_folder(str(first), str(cache))
    again = tmp_path / "b" / "tiny.gguf"
    again.write_bytes(first.read_bytes())  # another path, another time
    assert resolve_model_folder(str(again), str(cache)) == folder
    other = dict(weights, **{"model.norm.weight": weights["model.norm.weight"] * 2})
    elsewhere = write_gguf(tmp_path / "c" / "tiny.gguf", other, tokenizer_fields)
    second = resolve_model_folder(str(elsewhere), str(cache))
    assert second != folder and second.is_dir() and folder.is_dir()  # both files are there
    third = dict(weights, **{"model.norm.weight": weights["model.norm.weight"] * 3})
    write_gguf(elsewhere, third, tokenizer_fields)  # a new version in its place
    replaced = resolve_model_folder(str(elsewhere), str(cache))
    assert replaced not in (folder, second) and not second.exists() and folder.is_dir()
    first.unlink()  # the environment that held the first is gone
    unrelated = cache / "tiny-extra-0123456789abcdef"  # another model's folder stays
    unrelated.mkdir()
    fourth = dict(weights, **{"model.norm.weight": weights["model.norm.weight"] * 4})
    newest = write_gguf(tmp_path / "d" / "tiny.gguf", fourth, tokenizer_fields)
    resolve_model_folder(str(newest), str(cache))
    assert not folder.exists()  # its file is gone
    assert replaced.is_dir() and unrelated.is_dir()  # c's file is still there; another model


def test_a_gguf_of_an_architecture_we_cannot_run_is_refused_before_its_conversion(
    tmp_path, weights, tokenizer_fields, monkeypatch
):
    plain = gguf.GGUFWriter.__init__
    monkeypatch.setattr(
        gguf.GGUFWriter,
        "__init__",
        lambda self, path, arch, *a, **kw: plain(self, path, "gemma2", *a, **kw),
    )
    path = write_gguf(tmp_path / "gemma.gguf", weights, tokenizer_fields)
    monkeypatch.setattr(gguf.GGUFWriter, "__init__", plain)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="gemma2"):
        resolve_model_folder(str(path), str(cache))
    assert not any(cache.rglob("*.safetensors"))  # nothing converted, nothing left behind
