"""Training data for draft heads, made by the target model itself: prompts (a built-in varied set,
messages the model writes itself, or random tokens), the model's own greedy answers under its
chat template (through `radixlm.Engine`), and the final hidden states along each answer (a
teacher-forced forward of prompt + answer).

Heads trained on the model's own outputs learn what it will say, not what some corpus says: the
data is the distribution speculation is verified against (Medusa's self-distillation). The same
seed gives the same prompts, hence (greedy) the same answers and states.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# instruction templates x subjects: the built-in prompts (a seeded sample of the combinations)
_TEMPLATES = (
    "Explain {s} to a curious ten-year-old.",
    "Write a short story about {s}.",
    "Give three interesting facts about {s}.",
    "What are the pros and cons of {s}?",
    "Write a haiku about {s}.",
    "Describe {s} in one paragraph.",
    "Write a Python function related to {s}, with a docstring.",
    "List five questions people often ask about {s}, and answer them briefly.",
    "Write a friendly email inviting a colleague to a talk about {s}.",
    "Summarize the history of {s} in a few sentences.",
    "Give step-by-step instructions for getting started with {s}.",
    "Compare {s} with something similar and explain the differences.",
    "Write a JSON object describing {s} with a name, a category and three tags.",
    "What would a beginner get wrong about {s}?",
    "Write a limerick about {s}.",
    "Give a short definition of {s}, then an example.",
    "Write a product description for a book about {s}.",
    "Tell me a joke about {s}.",
    "Write a dialogue between two friends discussing {s}.",
    "What are the most important ideas behind {s}? Use a numbered list.",
    "Write a tweet announcing a new course on {s}.",
    "How has {s} changed over the last fifty years?",
    "Write a short poem about {s} that rhymes.",
    "Give me a study plan for learning about {s} in one week.",
)
_SUBJECTS = (
    "photosynthesis",
    "the moon",
    "volcanoes",
    "a lost cat",
    "the ocean",
    "black holes",
    "coffee",
    "chess",
    "the internet",
    "recycling",
    "honeybees",
    "the Roman Empire",
    "rainbows",
    "machine learning",
    "bread baking",
    "electric cars",
    "the water cycle",
    "friendship",
    "a rainy day",
    "dinosaurs",
    "gardening",
    "the human heart",
    "jazz music",
    "mountains",
    "sorting algorithms",
    "the French Revolution",
    "solar panels",
    "a robot who learns to paint",
    "time management",
    "penguins",
    "prime numbers",
    "the stock market",
    "a small village",
    "public libraries",
    "climate change",
    "the printing press",
    "video games",
    "sleep",
    "the speed of light",
    "a birthday party",
    "bicycles",
    "earthquakes",
    "democracy",
    "spiders",
    "the violin",
    "Antarctica",
    "vaccines",
    "a dragon",
    "origami",
    "the Olympics",
    "linked lists",
    "deserts",
    "kindness",
    "trains",
    "the solar system",
    "cheese",
    "a haunted house",
    "password security",
    "rivers",
    "space travel",
    "owls",
    "mathematics",
    "the Great Wall of China",
    "tea",
    "a detective",
    "autumn",
    "HTTP",
    "the brain",
    "wind turbines",
    "pizza",
    "a long journey",
    "SQL databases",
    "elephants",
    "snow",
)


def builtin_prompts(n: int, rng: random.Random) -> list[str]:
    """`n` user messages, a seeded sample of the built-in templates and subjects (repeating only
    when `n` exceeds their combinations)."""
    combos = [t.format(s=s) for t in _TEMPLATES for s in _SUBJECTS]
    out: list[str] = []
    while len(out) < n:
        rng.shuffle(combos)
        out.extend(combos[: n - len(out)])
    return out


def read_prompts(path: str) -> list[str]:
    """User messages from a file: JSON Lines whose records hold one as "prompt", "text" or
    "content", or a conversation as "messages" (OpenAI's roles) or "conversations" (ShareGPT's
    from/value) whose first user turn is taken; any other file, one message a line. Blank lines
    are skipped; ValueError naming the line that holds none."""
    import json

    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts-file {path}: cannot be read ({e})") from None
    jsonl = str(path).endswith((".jsonl", ".json"))
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not jsonl:
            out.append(line)
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"--prompts-file {path}, line {number}: not JSON ({e})") from None
        text = _user_message(record) if isinstance(record, dict) else None
        if not text:
            raise ValueError(
                f'--prompts-file {path}, line {number}: no user message (a "prompt", "text" or '
                '"content" string, or "messages" / "conversations" with a user turn)'
            )
        out.append(text)
    if not out:
        raise ValueError(f"--prompts-file {path}: holds no prompt")
    return out


def _user_message(record: dict) -> str | None:
    for key in ("prompt", "text", "content"):
        if isinstance(record.get(key), str):
            return record[key]
    turns = record.get("messages") or record.get("conversations") or []
    for turn in turns if isinstance(turns, list) else []:
        if not isinstance(turn, dict):
            continue
        role = turn.get("role", turn.get("from"))
        text = turn.get("content", turn.get("value"))
        if role in ("user", "human") and isinstance(text, str):
            return text
    return None


# what the model is asked, to write a user message itself ({s}: a built-in subject)
_WRITER_ASKS = (
    "Write a question that someone might ask an AI assistant about {s}. Reply with the "
    "question only.",
    "Write a request that a user might send to a helpful assistant, related to {s}. Reply "
    "with the request only.",
    "Imagine you are chatting with an assistant about {s}. Write your first message to it, "
    "and nothing else.",
    "Write a task for an assistant (writing, explaining, planning or coding) that involves "
    "{s}. Reply with the task only.",
)


def model_prompts(
    engine, n: int, rng: random.Random, max_new_tokens: int = 64, progress=None
) -> list[str]:
    """`n` user messages written by the model itself, asked (under its chat template) for a
    question, request or task about a built-in subject, sampled (temperature 0.8, top-p 0.95,
    a seed from `rng` for each): prompts as varied as what the model can write, unlike any
    template. A message comes out as its first non-empty paragraph, without surrounding
    quotes; one that comes out empty is replaced by a built-in prompt."""
    asks = [rng.choice(_WRITER_ASKS).format(s=rng.choice(_SUBJECTS)) for _ in range(n)]
    seeds = [rng.randrange(2**31) for _ in range(n)]
    outs = _answer(
        engine,
        asks,
        lambda i: {
            "max_new_tokens": max_new_tokens,
            "temperature": 0.8,
            "top_p": 0.95,
            "seed": seeds[i],
        },
        progress,
    )
    messages = [
        _first_paragraph(engine.tokenizer.decode(o["output_ids"], skip_special_tokens=True))
        for o in outs
    ]
    fill = iter(builtin_prompts(sum(not m for m in messages), rng))
    return [m or next(fill) for m in messages]


def _first_paragraph(text: str) -> str:
    for part in text.replace("\r", "").split("\n\n"):
        part = part.strip().strip('"\u201c\u201d').strip()
        if part:
            return part
    return ""


def random_prompts(n: int, rng: random.Random, tokenizer, length: tuple[int, int]) -> list[str]:
    """`n` user messages of random tokens (text decoded from ids drawn uniformly from the
    tokenizer's ordinary tokens): inputs the model never saw, answered in its own words."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    return [
        tokenizer.decode([rng.choice(ids) for _ in range(rng.randint(*length))]) for _ in range(n)
    ]


