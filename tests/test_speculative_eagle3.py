"""The EAGLE-3 draft layout (runtime/models/llama_eagle3.py): the features the target keeps for it
against transformers' own hidden states, the draft layer over the engine's attention against a
plain-torch twin written here from the layout (SGLang's `LlamaForCausalLMEagle3`), its checkpoint
names, and the refusal of drafts that do not fit. Tiny random models on the CPU, float32."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from radixlm.runtime.attention import TorchAttentionBackend
from radixlm.runtime.forward_batch import ForwardBatch
from radixlm.runtime.memory_pool import KVPool
from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.models.llama_eagle3 import (
    Eagle3Config,
    LlamaEagle3Draft,
    default_aux_layers,
)

VOCAB, TARGET_HIDDEN, HIDDEN, HEADS, KV_HEADS, INTER = 96, 48, 48, 4, 2, 64


def target_pair(layers: int = 6):
    """A tiny random Llama in transformers and the same weights in radixlm's model."""
    # (transformers imported once radixlm is: it then finds its own `kernels`, not this
    # repository's folder of that name, as the other tests that read it do)
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=TARGET_HIDDEN, intermediate_size=96,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    hf = HFLlama(hf_cfg).eval()
    ours = LlamaForCausalLM(ModelConfig.from_hf(hf_cfg), 128)
    ours.load_weights(hf.state_dict().items())
    ours.rope.build_tables(torch.device("cpu"))
    return hf, ours


