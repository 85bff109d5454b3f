"""Medusa heads (Cai et al., 2024): K small heads over the target model's last hidden state, head i
guessing the token i + 1 places after the one the model itself predicts from that state.

Each head is a stack of residual SiLU blocks (hidden -> hidden, `h + silu(W h + b)`) whose output
goes through the target's own LM head, frozen and shared (Medusa's "Medusa-1" with tied heads):
a head is hidden_size**2 + hidden_size weights per block, a few MB for the default model. The
hidden state is the final norm's output, what the LM head reads. A draft is a chain, the top-1
token of each head; the target verifies it in one forward (runtime/speculative/verify.py), so the
heads change how many tokens a step takes, never which.

A head folder holds `config.json` (Medusa's own names: medusa_num_heads, medusa_num_layers; the
target's hidden_size and vocab_size; how it was trained) and `medusa_heads.safetensors` (keys
`{head}.{block}.linear.weight|bias`, as Medusa's own head files name them, and
`base_model.lm_head_sample`: a few rows of the target's LM head, by which a head folder made for
another model is refused). `radixlm train-draft` writes it; the default model's heads ship in
`draft_heads/` and are found by that sample, without a path.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.quantization.base import scheme_of

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "medusa_heads.safetensors"
SAMPLE_KEY = "base_model.lm_head_sample"
_SAMPLE_ROWS = 16  # LM head rows kept to recognize the target model
# a sample matches when it is this close to the model's rows (bfloat16 rounds at 2**-8)
_SAMPLE_RTOL, _SAMPLE_ATOL = 2e-2, 1e-3


def shipped_heads_dir() -> Path:
    """Where the draft heads that ship with radixlm live (one folder per head)."""
    return Path(__file__).resolve().parents[2] / "draft_heads"


@dataclass(frozen=True)
class MedusaConfig:
    """config.json of a head folder."""

    medusa_num_heads: int
    medusa_num_layers: int
    hidden_size: int
    vocab_size: int
    base_model_name_or_path: str = ""
    architecture: str = "medusa"
    # how the heads were made (radixlm train-draft's recipe and results): informative only
    training: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, folder: Path) -> MedusaConfig:
        path = folder / CONFIG_FILE
        if not path.is_file():
            raise ValueError(
                f"Medusa head folder {str(folder)!r} has no {CONFIG_FILE}; a head folder holds "
                f"{CONFIG_FILE} and {WEIGHTS_FILE}, as `radixlm train-draft` writes them"
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
        if not isinstance(raw, dict) or raw.get("architecture", "medusa") != "medusa":
            raise ValueError(f"{str(path)!r} does not describe Medusa heads (architecture)")
        need = ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size")
        missing = [k for k in need if not isinstance(raw.get(k), int) or raw[k] < 1]
        if missing:
            raise ValueError(f"{str(path)!r} lacks positive integers for {missing}")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def write(self, folder: Path) -> None:
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")


class ResBlock(nn.Module):
    """h + silu(W h + b). W starts at zero (as Medusa's do): an untrained head is the identity,
    so it first guesses what the LM head itself does."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1) -> None:
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)))
            for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor, num: int | None = None) -> torch.Tensor:
        """hidden (N, H) final hidden states -> (N, num, H): the first `num` heads' inputs to
        the LM head."""
        heads = self.heads[: self.num_heads if num is None else num]
        return torch.stack([head(hidden) for head in heads], dim=1)

    def state_dict_medusa(self) -> dict[str, torch.Tensor]:
        """The weights under Medusa's key names: `{head}.{block}.linear.weight`."""
        return {k.removeprefix("heads."): v for k, v in self.state_dict().items()}

    def load_medusa(self, weights: dict[str, torch.Tensor], source: str) -> None:
        want = {k: v.shape for k, v in self.state_dict_medusa().items()}
        missing = sorted(set(want) - set(weights))
        extra = sorted(set(weights) - set(want) - {SAMPLE_KEY})
        if missing or extra:
            raise ValueError(
                f"{source}: the weights do not match config.json's {self.num_heads} heads of "
                f"{self.num_layers} block(s): missing {missing[:4]}, unexpected {extra[:4]}"
            )
        for k, shape in want.items():
            if tuple(weights[k].shape) != tuple(shape):
                raise ValueError(
                    f"{source}: {k} has shape {tuple(weights[k].shape)}, config.json's "
                    f"hidden_size needs {tuple(shape)}"
                )
        self.load_state_dict({f"heads.{k}": v for k, v in weights.items() if k != SAMPLE_KEY})


def float_lm_head(lm_head: nn.Module) -> torch.Tensor:
    """The LM head's weight (V, H) in floats: a quantized head's (GGUF blocks) dequantized."""
    scheme = scheme_of(lm_head)
    return scheme.dequantized_weight(lm_head) if scheme.quantized else lm_head.weight


def lm_head_sample(lm_head_weight: torch.Tensor) -> torch.Tensor:
    """(16, H) float32: evenly spaced rows of an LM head, which identify the model."""
    rows = torch.linspace(0, lm_head_weight.shape[0] - 1, _SAMPLE_ROWS).long()
    return lm_head_weight.detach()[rows.to(lm_head_weight.device)].float().cpu()