@dataclass
class Conversation:
    """One training example: the prompt's ids (chat template applied) and the greedy answer's."""

    prompt_ids: list[int]
    answer_ids: list[int]


def generate_answers(
    engine, messages: Sequence[str], max_new_tokens: int, progress=None
) -> list[Conversation]:
    """The engine's greedy answers to `messages` (user messages, under its chat template), all
    submitted at once (continuous batching), `progress(1)` called as each finishes."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    prompts, outs = _answer(engine, messages, lambda i: params, progress, with_prompts=True)
    return [Conversation(p, list(o["output_ids"])) for p, o in zip(prompts, outs)]


def _answer(engine, messages: Sequence[str], params, progress=None, with_prompts=False):
    """The engine's outputs for `messages` (user messages under its chat template), request i
    with sampling parameters `params(i)`, all submitted at once; with `with_prompts`, the
    prompts' ids too."""
    from radixlm.protocol.prompt_tokens import encode_prompt

    prompts = [
        encode_prompt(
            engine.tokenizer, engine.apply_chat_template([{"role": "user", "content": m}])
        )
        for m in messages
    ]

    async def one(i: int, ids: list[int]) -> dict:
        out = await engine.async_generate(input_ids=ids, sampling_params=params(i))
        if progress is not None:
            progress(1)
        return out

    async def run() -> list[dict]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    outs = asyncio.run(run())
    return (prompts, outs) if with_prompts else outs