def prefill(model, layers: int, kv_heads: int, head_dim: int, tokens: list[int], **extra):
    """One request's tokens from position 0 through `model` (its own KV pool of `layers`
    layers); returns the batch, which holds what the model kept."""
    n = len(tokens)
    pool = KVPool(n + 1, layers, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    table = torch.arange(1, n + 1, dtype=torch.int32)[None]
    t = torch.tensor
    batch = ForwardBatch(
        input_ids=t(tokens), positions=torch.arange(n), out_cache_loc=torch.arange(1, n + 1),
        req_pool_indices=t([0]), prefix_lens=t([0]), extend_lens=t([n]), seq_lens=t([n]),
        logits_indices=None, extend_lens_cpu=[n], prefix_lens_cpu=[0], num_multi=1, **extra,
    )  # fmt: skip
    return batch, TorchAttentionBackend(pool, table)


def test_the_target_keeps_the_stream_entering_the_layers_a_draft_reads():
    hf, ours = target_pair()
    tokens = [5, 17, 3, 88, 41, 9, 60]
    layers = default_aux_layers(6)
    assert layers == (2, 3, 3)
    batch, backend = prefill(
        ours, 6, 2, TARGET_HIDDEN // 4, tokens,
        hidden_indices=torch.tensor([1, 4, 6]), aux_layers=(5, 0, 2, 2),
    )  # fmt: skip
    ours(batch, backend)
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    # in the order asked for, a layer named twice twice
    want = torch.cat([states[i][0, [1, 4, 6]] for i in (5, 0, 2, 2)], dim=-1)
    assert batch.aux_hidden_states.shape == (3, 4 * TARGET_HIDDEN)
    assert batch.hidden_states is None  # (the features instead of the final hidden states)
    torch.testing.assert_close(batch.aux_hidden_states, want, atol=1e-5, rtol=1e-5)
    # none asked for, none kept
    batch, backend = prefill(ours, 6, 2, TARGET_HIDDEN // 4, tokens, hidden_indices=torch.tensor([6]))  # fmt: skip
    ours(batch, backend)
    assert batch.aux_hidden_states is None and batch.hidden_states.shape == (1, TARGET_HIDDEN)


def draft_config(**change) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 1,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 128, "vocab_size": VOCAB,
        "draft_vocab_size": 64, "target_hidden_size": TARGET_HIDDEN,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, **change,
    }  # fmt: skip


def draft_tensors(seed: int = 1) -> dict[str, torch.Tensor]:
    """Random weights under an EAGLE-3 checkpoint's names; the norms away from 1."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN // HEADS

    def w(*shape):
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    def norm():
        return 1 + 0.2 * torch.randn(HIDDEN, generator=gen)

    p = "midlayer."
    tensors = {
        "fc.weight": w(HIDDEN, 3 * TARGET_HIDDEN),
        p + "input_layernorm.weight": norm(), p + "hidden_norm.weight": norm(),
        p + "post_attention_layernorm.weight": norm(), "norm.weight": norm(),
        p + "self_attn.q_proj.weight": w(HEADS * head_dim, 2 * HIDDEN),
        p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, 2 * HIDDEN),
        p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, 2 * HIDDEN),
        p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim),
        p + "mlp.gate_proj.weight": w(INTER, HIDDEN), p + "mlp.up_proj.weight": w(INTER, HIDDEN),
        p + "mlp.down_proj.weight": w(HIDDEN, INTER),
        "lm_head.weight": w(64, HIDDEN),
        # draft id d is target id d + d2t[d]: the draft's 64 ids spread over the target's 96
        "d2t": torch.arange(64) // 2, "t2d": torch.zeros(VOCAB, dtype=torch.bool),
    }  # fmt: skip
    return tensors


def write_draft(folder, config: dict | None = None, tensors: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or draft_config()))
    save_file(tensors or draft_tensors(), str(folder / "model.safetensors"))
    return folder


def load_draft(folder, target) -> LlamaEagle3Draft:
    return LlamaEagle3Draft.load(folder, target, torch.device("cpu"), torch.float32, 128)


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def twin(t: dict, embed: torch.Tensor, tokens, features, positions, past=None):
    """The draft layer written from the layout, plain torch (transformers' rope): rows of one
    request at `positions` (consecutive), attending causally to `past` (keys, values of earlier
    positions) and themselves. `features`: the target's (3 x its hidden) or the draft's own
    output (hidden). Returns (logits, outputs, (keys, values) through these rows)."""
    p = "midlayer."
    hidden = features @ t["fc.weight"].T if features.shape[-1] != HIDDEN else features
    e = rms(embed[tokens], t[p + "input_layernorm.weight"])
    both = torch.cat([e, rms(hidden, t[p + "hidden_norm.weight"])], dim=-1)
    out, past = twin_layer(t, p, both, hidden, positions, past)
    logits = rms(out, t["norm.weight"]) @ t["lm_head.weight"].T
    return logits, out, past


def twin_layer(t: dict, p: str, qkv_in, residual, positions, past=None):
    """A draft's decoder layer after its input, plain torch (transformers' rope): attention with
    q, k, v from `qkv_in` (the tensors named `p` + ...), attending causally to `past` and these
    rows, plus `residual`, then the MLP after the post-attention norm, plus its input. Returns
    (outputs, (keys, values) through these rows)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    head_dim = HIDDEN // HEADS
    q = (qkv_in @ t[p + "self_attn.q_proj.weight"].T).view(-1, HEADS, head_dim).transpose(0, 1)
    k = (qkv_in @ t[p + "self_attn.k_proj.weight"].T).view(-1, KV_HEADS, head_dim).transpose(0, 1)
    v = (qkv_in @ t[p + "self_attn.v_proj.weight"].T).view(-1, KV_HEADS, head_dim).transpose(0, 1)
    cfg = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, rope_theta=10000.0)
    cos, sin = LlamaRotaryEmbedding(cfg)(v, torch.tensor([positions]))
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    q, k = q[0], k[0]
    if past is not None:
        k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
    n, total = q.shape[1], k.shape[1]
    mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    groups = HEADS // KV_HEADS
    a = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0), attn_mask=mask
    )
    a = a.transpose(0, 1).reshape(n, -1) @ t[p + "self_attn.o_proj.weight"].T
    s = a + residual
    x = rms(s, t[p + "post_attention_layernorm.weight"])
    m = F.silu(x @ t[p + "mlp.gate_proj.weight"].T) * (x @ t[p + "mlp.up_proj.weight"].T)
    return m @ t[p + "mlp.down_proj.weight"].T + s, (k, v)


