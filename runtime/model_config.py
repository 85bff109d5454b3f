"""The model's shape, read from a Hugging Face config, in the few fields the runtime needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # Hugging Face model_type


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

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model type {model_type!r} is not supported; radixlm runs "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))} decoders"
            )
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
        )


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
    scaling["rope_type"] = rope_type
    return theta, scaling
