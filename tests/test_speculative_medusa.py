"""MEDUSA heads without the real model: the drafter's one-matmul chain against a head-by-head
reference, head folders that are missing, broken or made for another model refused saying what
to do, a stale chain never proposed, and `radixlm train-draft` on the tiny random model (its loss
falls, a resumed run continues from its checkpoint and ends where an uninterrupted one does, the
same seed makes the same data)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from radixlm import cli
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.speculative import medusa, training
from radixlm.runtime.speculative.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from radixlm.runtime.speculative.train_options import TrainDraftOptions

H, V = 32, 300


def fake_model(seed: int = 0, hidden: int = H, vocab: int = V, sampled: int | None = None):
    """What the drafter reads of a target: its LM head and config."""
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(vocab, hidden, generator=g))
    cfg = SimpleNamespace(hidden_size=hidden, vocab_size=vocab)
    return SimpleNamespace(lm_head=lm_head, cfg=cfg, sampled_vocab=sampled or vocab)


def trained_looking_heads(num_heads: int, seed: int = 1) -> MedusaHeads:
    """Heads with random (non-zero) blocks, so that each head drafts something of its own."""
    torch.manual_seed(seed)
    heads = MedusaHeads(H, num_heads)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return heads


def write_heads(folder: Path, model, num_heads: int = 3) -> MedusaHeads:
    heads = trained_looking_heads(num_heads)
    config = MedusaConfig(num_heads, 1, H, V, "fake")
    medusa.save_heads(folder, heads, config, medusa.lm_head_sample(model.lm_head.weight))
    return heads


# ---- the drafter ------------------------------------------------------------------------------


def test_the_drafted_chain_is_each_heads_own_top_token(tmp_path):
    model = fake_model(sampled=V - 20)  # the last 20 ids are padding: never drafted
    heads = write_heads(tmp_path, model, num_heads=3)
    drafter = MedusaDrafter.load(str(tmp_path), model)
    hidden = torch.randn(5, H)
    with torch.no_grad():  # the reference: head by head, its block then the LM head, argmax
        ref = [
            [
                int(F.linear(heads.heads[i](h), model.lm_head.weight)[: V - 20].argmax())
                for i in range(3)
            ]
            for h in hidden
        ]
    assert drafter.draft(hidden, 3) == ref
    assert drafter.draft(hidden, 2) == [r[:2] for r in ref]
    assert drafter.draft(hidden[:0], 3) == []


def test_an_untrained_head_guesses_what_the_lm_head_does():
    heads = MedusaHeads(H, 2)
    with torch.no_grad():
        for block in heads.heads:
            block[0].linear.bias.zero_()
        h = torch.randn(4, H)
        assert torch.equal(heads(h), torch.stack([h, h], dim=1))


def test_a_chain_is_proposed_only_for_the_context_it_was_made_for(tmp_path):
    from radixlm.runtime.speculative.worker import SpeculativeWorker

    model = fake_model()
    write_heads(tmp_path, model, num_heads=3)
    config = EngineConfig(
        speculative_algorithm="MEDUSA", speculative_draft_model_path=str(tmp_path)
    )
    worker = SpeculativeWorker(config, model)
    assert worker.num_draft_tokens == 4  # every head drafts
    params = SimpleNamespace(
        has_penalties=False, has_logit_bias=False, min_new_tokens=0, is_greedy=True
    )
    req = SimpleNamespace(
        input_ids=[1, 2, 3], output_ids=[4], params=params, grammar=None, max_output_len=100,
        logprob=SimpleNamespace(return_logprob=False), draft_index=None,
    )  # fmt: skip
    assert worker.propose(req) == []  # nothing drafted yet
    worker.draft_from_hidden(torch.randn(1, H), [req])  # the state after the token sampled now
    assert req.draft_index[0] == 5 and isinstance(req.draft_index[1], torch.Tensor)
    assert worker.propose(req) == []  # that token has not been taken yet
    req.output_ids.append(7)
    chain = worker.propose(req)
    chains = req.draft_index[1]  # the heads ran (one chain: speculative_eagle_topk 1)
    assert len(chains) == 1 and len(chains[0]) == 3 and chain == chains[0]
    assert worker.propose(req) == chain
    req.max_output_len = 4  # room for one draft token and the bonus token
    assert worker.propose(req) == chain[:1]
    req.output_ids.append(8)  # the context moved on (jump-forward, say): the chain is stale
    assert worker.propose(req) == []


def test_the_heads_run_once_for_all_waiting_states_and_only_when_a_draft_is_asked_for(tmp_path):
    """Steps the gate keeps plain hand states over without running the heads; the first draft
    asked for runs them over every request's latest state in one batch."""
    from radixlm.runtime.speculative.worker import SpeculativeWorker

    model = fake_model()
    write_heads(tmp_path, model, num_heads=3)
    config = EngineConfig(
        speculative_algorithm="MEDUSA", speculative_draft_model_path=str(tmp_path)
    )
    worker = SpeculativeWorker(config, model)
    params = SimpleNamespace(
        has_penalties=False, has_logit_bias=False, min_new_tokens=0, is_greedy=True
    )
    reqs = [
        SimpleNamespace(
            input_ids=[1, 2, 3], output_ids=[4 + i], params=params, grammar=None,
            max_output_len=100, logprob=SimpleNamespace(return_logprob=False), draft_index=None,
        )
        for i in range(2)
    ]  # fmt: skip
    batches = []
    real = worker.medusa.draft_candidates

    def counted(hidden, num, width):
        batches.append(hidden.clone())
        return real(hidden, num, width)

    worker.medusa.draft_candidates = counted
    states = [torch.randn(2, H) for _ in range(3)]
    for step, hidden in enumerate(states):  # three plain steps: no heads
        worker.draft_from_hidden(hidden, reqs)
        for r in reqs:  # (the token each state follows, taken)
            r.output_ids.append(10 + step)
    assert batches == []
    drafts = [worker.propose(r) for r in reqs]
    assert len(batches) == 1 and torch.equal(batches[0], states[-1])  # the latest, both at once
    assert drafts == [chains[0] for chains in real(states[-1], 3, 1)]