def test_the_draft_layer_computes_what_its_layout_says_then_drafts_from_its_own_output(tmp_path):
    _, target = target_pair()
    embed = target.embed_tokens.weight.detach()
    tensors = draft_tensors()
    draft = load_draft(write_draft(tmp_path / "draft"), target)
    torch.manual_seed(3)
    tokens, features = [7, 30, 2, 55, 81], torch.randn(5, 3 * TARGET_HIDDEN)

    # the context: the target's features at each position, with the token after it
    pool = KVPool(16, 1, KV_HEADS, HIDDEN // HEADS, torch.float32, torch.device("cpu"))
    table = torch.arange(1, 17, dtype=torch.int32)[None]
    backend = TorchAttentionBackend(pool, table)
    batch, _ = prefill(draft, 1, KV_HEADS, HIDDEN // HEADS, tokens)
    logits, out = draft(batch, backend, features)
    want_logits, want_out, past = twin(tensors, embed, tokens, features, list(range(5)))
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)

    # a draft step: the drafted token at the next position, the draft's own last output as its
    # hidden (no fc), attending to the context's keys
    token = int(draft.target_ids(logits[-1:].argmax(-1)))
    assert token == int(logits[-1].argmax()) + int(tensors["d2t"][int(logits[-1].argmax())])
    t = torch.tensor
    step = ForwardBatch(
        input_ids=t([token]), positions=t([5]), out_cache_loc=t([6]), req_pool_indices=t([0]),
        prefix_lens=t([5]), extend_lens=t([1]), seq_lens=t([6]), logits_indices=None,
        extend_lens_cpu=[1], prefix_lens_cpu=[5], num_multi=0,
    )  # fmt: skip
    logits2, out2 = draft(step, backend, out[-1:], from_target=False)
    want2, want_out2, _ = twin(tensors, embed, [token], want_out[-1:], [5], past)
    torch.testing.assert_close(out2, want_out2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits2, want2, atol=1e-5, rtol=1e-5)


def test_the_config_names_the_target_layers_and_drafts_that_do_not_fit_are_refused(tmp_path):
    target = ModelConfig.from_hf(target_pair()[0].config)
    assert Eagle3Config.from_dict(draft_config()).target_layers(target) == (2, 3, 5)
    no_ids = {k: v for k, v in draft_config().items() if k != "eagle_config"}
    assert Eagle3Config.from_dict(no_ids).target_layers(target) == (2, 3, 3)
    refusals = [
        ({"architectures": ["LlamaForCausalLM"]}, "lack 'LlamaForCausalLMEagle3'"),
        ({"num_hidden_layers": 2}, "drafts of one decoder layer"),
    ]
    for change, says in refusals:
        with pytest.raises(ValueError, match=says):
            Eagle3Config.from_dict(draft_config(**change))
    misfits = [
        ({"target_hidden_size": 64}, "features of hidden size 64; the target model's is 48"),
        ({"vocab_size": 128}, "is not the target model's"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, "has 6 layers"),
    ]
    for change, says in misfits:
        with pytest.raises(ValueError, match=says):
            Eagle3Config.from_dict(draft_config(**change)).target_layers(target)
    with pytest.raises(ValueError, match="not a readable EAGLE-3 draft config"):
        Eagle3Config.from_folder(tmp_path)


def test_a_checkpoint_must_give_every_weight_of_the_layer_in_its_shape(tmp_path):
    _, target = target_pair()
    tensors = draft_tensors()
    del tensors["midlayer.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks \['midlayer.self_attn.k_proj.weight'\]"):
        load_draft(write_draft(tmp_path / "a", tensors=tensors), target)
    tensors = draft_tensors()
    tensors["fc.weight"] = tensors["fc.weight"][:, :10].contiguous()
    with pytest.raises(ValueError, match="'fc.weight' has shape \\(48, 10\\)"):
        load_draft(write_draft(tmp_path / "b", tensors=tensors), target)
    tensors = {**draft_tensors(), "midlayer.extra.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="unexpected weight 'midlayer.extra.weight'"):
        load_draft(write_draft(tmp_path / "c", tensors=tensors), target)
    # SGLang's names with "model." before them load alike
    tensors = {f"model.{k}" if k != "lm_head.weight" else k: v for k, v in draft_tensors().items()}
    draft = load_draft(write_draft(tmp_path / "d", tensors=tensors), target)
    torch.testing.assert_close(draft.fc.weight, draft_tensors()["fc.weight"])


def test_training_time_test_sees_at_each_depth_what_drafting_sees(tmp_path):
    """ttt_forward's step j at row t against the draft run as the engine runs it: a context
    from the target's features up to t, then j draft steps, each fed its own output and the
    token the sequence holds there."""
    _, target = target_pair()
    draft = load_draft(write_draft(tmp_path / "draft"), target)
    assert_ttt_is_drafting(draft, 3 * TARGET_HIDDEN)


def assert_ttt_is_drafting(draft, width: int) -> None:
    """`ttt_forward` of `draft` over a sequence with random target features (`width` wide)
    against the draft run as the engine runs it, at rows 0, 2 and 4 and depths 0-2."""
    from radixlm.runtime.speculative.eagle3_training import ttt_forward

    torch.manual_seed(4)
    tokens = torch.tensor([[7, 30, 2, 55, 81, 12, 64, 3]])
    features = torch.randn(1, 8, width)
    with torch.no_grad():
        outs = ttt_forward(draft, tokens, features, steps=3)
    t = torch.tensor
    for row in (0, 2, 4):
        pool = KVPool(16, 1, KV_HEADS, HIDDEN // HEADS, torch.float32, torch.device("cpu"))
        backend = TorchAttentionBackend(pool, torch.arange(1, 17, dtype=torch.int32)[None])
        context = tokens[0, 1 : row + 2].tolist()
        batch, _ = prefill(draft, 1, KV_HEADS, HIDDEN // HEADS, context)
        _, out = draft(batch, backend, features[0, : row + 1])
        torch.testing.assert_close(outs[0][0, row], out[-1], atol=1e-5, rtol=1e-5)
        hidden = out[-1:]
        for j in (1, 2):
            pos = row + j
            step = ForwardBatch(
                input_ids=tokens[0, row + 1 + j : row + 2 + j], positions=t([pos]),
                out_cache_loc=t([pos + 1]), req_pool_indices=t([0]), prefix_lens=t([pos]),
                extend_lens=t([1]), seq_lens=t([pos + 1]), logits_indices=None,
                extend_lens_cpu=[1], prefix_lens_cpu=[pos], num_multi=0,
            )  # fmt: skip
            _, hidden = draft(step, backend, hidden, from_target=False)
            torch.testing.assert_close(outs[j][0, row], hidden[0], atol=1e-5, rtol=1e-5)


def test_training_lowers_the_loss_on_a_targets_own_sequences(tmp_path):
    from radixlm.runtime.speculative.eagle3_training import ttt_loss

    hf, target = target_pair()
    draft = load_draft(write_draft(tmp_path / "draft"), target)
    # sequences the target writes greedily, with its features
    gen = torch.Generator().manual_seed(5)
    starts = torch.randint(0, VOCAB, (8, 4), generator=gen)
    with torch.no_grad():
        seqs = hf.generate(starts, max_new_tokens=12, do_sample=False, pad_token_id=0)
        states = hf(seqs, output_hidden_states=True).hidden_states
    layers = draft.config.target_layers(target.cfg)
    features = torch.cat([states[i] for i in layers], dim=-1)
    lengths = torch.full((8,), seqs.shape[1])
    answers = torch.full((8,), 4)  # (the loss counts the target's own tokens only)
    for p in draft.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    with torch.no_grad():
        first, _ = ttt_loss(draft, seqs, features, lengths, steps=3, starts=answers)
        nothing, none = ttt_loss(draft, seqs, features, lengths, steps=3, starts=lengths)
    assert float(nothing) == 0 and all(a != a for a in none)  # (no row: nan accuracies)
    for _ in range(30):
        loss, _ = ttt_loss(draft, seqs, features, lengths, steps=3, starts=answers)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        last, accuracy = ttt_loss(draft, seqs, features, lengths, steps=3, starts=answers)
    assert float(last) < 0.5 * float(first)
    assert len(accuracy) == 3 and accuracy[0] > 0.5


def test_a_new_draft_for_a_target_saves_as_a_checkpoint_that_loads_back(tmp_path):
    from radixlm.runtime.models.llama_eagle3 import config_for_target
    from radixlm.runtime.speculative.eagle3_training import new_draft

    _, target = target_pair()
    draft, raw = new_draft(target, seed=0)
    assert raw == config_for_target(target.cfg)
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]  # inputs of 2, 3, 3
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight)
    embedding = target.embed_tokens.weight.clone()
    with torch.no_grad():
        for p in draft.parameters():  # (away from the initial values: a copy must keep them)
            p.add_(0.01 * torch.randn_like(p))
    assert torch.equal(target.embed_tokens.weight, embedding)  # (the target's is not the draft's)
    draft.save(tmp_path / "d", raw)
    back = load_draft(tmp_path / "d", target)
    tokens, features = [4, 9, 15], torch.randn(3, 3 * TARGET_HIDDEN)
    results = []
    for model in (draft, back):
        batch, backend = prefill(model, 1, KV_HEADS, HIDDEN // HEADS, tokens)
        results.append(model(batch, backend, features))
    torch.testing.assert_close(results[1][0], results[0][0])  # logits
    torch.testing.assert_close(results[1][1], results[0][1])  # outputs


def test_training_data_holds_the_targets_features_at_every_position():
    """draft_data.target_features (what EAGLE-3 training reads) and hidden_states (MEDUSA's)
    against transformers, several conversations a forward and one alone."""
    from radixlm.runtime.speculative.draft_data import (
        Conversation,
        hidden_states,
        target_features,
    )

    hf, target = target_pair()
    convs = [Conversation([3, 8, 1], [40, 41, 42, 7]), Conversation([9, 2], [5, 6, 60])]
    layers = (2, 3, 5)
    for budget in (64, 4):  # both in one forward; one a forward
        features = target_features(target, target.cfg, convs, layers, torch.device("cpu"), budget)
        finals = hidden_states(target, target.cfg, convs, torch.device("cpu"), budget)
        for c, got, final in zip(convs, features, finals):
            seq = torch.tensor([c.prompt_ids + c.answer_ids])
            with torch.no_grad():
                states = hf(seq, output_hidden_states=True).hidden_states
            want = torch.cat([states[i][0] for i in layers], dim=-1)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            rows = slice(len(c.prompt_ids) - 1, seq.shape[1] - 1)  # (those that predict the answer)
            torch.testing.assert_close(final, states[-1][0, rows], atol=1e-5, rtol=1e-5)


def test_train_draft_makes_an_eagle3_draft_the_loader_takes(tiny_model_folder, tmp_path):
    import radixlm
    from radixlm.runtime.speculative import training
    from radixlm.runtime.speculative.train_options import TrainDraftOptions

    opts = TrainDraftOptions(
        output=str(tmp_path / "d"), algorithm="EAGLE3", num_heads=2, num_prompts=6,
        max_new_tokens=12, random_prompt_fraction=0.5, held_out_fraction=0.34, batch_size=24,
        steps=8, lr=3e-3, save_every=4, log_every=1,
    )  # fmt: skip
    opts.check()
    engine_kwargs = {"model_path": tiny_model_folder, "device": "cpu", "dtype": "float32"}
    summary = training.train_draft(opts, engine_kwargs, say=lambda _: None)
    log = [json.loads(line) for line in (tmp_path / "d" / training.LOG).read_text().splitlines()]
    losses = [e["loss"] for e in log if "loss" in e]
    assert [e["step"] for e in log if "loss" in e] == list(range(1, 9))
    assert losses[-1] < losses[0]
    held = summary["held_out"]
    assert held["positions"] > 0 and len(held["depth_top1"]) == 2
    # a chain's extra tokens: at least the rows right at depth 0, at most twice them (two deep)
    first = held["depth_top1"][0]
    assert first - 1e-3 <= held["chain_accept_length"] - 1 <= 2 * first + 1e-3
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["training"]["steps"] == 8 and config["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
    with radixlm.Engine(tiny_model_folder, device="cpu", dtype="float32") as engine:
        draft = LlamaEagle3Draft.load(
            tmp_path / "d", engine.model, engine.device, torch.float32, 64
        )
        assert draft.config.target_layers(engine.model.cfg) == (1, 1, 0)  # (a 2-layer target)


def test_a_draft_vocabulary_of_the_answers_most_frequent_tokens(tiny_model_folder, tmp_path):
    """--draft-vocab-size: the draft's LM head has a row for each of the tokens most frequent in
    the training answers (d2t maps them back), its MLP --intermediate-size wide; the engine
    drafts with it, only tokens of that vocabulary, and its greedy outputs stay plain ones."""
    import radixlm
    from radixlm.runtime.speculative import train_common, training
    from radixlm.runtime.speculative.eagle3_training import frequent_tokens
    from radixlm.runtime.speculative.train_options import TrainDraftOptions

    assert frequent_tokens([[5, 3, 5, 9], [3, 5, 7]], 2) == [3, 5]
    assert frequent_tokens([[9, 4]], 3) == [4, 9]  # (ties: the lower id; fewer if fewer occur)
    opts = TrainDraftOptions(
        output=str(tmp_path / "d"), algorithm="EAGLE3", num_heads=2, num_prompts=6,
        max_new_tokens=12, held_out_fraction=0.34, batch_size=24, steps=2,
        draft_vocab_size=20, intermediate_size=16, save_dtype="bfloat16",
    )  # fmt: skip
    opts.check()
    kwargs = {"model_path": tiny_model_folder, "device": "cpu", "dtype": "float32"}
    training.train_draft(opts, kwargs, say=lambda _: None)
    with radixlm.Engine(**kwargs) as engine:
        convs = train_common.conversations(engine, opts, lambda _: None)
        held = train_common.held_out(len(convs), opts.held_out_fraction, opts.seed)
        want = frequent_tokens([c.answer_ids for c, h in zip(convs, held) if not h], 20)
        draft = LlamaEagle3Draft.load(
            tmp_path / "d", engine.model, engine.device, torch.float32, 64
        )
        assert draft.lm_head.weight.shape[0] == len(want) <= 20
        assert draft.target_ids(torch.arange(len(want))).tolist() == want
        assert draft.midlayer.mlp.down_proj.weight.shape[1] == 16
        prompts = [[300 + (j % 7) for j in range(20)], list(range(400, 430))]
        params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
        plain = engine.generate(input_ids=prompts, sampling_params=params)
    with radixlm.Engine(
        **kwargs, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(tmp_path / "d"),
        speculative_adaptive=False,
    ) as engine:  # fmt: skip
        drafter = engine._core.speculative.eagle
        made, own = [], drafter.draft
        drafter.draft = lambda reqs, num: made.append(own(reqs, num)) or made[-1]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert engine._core.speculative.eagle is not None  # (drafting never failed)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    drafted = {t for chains in made for chain in chains for t in chain}
    assert drafted and drafted <= set(want)
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert weights["fc.weight"].dtype == torch.bfloat16 and weights["d2t"].dtype == torch.long
    with pytest.raises(ValueError, match="--draft-vocab-size is for an EAGLE3 draft"):
        TrainDraftOptions(output="x", draft_vocab_size=8).check()


def test_a_resumed_eagle3_run_ends_where_an_unbroken_one_does(tiny_model_folder, tmp_path, monkeypatch):  # fmt: skip
    from safetensors.torch import load_file

    from radixlm.runtime.speculative import eagle3_training, training
    from radixlm.runtime.speculative.train_options import TrainDraftOptions

    def opts(out, **kw):
        return TrainDraftOptions(
            output=str(out), algorithm="EAGLE3", num_heads=2, num_prompts=6, max_new_tokens=10,
            held_out_fraction=0.34, batch_size=24, steps=6, lr=3e-3, save_every=3, log_every=1,
            **kw,
        )  # fmt: skip

    engine_kwargs = {"model_path": tiny_model_folder, "device": "cpu", "dtype": "float32"}
    training.train_draft(opts(tmp_path / "whole"), engine_kwargs, say=lambda _: None)
    real, calls = eagle3_training.ttt_loss, []

    def crash_at_5(*a, **kw):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(eagle3_training, "ttt_loss", crash_at_5)
    with pytest.raises(KeyboardInterrupt):
        training.train_draft(opts(tmp_path / "cut"), engine_kwargs, say=lambda _: None)
    calls.clear()
    monkeypatch.setattr(eagle3_training, "ttt_loss", lambda *a, **kw: calls.append(1) or real(*a, **kw))  # fmt: skip
    training.train_draft(opts(tmp_path / "cut", resume=True), engine_kwargs, say=lambda _: None)
    assert len(calls) == 3  # (steps 4-6: from the checkpoint of step 3)
    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert whole.keys() == cut.keys()
    for name in whole:
        torch.testing.assert_close(cut[name], whole[name], atol=1e-6, rtol=1e-5)
    log = [json.loads(x) for x in (tmp_path / "cut" / training.LOG).read_text().splitlines()]
    assert [e["step"] for e in log if "loss" in e] == [1, 2, 3, 4, 5, 6]


def test_a_draft_for_the_default_model_reads_its_gguf_head_and_embedding(engine):
    """The default model runs its GGUF blocks on the CPU: the draft starts from its LM head
    dequantized, embeds through its block embedding, and its training data comes through."""
    from radixlm.runtime.speculative.eagle3_training import new_draft
    from radixlm.runtime.speculative.medusa import float_lm_head

    target = engine.model
    draft, raw = new_draft(target, seed=0)
    assert raw["hidden_size"] == target.cfg.hidden_size == 576
    torch.testing.assert_close(draft.lm_head.weight, float_lm_head(target.lm_head).float())
    tokens = [1, 2, 3]
    embedded = draft.embed_tokens(torch.tensor(tokens))
    torch.testing.assert_close(embedded, target.embed_tokens(torch.tensor(tokens)))
    # its features for training, through a KV pool of the model's dtype (not its head's bytes)
    from radixlm.runtime.speculative.draft_data import Conversation, target_features

    layers = draft.config.target_layers(target.cfg)
    conv = Conversation([1, 2, 3, 4], [5, 6])
    (got,) = target_features(target, target.cfg, [conv], layers, torch.device("cpu"))
    assert got.shape == (6, 3 * 576) and bool(torch.isfinite(got).all())


def test_train_draft_answers_the_users_own_prompts(tiny_model_folder, tmp_path):
    """--prompts-file: the user's messages (JSON Lines of several shapes, or text) replace the
    built-in prompts, a seeded sample of --num-prompts of them; a line without one is named."""
    import radixlm
    from radixlm.runtime.speculative import train_common
    from radixlm.runtime.speculative.draft_data import read_prompts
    from radixlm.runtime.speculative.train_options import TrainDraftOptions

    records = [
        {"prompt": "alpha one"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "beta two"}]},
        {
            "conversations": [
                {"from": "human", "value": "gamma three"},
                {"from": "gpt", "value": "x"},
            ]
        },
        {"text": "delta four"},
    ]
    lines = [json.dumps(r) for r in records]
    (tmp_path / "p.jsonl").write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")
    want = ["alpha one", "beta two", "gamma three", "delta four"]
    assert read_prompts(str(tmp_path / "p.jsonl")) == want
    (tmp_path / "p.txt").write_text("first line\n\nsecond line\n")
    assert read_prompts(str(tmp_path / "p.txt")) == ["first line", "second line"]
    (tmp_path / "bad.jsonl").write_text(lines[0] + '\n{"messages": [{"role": "assistant"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2: no user message"):
        read_prompts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="cannot be read"):
        read_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="--prompts-file .*missing.jsonl: no such file"):
        TrainDraftOptions(output="x", prompts_file=str(tmp_path / "missing.jsonl")).check()
    opts = TrainDraftOptions(
        output="x", prompts_file=str(tmp_path / "p.jsonl"), num_prompts=3, max_new_tokens=4
    )
    with radixlm.Engine(tiny_model_folder, device="cpu", dtype="float32") as engine:
        convs = train_common.conversations(engine, opts, lambda _: None)
        again = train_common.conversations(engine, opts, lambda _: None)
        texts = [engine.tokenizer.decode(c.prompt_ids) for c in convs]
    asked = [next(p for p in want if p in t) for t in texts]
    assert len(convs) == 3 and len(set(asked)) == 3
    assert [c.prompt_ids for c in again] == [c.prompt_ids for c in convs]
