"""Each supported decoder family against transformers' own implementation, on tiny random models:
prompt log-probabilities (prefill) and output log-probabilities (decode, teacher-forced) agree."""

from __future__ import annotations

import pytest
import torch

import radixlm
from radixlm.runtime.model_loader import copy_tokenizer_files

FAMILIES = {
    "llama": ("LlamaConfig", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", {"use_sliding_window": False, "head_dim": 32}),
    # YaRN over an original context of 64 positions: the prompts' 150 and more reach past it
    "qwen2-yarn": ("Qwen2Config", {"use_sliding_window": False, "rope_scaling": {
                   "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_folder(request, tmp_path_factory, default_model_folder):
    import transformers

    config_class, extra = FAMILIES[request.param]
    cfg = getattr(transformers, config_class)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if request.param.startswith("qwen2"):  # random biases, so that a dropped bias shows
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    copy_tokenizer_files(default_model_folder, out)
    return request.param, str(out), model.eval()


def test_prefill_and_decode_logprobs_match_transformers(family_folder):
    family, folder, hf = family_folder
    prompts = [
        [(37 * i + 11 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((3, 90, 150))
    ]
    with radixlm.Engine(folder, chunked_prefill_size=64) as eng:
        assert eng.model_config.model_type == family.split("-")[0]
        outs = eng.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            return_logprob=True, logprob_start_len=0,
        )  # fmt: skip
    for prompt, out in zip(prompts, outs):
        full = prompt + out["output_ids"]
        with torch.inference_mode():
            ref = torch.log_softmax(hf(input_ids=torch.tensor([full])).logits[0].float(), -1)
        ours_in = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
        ref_in = [ref[i - 1, full[i]].item() for i in range(1, len(prompt))]
        assert max((abs(a - b) for a, b in zip(ours_in, ref_in)), default=0.0) < 1e-3
        ours_out = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        ref_out = [ref[len(prompt) + j - 1, t].item() for j, t in enumerate(out["output_ids"])]
        assert max(abs(a - b) for a, b in zip(ours_out, ref_out)) < 1e-3
        # greedy: each output token is the reference's argmax up to floating-point near-ties
        for j, t in enumerate(out["output_ids"]):
            row = ref[len(prompt) + j - 1]
            assert row.max().item() - row[t].item() < 1e-4


def _config(config_class: str, **extra):
    import transformers

    extra = {"max_position_embeddings": 8192, **extra}
    return getattr(transformers, config_class)(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("config_class", "extra", "message"),
    [
        ("LlamaConfig", {"hidden_act": "gelu"}, "hidden_act"),
        ("LlamaConfig", {"mlp_bias": True}, "mlp_bias"),
        ("LlamaConfig", {"attention_bias": True}, "attention_bias"),
        ("LlamaConfig", {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),
    ],
)
def test_configs_the_model_code_would_compute_wrongly_are_refused(config_class, extra, message):
    """Refused from the config, before any weight is read (each of these once loaded and ran,
    or failed only after loading every weight)."""
    from radixlm.runtime.model_config import ModelConfig

    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(_config(config_class, **extra))


def test_a_sliding_window_caps_the_context_and_refuses_more():
    from radixlm.runtime.model_config import ModelConfig

    mistral = ModelConfig.from_hf(_config("MistralConfig", sliding_window=1024))
    assert mistral.sliding_window == 1024
    assert mistral.context_limit(None) == 1024 and mistral.context_limit(512) == 512
    with pytest.raises(ValueError, match="sliding attention window of 1024"):
        mistral.context_limit(4096)
    qwen = ModelConfig.from_hf(_config("Qwen2Config", use_sliding_window=True, sliding_window=256))
    assert qwen.context_limit(None) == 256
    plain = ModelConfig.from_hf(
        _config("Qwen2Config", use_sliding_window=False, sliding_window=256)
    )
    assert plain.sliding_window is None and plain.context_limit(None) == 8192


def test_yarn_serves_its_original_context_times_its_factor():
    """Qwen2.5's YaRN setting: max_position_embeddings stays 32,768, the factor of 4 over an
    original 32,768 reaches 131,072 positions, the context served (as vLLM and SGLang read it)."""
    from radixlm.runtime.model_config import ModelConfig

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cfg = ModelConfig.from_hf(
        _config(
            "Qwen2Config",
            use_sliding_window=False,
            max_position_embeddings=32768,
            rope_scaling=yarn,
        )  # fmt: skip
    )
    assert cfg.max_positions == 131072 and cfg.context_limit(None) == 131072
    assert cfg.context_limit(100000) == 100000
    with pytest.raises(ValueError, match=r"exceeds the model's positions \(131072\)"):
        cfg.context_limit(131073)


def test_eos_ids_of_the_generation_config_are_stop_tokens(tmp_path, tiny_model_folder):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_folder, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    with radixlm.Engine(str(folder), load_format="dummy") as eng:
        assert {2, 7} <= eng.eos_token_ids


def test_weights_that_do_not_fit_in_free_memory_are_refused_before_loading(
    tiny_model_folder, monkeypatch
):
    import radixlm.runtime.model_setup as model_setup

    monkeypatch.setattr(model_setup, "free_memory", lambda device: 1 << 20)
    with pytest.raises(ValueError, match="weights take .* GiB in float32.*half dtype"):
        radixlm.Engine(tiny_model_folder)


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 4.0, "original_max_position_embeddings": 4096},
        {"factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2},
        {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
         "mscale_all_dim": 0.707},
        {"factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 1.3,
         "truncate": False},
    ],
)  # fmt: skip
def test_yarn_frequencies_and_scale_are_transformers(params):
    """YaRN's rotary frequencies and cos/sin factor against transformers' own, with the
    defaults, other ramp bounds, DeepSeek's two mscales, and a given factor without truncation."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from radixlm.runtime.layers import _scale_inv_freq

    theta, head_dim = 1e6, 128
    cfg = transformers.LlamaConfig(
        hidden_size=1024, num_attention_heads=8, head_dim=head_dim, rope_theta=theta,
        max_position_embeddings=131072, rope_scaling={"rope_type": "yarn", **params},
    )  # fmt: skip
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    got, factor = _scale_inv_freq(base, {"rope_type": "yarn", **params}, theta)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-9)