# ---- loading ----------------------------------------------------------------------------------


def test_heads_that_do_not_fit_are_refused_saying_what_to_do(tmp_path):
    model = fake_model()
    good = tmp_path / "good"
    write_heads(good, model)
    MedusaDrafter.load(str(good), model)  # fits

    with pytest.raises(ValueError, match="is not a folder"):
        MedusaDrafter.load(str(tmp_path / "nowhere"), model)
    with pytest.raises(ValueError, match="made for another model"):
        MedusaDrafter.load(str(good), fake_model(seed=5))
    with pytest.raises(ValueError, match="hidden_size 32 .* this model has 48"):
        MedusaDrafter.load(str(good), fake_model(hidden=48))

    def broken(name: str, change) -> str:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        change(folder)
        return str(folder)

    no_config = broken("no_config", lambda f: (f / "config.json").unlink())
    with pytest.raises(ValueError, match="has no config.json"):
        MedusaDrafter.load(no_config, model)
    no_weights = broken("no_weights", lambda f: (f / medusa.WEIGHTS_FILE).unlink())
    with pytest.raises(ValueError, match="has no medusa_heads.safetensors"):
        MedusaDrafter.load(no_weights, model)
    garbage = broken("garbage", lambda f: (f / medusa.WEIGHTS_FILE).write_bytes(b"\0" * 64))
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        MedusaDrafter.load(garbage, model)

    def more_heads(folder: Path) -> None:
        raw = json.loads((folder / "config.json").read_text())
        raw["medusa_num_heads"] = 5
        (folder / "config.json").write_text(json.dumps(raw))

    with pytest.raises(ValueError, match="do not match config.json's 5 heads"):
        MedusaDrafter.load(broken("more_heads", more_heads), model)
    bad_json = broken("bad_json", lambda f: (f / "config.json").write_text("{"))
    with pytest.raises(ValueError, match="not valid JSON"):
        MedusaDrafter.load(bad_json, model)


def test_too_many_draft_tokens_for_the_heads_are_refused(tmp_path):
    from radixlm.runtime.speculative.worker import SpeculativeWorker

    model = fake_model()
    write_heads(tmp_path, model, num_heads=3)
    config = EngineConfig(
        speculative_algorithm="MEDUSA",
        speculative_draft_model_path=str(tmp_path),
        speculative_num_draft_tokens=6,
    )
    with pytest.raises(ValueError, match="use at most 4"):
        SpeculativeWorker(config, model)