def hidden_states(
    model,
    model_config,
    conversations: Sequence[Conversation],
    device,
    max_tokens: int = 4096,
    progress=None,
) -> list[torch.Tensor]:
    """For each conversation, the final hidden states (float32, on the CPU) at the positions
    that predict its answer tokens: from the prompt's last token to the answer's second-to-last,
    (len(answer), H) (the row of position p is what the LM head turns into token p + 1). A
    teacher-forced forward of prompt + answer, several conversations a step (up to
    `max_tokens` tokens), through the torch attention backend over a KV pool of its own;
    `progress(n)` is called as each step's n conversations are done."""
    seqs = [c.prompt_ids + c.answer_ids[:-1] for c in conversations]
    keep = [range(len(c.prompt_ids) - 1, len(s)) for c, s in zip(conversations, seqs)]
    return _teacher_forced(model, model_config, seqs, keep, device, max_tokens, (), progress)


def target_features(
    model,
    model_config,
    conversations: Sequence[Conversation],
    aux_layers: tuple[int, ...],
    device,
    max_tokens: int = 4096,
    progress=None,
) -> list[torch.Tensor]:
    """For each conversation, what an EAGLE-3 draft reads from the target at every position of
    prompt + answer: the residual stream entering `aux_layers`, side by side (float32, on the
    CPU, (len(prompt) + len(answer), len(aux_layers) x H)); batched as `hidden_states`."""
    seqs = [c.prompt_ids + c.answer_ids for c in conversations]
    keep = [range(len(s)) for s in seqs]
    return _teacher_forced(
        model, model_config, seqs, keep, device, max_tokens, aux_layers, progress
    )


def _teacher_forced(
    model, model_config, seqs, keep, device, max_tokens, aux_layers, progress
) -> list[torch.Tensor]:
    """Each sequence's rows `keep[i]` of the final hidden states (or, with `aux_layers`, of the
    features entering those layers), several sequences a forward of up to `max_tokens`."""
    from radixlm.runtime.attention import TorchAttentionBackend
    from radixlm.runtime.forward_batch import ForwardBatch
    from radixlm.runtime.memory_pool import KVPool

    mc = model_config
    dtype = model.norm.weight.dtype  # (the model's; a GGUF head's weight is its blocks, bytes)
    budget = max(max_tokens, max(map(len, seqs)))
    pool = KVPool(budget + 1, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, device)
    out: list[torch.Tensor] = []
    group: list[int] = []

    def flush() -> None:
        lens = [len(seqs[i]) for i in group]
        table = torch.zeros((len(group), max(lens)), dtype=torch.int32, device=device)
        rows, start = [], 0
        for j, (i, n) in enumerate(zip(group, lens)):
            table[j, :n] = torch.arange(start + 1, start + n + 1, dtype=torch.int32)
            rows.extend(start + r for r in keep[i])
            start += n
        total = start

        def t(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        lens_t = t(lens)
        batch = ForwardBatch(
            input_ids=t([x for i in group for x in seqs[i]]),
            positions=t([p for n in lens for p in range(n)]),
            out_cache_loc=torch.arange(1, total + 1, device=device),
            req_pool_indices=torch.arange(len(group), device=device),
            prefix_lens=torch.zeros_like(lens_t),
            extend_lens=lens_t,
            seq_lens=lens_t,
            logits_indices=torch.cumsum(lens_t, 0) - 1,  # (one row each: logits are not used)
            extend_lens_cpu=lens,
            prefix_lens_cpu=[0] * len(group),
            num_multi=len(group),
            hidden_indices=t(rows),
            aux_layers=tuple(aux_layers),
        )
        model(batch, TorchAttentionBackend(pool, table))
        kept = batch.aux_hidden_states if aux_layers else batch.hidden_states
        kept = kept.float().cpu()
        at = 0
        for i in group:
            out.append(kept[at : at + len(keep[i])])
            at += len(keep[i])
        if progress is not None:
            progress(len(group))
        group.clear()

    used = 0
    for i, seq in enumerate(seqs):
        if group and used + len(seq) > budget:
            flush()
            used = 0
        group.append(i)
        used += len(seq)
    if group:
        flush()
    return out
