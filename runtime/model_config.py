"""The model's shape, read from a Hugging Face config, in the few fields the runtime needs.

A config that asks for math the runtime does not do (another activation, biases where it has none,
a rope scaling it lacks, a quantized format it does not read) is refused here, before any weight is
read, rather than run wrongly.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixlm.runtime.quantization.checkpoint import (
    StoredQuantization,
    as_dict,
    read_quantization_config,
)

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # Hugging Face model_type
SUPPORTED_ROPE_SCALING = {  # rope_type -> the keys it needs
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head before rope (Qwen3)
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # attention reaches only this many tokens back (Mistral v0.1, Qwen with use_sliding_window);
    # the runtime attends to everything, which is the same within the window: `context_limit`
    sliding_window: int | None = None
    # what a quantized checkpoint stores (runtime/quantization/checkpoint.py); None: plain weights
    quantization: StoredQuantization | None = None

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model type {model_type!r} is not supported; radixlm runs "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} decoders"
            )
        _check_math(hf, model_type)
        quantization = getattr(hf, "quantization_config", None)
        stored = None
        if quantization:  # read as stored if supported, else refused saying what is
            stored = read_quantization_config(as_dict(quantization), hf.num_hidden_layers)
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope_theta, rope_scaling = _rope_settings(hf)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(hf, model_type),
            quantization=stored,
        )

    @property
    def max_positions(self) -> int:
        """The positions the model is made for: max_position_embeddings, or with YaRN scaling
        the original context times the factor where that is more (Qwen2.5 keeps 32,768 in the
        first and reaches 131,072 by YaRN's factor of 4, as vLLM and SGLang read it)."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") == "yarn":
            scaled = int(
                float(scaling["original_max_position_embeddings"]) * float(scaling["factor"])
            )
            return max(self.max_position_embeddings, scaled)
        return self.max_position_embeddings

    def context_limit(self, requested: int | None) -> int:
        """The context the runtime can serve exactly: `requested` (default the model's
        `max_positions`), capped at a sliding window, past which full attention would differ
        from the model's (refused if asked for explicitly)."""
        limit = self.max_positions
        context = requested or limit
        if (
            requested is not None
            and requested > limit
            and os.environ.get("RADIXLM_ALLOW_LONGER_CONTEXT") != "1"
        ):
            what = (
                "positions" if limit != self.max_position_embeddings else "max_position_embeddings"
            )
            raise ValueError(
                f"context_length={requested} exceeds the model's {what} ({limit}), past which "
                "its output is not to be trusted; ask for at most that (or set "
                "RADIXLM_ALLOW_LONGER_CONTEXT=1 to run it anyway)"
            )
        window = self.sliding_window
        if window is None or context <= window:
            return context
        if requested is not None:
            raise ValueError(
                f"context_length={requested} exceeds the model's sliding attention window of "
                f"{window} tokens, which radixlm does not implement: ask for at most {window}"
            )
        logger.warning(
            "the model attends over a sliding window of %d tokens; the context is capped there "
            "(radixlm attends to every token, which is the same within the window)",
            window,
        )
        return window


def _check_math(hf: Any, model_type: str) -> None:
    """Refuse what the model code would compute differently from the checkpoint's model."""
    act = getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={act!r} is not supported; radixlm's MLP is SiLU-gated")
    if getattr(hf, "mlp_bias", False):
        raise ValueError("mlp_bias=True (biases on the MLP's projections) is not supported")
    if model_type != "qwen2" and getattr(hf, "attention_bias", False):
        raise ValueError(
            "attention_bias=True (biases on q, k, v and o_proj) is not supported for "
            f"{model_type}; Qwen2's q/k/v biases are"
        )


def _sliding_window(hf: Any, model_type: str) -> int | None:
    window = getattr(hf, "sliding_window", None)
    if not window:
        return None
    if model_type == "mistral":
        return int(window)
    layer_types = getattr(hf, "layer_types", None) or []
    if getattr(hf, "use_sliding_window", False) or "sliding_attention" in layer_types:
        return int(window)
    return None


def generation_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """The EOS ids of the folder's generation_config.json, which may list more than config.json
    (Llama-3-Instruct's first release: <|eot_id|> only there)."""
    path = Path(folder) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    if isinstance(eos, list):
        return tuple(e for e in eos if isinstance(e, int) and not isinstance(e, bool))
    return ()


def _rope_settings(hf: Any) -> tuple[float, dict[str, Any] | None]:
    """Newer transformers keep rope settings in `rope_parameters`; older in rope_theta/rope_scaling."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(hf, "rope_theta", 10000.0))
        scaling = dict(getattr(hf, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    needs = SUPPORTED_ROPE_SCALING.get(rope_type)
    if needs is None:
        raise ValueError(
            f"rope scaling {rope_type!r} is not supported yet; supported: default, "
            + ", ".join(SUPPORTED_ROPE_SCALING)
        )
    missing = [k for k in needs if k not in scaling]
    if missing:
        raise ValueError(f"rope scaling {rope_type!r} needs {', '.join(missing)} in the config")
    scaling["rope_type"] = rope_type
    return theta, scaling