def test_without_a_path_only_the_shipped_heads_of_the_model_are_taken(default_model_folder):
    from safetensors import safe_open

    with safe_open(str(Path(default_model_folder) / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")  # (tied: the LM head)
    folder = medusa.find_shipped_heads(embed)
    assert folder is not None and folder.parent == medusa.shipped_heads_dir()
    assert MedusaConfig.read(folder).hidden_size == embed.shape[1]
    # in bfloat16 (a GPU's weights) it is still recognized
    assert medusa.find_shipped_heads(embed.bfloat16()) == folder
    model = fake_model()
    assert medusa.find_shipped_heads(model.lm_head.weight) is None
    with pytest.raises(ValueError, match="no Medusa heads ship for this model"):
        MedusaDrafter.load(None, model)


@pytest.mark.parametrize(
    "kw, says",
    [
        (
            {"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "x"},
            "NGRAM drafts from the context",
        ),
        (
            {"speculative_draft_model_path": "x"},
            "needs speculative_algorithm MEDUSA, STANDALONE, EAGLE or EAGLE3",
        ),
    ],
)
def test_a_draft_path_needs_medusa(kw, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(**kw)
    config = EngineConfig(speculative_algorithm="medusa")
    assert config.speculative_algorithm == "MEDUSA"
    assert config.speculative_num_draft_tokens is None  # (from the heads, at start-up)


# ---- train-draft ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_folder):
    import radixlm

    with radixlm.Engine(tiny_model_folder, device="cpu", dtype="float32") as eng:
        yield eng


def small(output, **kw) -> TrainDraftOptions:
    base = {
        "output": str(output), "num_heads": 2, "num_prompts": 6, "max_new_tokens": 12,
        "random_prompt_fraction": 0.5, "held_out_fraction": 0.34, "batch_size": 16, "steps": 6,
        "lr": 3e-3, "save_every": 2, "log_every": 1,
    }  # fmt: skip
    return TrainDraftOptions(**{**base, **kw})


def test_the_same_seed_makes_the_same_data(tiny_engine, tmp_path):
    quiet = lambda _: None  # noqa: E731
    a = training.make_data(tiny_engine, small(tmp_path), quiet)
    b = training.make_data(tiny_engine, small(tmp_path), quiet)
    c = training.make_data(tiny_engine, small(tmp_path, seed=1), quiet)
    assert (a.prompts, a.answers, a.held_out) == (b.prompts, b.answers, b.held_out)
    assert torch.equal(a.hidden, b.hidden)
    assert a.prompts != c.prompts and not torch.equal(a.hidden, c.hidden)
    assert a.hidden.shape == (sum(map(len, a.answers)), 64)
    # each position's state is what the LM head turns into the answer's token there
    lm = tiny_engine.model.lm_head.weight.detach()
    _, held = a.split(2)
    train, _ = a.split(2)
    for part in (train, held):
        own = F.linear(part["hidden"], lm).argmax(-1)
        assert (own == part["next"]).float().mean() > 0.95


def test_prompts_the_model_writes_repeat_from_the_seed_and_are_answered(tiny_engine, tmp_path):
    from radixlm.runtime.speculative import draft_data

    def written(seed):
        return draft_data.model_prompts(tiny_engine, 4, random.Random(seed), max_new_tokens=8)

    a, b, c = written(0), written(0), written(1)
    assert a == b and a != c
    assert len(a) == 4 and all(m and m == m.strip() for m in a)
    # its first paragraph, unquoted
    assert draft_data._first_paragraph('\n\n  "How do bees fly?"\n\nMore.') == "How do bees fly?"
    # through the options: a third of the prompts written, the rest built-in and random
    quiet = lambda _: None  # noqa: E731
    opts = small(tmp_path, model_prompt_fraction=0.34, random_prompt_fraction=0.33)
    data = training.make_data(tiny_engine, opts, quiet)
    again = training.make_data(tiny_engine, opts, quiet)
    assert len(data.prompts) == 6 and data.prompts == again.prompts
    assert data.answers == again.answers


def test_training_lowers_the_loss_and_a_resumed_run_ends_where_an_unbroken_one_does(
    tiny_engine, tmp_path, monkeypatch
):
    data = training.make_data(tiny_engine, small(tmp_path), lambda _: None)
    lm_weight = tiny_engine.model.lm_head.weight.detach().float()
    sample = medusa.lm_head_sample(lm_weight)
    args = (data, lm_weight, (64, lm_weight.shape[0]), "tiny", lambda _: None, sample)

    whole = tmp_path / "whole"
    whole.mkdir()
    summary = training._train(small(whole), whole, *args)
    log = [json.loads(line) for line in (whole / training.LOG).read_text().splitlines()]
    losses = [e["loss"] for e in log if "loss" in e]
    assert [e["step"] for e in log if "loss" in e] == [1, 2, 3, 4, 5, 6]
    assert losses[-1] < losses[0]
    assert summary["held_out"]["positions"] > 0

    broken = tmp_path / "broken"
    broken.mkdir()
    real_batch = training._batch

    def crash_at_5(step, *a):
        if step == 4:  # the fifth step: after the checkpoint of step 4
            raise KeyboardInterrupt
        return real_batch(step, *a)

    monkeypatch.setattr(training, "_batch", crash_at_5)
    with pytest.raises(KeyboardInterrupt):
        training._train(small(broken), broken, *args)
    monkeypatch.setattr(training, "_batch", real_batch)
    assert torch.load(broken / training.CHECKPOINT, weights_only=True)["step"] == 4
    assert not (broken / medusa.WEIGHTS_FILE).exists()

    said: list[str] = []
    training._train(small(broken, resume=True), broken, *args[:-2], said.append, sample)
    assert any("resuming from step 4 of 6" in s for s in said)
    resumed = [json.loads(line) for line in (broken / training.LOG).read_text().splitlines()]
    assert resumed == log  # the same curve, step by step, and the same held-out results
    for name in (medusa.WEIGHTS_FILE,):
        from safetensors.torch import load_file

        a, b = load_file(str(whole / name)), load_file(str(broken / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    with pytest.raises(ValueError, match="the checkpoint was made with lr=0.003"):
        training._train(small(broken, resume=True, lr=1e-2), broken, *args)


def test_the_train_draft_command_writes_heads_the_engine_takes(
    tiny_model_folder, tiny_engine, tmp_path
):
    import radixlm

    out = tmp_path / "heads"
    argv = [
        "train-draft", "--output", str(out), "--model-path", tiny_model_folder, "--device", "cpu",
        "--num-heads", "2", "--num-prompts", "4", "--max-new-tokens", "8", "--steps", "2",
        "--batch-size", "8",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    config = MedusaConfig.read(out)
    assert config.medusa_num_heads == 2 and config.training["steps"] == 2
    assert cli.main(argv) == 2  # a checkpoint is there: --resume, or another folder
    with radixlm.Engine(
        tiny_model_folder, device="cpu", speculative_algorithm="MEDUSA",
        speculative_draft_model_path=str(out),
    ) as eng:  # fmt: skip
        plain = {"temperature": 0, "max_new_tokens": 12}
        out_ids = eng.generate("Hello there", plain)["output_ids"]
    assert tiny_engine.generate("Hello there", plain)["output_ids"] == out_ids


def test_bad_train_draft_options_are_refused_before_the_model_loads(tmp_path):
    for argv, says in [
        (["--num-heads", "0"], "--num-heads must be at least 1"),
        (["--algorithm", "NGRAM"], "MEDUSA heads, an EAGLE or an EAGLE3 draft can be trained"),
        (["--held-out-fraction", "1"], "held-out-fraction"),
        (
            ["--random-prompt-fraction", "0.6", "--model-prompt-fraction", "0.6"],
            "add up to more than 1",
        ),
        (["--resume"], "holds no checkpoint.pt"),
    ]:
        with pytest.raises(ValueError, match=says):
            args = cli._build_parser().parse_args(
                ["train-draft", "--output", str(tmp_path / "x"), *argv]
            )
            opts = TrainDraftOptions(
                **{n: getattr(args, n) for n in TrainDraftOptions.__dataclass_fields__}
            )
            opts.check()
            training.train_draft(opts, {"model_path": str(tmp_path / "no-model")})
