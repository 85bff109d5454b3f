"""The EAGLE-1/2 draft (runtime/models/llama_eagle.py, speculative_algorithm="EAGLE"): the final
hidden state the target keeps for it against transformers' own, the draft layer over the
engine's attention against a plain-torch twin written here from the layout (the EAGLE authors'
and SGLang's `LlamaForCausalLMEagle`: fc over the embedding and the hidden state, a Llama layer
without its input norm, the target's LM head), its checkpoint names, the refusal of drafts that
do not fit, training-time test against drafting, and `train-draft --algorithm EAGLE` end to end.
(The engine drafting with it: tests/test_speculative_eagle3_engine.py, which runs both kinds.)
Tiny random models on the CPU, float32."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from radixlm.runtime.attention import TorchAttentionBackend
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory_pool import KVPool
from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.models.llama_eagle import EagleConfig, LlamaEagleDraft
from tests.test_speculative_eagle3 import (
    HEADS,
    INTER,
    KV_HEADS,
    TARGET_HIDDEN,
    VOCAB,
    assert_ttt_is_drafting,
    prefill,
    target_pair,
    twin_layer,
)

HIDDEN = TARGET_HIDDEN  # (an EAGLE draft is as wide as its target)
HEAD_DIM = HIDDEN // HEADS


def draft_config(**change) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 1,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 128, "vocab_size": VOCAB,
        "tie_word_embeddings": False, **change,
    }  # fmt: skip


def draft_tensors(seed: int = 1) -> dict[str, torch.Tensor]:
    """Random weights under an EAGLE checkpoint's names (the authors' and SGLang's), with the
    copies of the target's embedding and LM head such checkpoints carry; the norm away from 1."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    p = "layers.0."
    return {
        "fc.weight": w(HIDDEN, 2 * HIDDEN), "fc.bias": 0.1 * torch.randn(HIDDEN, generator=gen),
        p + "post_attention_layernorm.weight": 1 + 0.2 * torch.randn(HIDDEN, generator=gen),
        p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": w(INTER, HIDDEN), p + "mlp.up_proj.weight": w(INTER, HIDDEN),
        p + "mlp.down_proj.weight": w(HIDDEN, INTER),
        "embed_tokens.weight": w(VOCAB, HIDDEN), "lm_head.weight": w(VOCAB, HIDDEN),
    }  # fmt: skip


def write_draft(folder, config: dict | None = None, tensors: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or draft_config()))
    save_file(tensors or draft_tensors(), str(folder / "model.safetensors"))
    return folder


def load_draft(folder, target) -> LlamaEagleDraft:
    return LlamaEagleDraft.load(folder, target, torch.device("cpu"), torch.float32, 128)


def test_the_target_keeps_its_final_hidden_state_as_layer_past_its_last():
    """aux_layers naming the number of layers keeps the final norm's output (what transformers
    returns as the last hidden state), beside other layers' inputs in the order asked for."""
    hf, ours = target_pair()
    tokens = [5, 17, 3, 88, 41, 9, 60]
    batch, backend = prefill(
        ours, 6, 2, TARGET_HIDDEN // 4, tokens,
        hidden_indices=torch.tensor([1, 4, 6]), aux_layers=(6, 2),
    )  # fmt: skip
    ours(batch, backend)
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0, [1, 4, 6]] for i in (6, 2)], dim=-1)
    torch.testing.assert_close(batch.aux_hidden_states, want, atol=1e-5, rtol=1e-5)
    assert EagleConfig.from_dict(draft_config()).target_layers(ours.cfg) == (6,)


def twin(t: dict, embed, head, tokens, hidden, positions, past=None):
    """The draft layer written from the layout, plain torch (transformers' rope): rows of one
    request at `positions`, attending causally to `past` and themselves; `hidden` the target's
    final hidden state or the draft's own output (both through fc). (logits, outputs, (k, v))."""
    x = torch.cat([embed[tokens], hidden], dim=-1) @ t["fc.weight"].T + t["fc.bias"]
    out, past = twin_layer(t, "layers.0.", x, x, positions, past)  # (no input norm)
    return out @ head.T, out, past