def save_heads(
    folder: Path,
    heads: MedusaHeads,
    config: MedusaConfig,
    sample: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write a head folder, the weights in `dtype`; `sample`: `lm_head_sample` of the target's
    LM head (float32)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    weights = {
        k: v.detach().to(dtype).cpu().contiguous() for k, v in heads.state_dict_medusa().items()
    }
    weights[SAMPLE_KEY] = sample.float().cpu().contiguous()
    save_file(weights, str(folder / WEIGHTS_FILE))
    config.write(folder)


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(
            f"Medusa head folder {str(folder)!r} has no {WEIGHTS_FILE} (the heads' weights)"
        )
    try:
        return load_file(str(path))
    except Exception as e:  # (safetensors raises its own error types)
        raise ValueError(f"{str(path)!r} is not a readable safetensors file: {e}") from e


def _fits(sample: torch.Tensor | None, lm_head_weight: torch.Tensor) -> bool:
    if sample is None or sample.shape != (_SAMPLE_ROWS, lm_head_weight.shape[1]):
        return False
    return torch.allclose(sample, lm_head_sample(lm_head_weight), _SAMPLE_RTOL, _SAMPLE_ATOL)


def find_shipped_heads(lm_head_weight: torch.Tensor) -> Path | None:
    """The shipped Medusa head folder made for the model with this LM head, if one is."""
    root = shipped_heads_dir()
    for folder in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        if not (folder / WEIGHTS_FILE).is_file():
            continue
        try:
            config = MedusaConfig.read(folder)
        except ValueError:
            continue
        if config.hidden_size != lm_head_weight.shape[1]:
            continue
        if _fits(_read_weights(folder).get(SAMPLE_KEY), lm_head_weight):
            return folder
    return None


class MedusaDrafter:
    """The heads of a target model, on its device, drafting chains from its hidden states."""

    def __init__(self, heads: MedusaHeads, config: MedusaConfig, lm_head, sampled_vocab: int):
        self.heads, self.config = heads, config
        # (the heads are in the LM head's float dtype: a GGUF head's is float32 on any device)
        self.dtype = next(heads.parameters()).dtype
        self.lm_head = lm_head
        self.sampled_vocab = sampled_vocab  # (ids past it are padding: never drafted)

    @property
    def num_heads(self) -> int:
        return self.config.medusa_num_heads

    @classmethod
    def load(cls, path: str | None, model) -> MedusaDrafter:
        """The heads at `path` (a folder) for `model`, or with no path the shipped heads made for
        it; ValueError saying what is missing or does not fit."""
        lm_head = model.lm_head
        weight = float_lm_head(lm_head)
        cfg = model.cfg
        if weight.shape[0] != cfg.vocab_size:
            raise ValueError(
                "speculative_algorithm=MEDUSA needs the whole LM head on one device; with the "
                "vocabulary split over tensor-parallel ranks it is not available yet"
            )
        if path is None:
            folder = find_shipped_heads(weight)
            if folder is None:
                raise ValueError(
                    "speculative_algorithm=MEDUSA: no Medusa heads ship for this model (they ship "
                    "for the embedded default model); make them with `radixlm train-draft "
                    "--model-path MODEL --output DIR` and pass speculative_draft_model_path=DIR"
                )
        else:
            folder = Path(path).expanduser()
            if not folder.is_dir():
                raise ValueError(
                    f"speculative_draft_model_path={path!r} is not a folder; pass the folder "
                    f"`radixlm train-draft` wrote ({CONFIG_FILE} and {WEIGHTS_FILE})"
                )
        config = MedusaConfig.read(folder)
        where = f"Medusa heads {str(folder)!r}"
        if config.hidden_size != cfg.hidden_size or config.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"{where} were made for a model of hidden_size {config.hidden_size} and "
                f"vocab_size {config.vocab_size}; this model has {cfg.hidden_size} and "
                f"{cfg.vocab_size}: train heads for it with `radixlm train-draft`"
            )
        weights = _read_weights(folder)
        if SAMPLE_KEY not in weights:
            raise ValueError(f"{where}: {WEIGHTS_FILE} lacks {SAMPLE_KEY} (the target's sample)")
        if not _fits(weights[SAMPLE_KEY], weight):
            raise ValueError(
                f"{where} were made for another model ({config.base_model_name_or_path or 'unnamed'}"
                "): its LM head differs from this model's; train heads for this model with "
                "`radixlm train-draft`"
            )
        heads = MedusaHeads(config.hidden_size, config.medusa_num_heads, config.medusa_num_layers)
        heads.load_medusa(weights, where)
        heads = heads.to(device=weight.device, dtype=weight.dtype).eval()
        return cls(heads, config, lm_head, getattr(model, "sampled_vocab", cfg.vocab_size))

    @torch.inference_mode()
    def draft(self, hidden: torch.Tensor, num: int) -> list[list[int]]:
        """hidden (N, H) -> each row's chain of `num` tokens (num <= the heads): the top-1 token of
        heads 1..num, guesses for the tokens after the one the target draws from that row."""
        return [chains[0] for chains in self.draft_candidates(hidden, num, 1)]

    @torch.inference_mode()
    def draft_candidates(self, hidden: torch.Tensor, num: int, width: int) -> list[list[list[int]]]:
        """hidden (N, H) -> for each row, `width` chains of `num` tokens: the first is `draft`'s,
        chain c takes head 1's c-th best token instead, the other heads' top-1 after it (the heads
        guess from the same state, whatever came before)."""
        if hidden.shape[0] == 0 or num <= 0:
            return [[[]] for _ in range(hidden.shape[0])]
        x = self.heads(hidden.to(self.dtype), num).reshape(-1, hidden.shape[-1])  # (N num, H)
        # one matmul for all heads: the LM head's weight is read once (as its scheme reads it)
        logits = scheme_of(self.lm_head).apply(self.lm_head, x)[:, : self.sampled_vocab]
        logits = logits.view(hidden.shape[0], num, -1)
        if width <= 1:
            return [[chain] for chain in logits.argmax(dim=-1).tolist()]
        rest = logits[:, 1:].argmax(dim=-1).tolist()
        firsts = logits[:, 0].topk(width, dim=-1).indices.tolist()
        return [[[f, *r] for f in first] for first, r in zip(firsts, rest)]