def test_the_draft_layer_computes_what_its_layout_says_then_drafts_from_its_own_output(tmp_path):
    """Over a context from the target's final hidden states, then a draft step reading its own
    output, both through fc; the logits are the target's LM head's (the checkpoint's copies of
    the embedding and the head are not read)."""
    _, target = target_pair()
    embed, head = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    tensors = draft_tensors()
    draft = load_draft(write_draft(tmp_path / "draft"), target)
    torch.manual_seed(3)
    tokens, hidden = [7, 30, 2, 55, 81], torch.randn(5, TARGET_HIDDEN)
    pool = KVPool(16, 1, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    backend = TorchAttentionBackend(pool, torch.arange(1, 17, dtype=torch.int32)[None])
    batch, _ = prefill(draft, 1, KV_HEADS, HEAD_DIM, tokens)
    logits, out = draft(batch, backend, hidden)
    want_logits, want_out, past = twin(tensors, embed, head, tokens, hidden, list(range(5)))
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    token = int(draft.target_ids(logits[-1:].argmax(-1)))
    assert token == int(logits[-1].argmax())  # (one vocabulary: draft ids are the target's)
    t = torch.tensor
    step = ForwardBatch(
        input_ids=t([token]), positions=t([5]), out_cache_loc=t([6]), req_pool_indices=t([0]),
        prefix_lens=t([5]), extend_lens=t([1]), seq_lens=t([6]), logits_indices=None,
        extend_lens_cpu=[1], prefix_lens_cpu=[5], num_multi=0,
    )  # fmt: skip
    logits2, out2 = draft(step, backend, out[-1:], from_target=False)
    want2, want_out2, _ = twin(tensors, embed, head, [token], want_out[-1:], [5], past)
    torch.testing.assert_close(out2, want_out2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits2, want2, atol=1e-5, rtol=1e-5)


def test_drafts_that_do_not_fit_and_checkpoints_that_lack_a_weight_are_refused(tmp_path):
    target_model = target_pair()[1]
    target = ModelConfig.from_hf(target_pair()[0].config)
    refusals = [
        ({"architectures": ["LlamaForCausalLMEagle3"]}, "runs under speculative_algorithm=EAGLE3"),
        ({"num_hidden_layers": 2}, "drafts of one decoder layer"),
    ]
    for change, says in refusals:
        with pytest.raises(ValueError, match=says):
            EagleConfig.from_dict(draft_config(**change))
    misfits = [
        ({"hidden_size": 64}, "hidden states of size 64; the target model's are 48"),
        ({"vocab_size": 128}, r"vocabulary \(128 tokens\) is not the target model's \(96\)"),
    ]
    for change, says in misfits:
        with pytest.raises(ValueError, match=says):
            EagleConfig.from_dict(draft_config(**change)).target_layers(target)
    with pytest.raises(ValueError, match="not a readable EAGLE draft config"):
        EagleConfig.from_folder(tmp_path)
    tensors = draft_tensors()
    del tensors["fc.bias"]
    with pytest.raises(ValueError, match=r"lacks \['fc.bias'\]"):
        load_draft(write_draft(tmp_path / "a", tensors=tensors), target_model)
    # a checkpoint whose fc has no bias says so in its config
    load_draft(write_draft(tmp_path / "b", draft_config(bias=False), tensors), target_model)
    tensors = {**draft_tensors(), "layers.0.extra.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="unexpected weight 'layers.0.extra.weight'"):
        load_draft(write_draft(tmp_path / "c", tensors=tensors), target_model)
    # SGLang's names with "model." before them load alike
    tensors = {f"model.{k}": v for k, v in draft_tensors().items()}
    draft = load_draft(write_draft(tmp_path / "d", tensors=tensors), target_model)
    torch.testing.assert_close(draft.fc.bias, draft_tensors()["fc.bias"])
    # the EAGLE authors' releases: LlamaForCausalLM in config.json, PyTorch's pytorch_model.bin
    authors = tmp_path / "e"
    authors.mkdir()
    (authors / "config.json").write_text(
        json.dumps(draft_config(architectures=["LlamaForCausalLM"]))
    )
    torch.save(draft_tensors(), authors / "pytorch_model.bin")
    draft = load_draft(authors, target_model)
    torch.testing.assert_close(draft.fc.weight, draft_tensors()["fc.weight"])
    with pytest.raises(ValueError, match="no \\*.safetensors or \\*.bin file"):
        (authors / "pytorch_model.bin").unlink()
        load_draft(authors, target_model)
    with pytest.raises(ValueError, match="lack 'LlamaForCausalLMEagle'"):
        EagleConfig.from_dict(draft_config(architectures=["Qwen2ForCausalLM"]))


def test_training_time_test_sees_at_each_depth_what_drafting_sees(tmp_path):
    """ttt_forward's step j at row t against the draft run as the engine runs it: a context
    from the target's final hidden states up to t, then j draft steps, each fed its own output
    and the token the sequence holds there."""
    _, target = target_pair()
    draft = load_draft(write_draft(tmp_path / "draft"), target)
    assert_ttt_is_drafting(draft, TARGET_HIDDEN)


def test_train_draft_makes_an_eagle_draft_the_engine_drafts_with(tiny_model_folder, tmp_path):
    """`train-draft --algorithm EAGLE` on the tiny model: the loss falls, the checkpoint names
    the EAGLE architecture and holds the layer's tensors only (the engine reads the model's own
    embedding and LM head), and the engine drafts with it, outputs plain decoding's."""
    import radixlm
    from radixlm.runtime.speculative import training
    from radixlm.runtime.speculative.train_options import TrainDraftOptions
    from tests.test_speculative_engine import results

    opts = TrainDraftOptions(
        output=str(tmp_path / "d"), algorithm="EAGLE", num_heads=2, num_prompts=6,
        max_new_tokens=12, random_prompt_fraction=0.5, held_out_fraction=0.34, batch_size=24,
        steps=8, lr=3e-3, save_every=4, log_every=1, intermediate_size=32,
    )  # fmt: skip
    opts.check()
    engine_kwargs = {"model_path": tiny_model_folder, "device": "cpu", "dtype": "float32"}
    summary = training.train_draft(opts, engine_kwargs, say=lambda _: None)
    log = [json.loads(line) for line in (tmp_path / "d" / training.LOG).read_text().splitlines()]
    losses = [e["loss"] for e in log if "loss" in e]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert len(summary["held_out"]["depth_top1"]) == 2
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert config["intermediate_size"] == 32 and config["training"]["steps"] == 8
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert "fc.bias" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not names & {"embed_tokens.weight", "lm_head.weight"}
    with pytest.raises(ValueError, match="--draft-vocab-size is for an EAGLE3 draft"):
        TrainDraftOptions(output="x", algorithm="EAGLE", draft_vocab_size=8).check()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    kw = {"device": "cpu", "dtype": "float32", "disable_radix_cache": True}
    with radixlm.Engine(tiny_model_folder, **kw) as eng:
        plain = eng.generate(prompts, params)
    spec = {"speculative_algorithm": "EAGLE", "speculative_adaptive": False}
    with radixlm.Engine(
        tiny_model_folder, speculative_draft_model_path=str(tmp_path / "d"), **spec, **kw
    ) as eng:  # fmt: skip
        outs = eng.generate(prompts, params)
        stats = eng.get_stats()
        assert eng._core.speculative.eagle is not None  # (drafting never failed)
    assert results(outs) == results(plain)
    assert stats["spec_verify_ct"] > 0, stats
    # trees of the chain and the draft's next two candidates at each depth: plain outputs too
    with radixlm.Engine(
        tiny_model_folder, speculative_draft_model_path=str(tmp_path / "d"),
        speculative_eagle_topk=3, **spec, **kw,
    ) as eng:  # fmt: skip
        assert results(eng.generate(prompts, params)) == results(plain)
        assert eng.get_stats()["spec_verify_ct"] > 0
    # without a path: no EAGLE draft ships for a model, and the message says how to make one
    with pytest.raises(ValueError, match="no EAGLE draft ships for this model; make one with"):
        radixlm.Engine(tiny_model_folder, **spec, **kw)
