"""What the one-layer drafts over a target's features share (EAGLE-1/2: runtime/models/
llama_eagle.py; EAGLE-3: llama_eagle3.py): the target's token embedding read through, and their
checkpoints' tensors to and from our fused layers (q, k, v and gate, up apart in a checkpoint, as
in runtime/models/llama.py `STACKED_PARTS`).

A subclass sets `kind` (its name in messages), `config_class` (with `from_folder` and
`target_layers`; `read_config`, `one_layer_model` and `layer_config_for_target` are what the
two kinds' configs share), and says what to do with a checkpoint's tensors besides its layer's
(`_checkpoint_tensor`) and which of its own to save besides them (`_saved_extra`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.model_config import ModelConfig
from radixlm.runtime.models.llama import STACKED_PARTS


def read_config(folder: str | Path, kind: str) -> tuple[dict, str]:
    """(the config.json of a draft checkpoint folder, its path); ValueError saying what is not
    readable. `kind`: the draft's name in the message."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text()), str(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable {kind} draft config ({e})") from None


def one_layer_model(raw: dict, where: str, kind: str) -> ModelConfig:
    """The Llama config of a draft's one decoder layer; ValueError for a draft of more."""
    from types import SimpleNamespace

    layers = raw.get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(
            f"{where}: num_hidden_layers={layers}; radixlm runs {kind} drafts of one decoder "
            "layer (the published ones)"
        )
    return ModelConfig.from_hf(SimpleNamespace(**{"model_type": "llama", **raw}))


def layer_config_for_target(
    target: ModelConfig, architecture: str, intermediate_size: int | None
) -> dict:
    """The config.json keys of a new one-layer draft for `target`: a layer of the target's width
    and heads, its MLP `intermediate_size` wide (default: the target's)."""
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
    }


class OneLayerDraft(nn.Module):
    kind = "draft"
    config_class: type

    def __init__(self) -> None:
        super().__init__()
        # an embedding of the checkpoint's own (a submodule), else the target's (`_shared`, not a
        # submodule: the draft's .to(), parameters() and state_dict() leave it alone)
        self.own_embedding: nn.Embedding | None = None
        self._shared: list[nn.Module] = []
        self._loaded: set[str] = set()  # the checkpoint names load_weights has copied

    @classmethod
    def load(
        cls, folder: str | Path, target: nn.Module, device: torch.device, dtype: torch.dtype,
        max_positions: int,
    ) -> OneLayerDraft:  # fmt: skip
        """The draft in checkpoint folder `folder` (config.json and *.safetensors, else
        *.bin, PyTorch's, read as tensors only) for the target model `target` (a
        LlamaForCausalLM: its config checked, its embedding shared), on `device` in `dtype`;
        ValueError saying what does not fit."""
        from safetensors.torch import load_file

        config = cls.config_class.from_folder(folder)
        config.target_layers(target.cfg)
        files = sorted(Path(folder).glob("*.safetensors"))
        read = lambda f: load_file(str(f))  # noqa: E731
        if not files:  # (the EAGLE authors' releases: pytorch_model.bin)
            files = sorted(Path(folder).glob("*.bin"))
            read = lambda f: torch.load(f, map_location="cpu", weights_only=True)  # noqa: E731
        if not files:
            raise ValueError(
                f"{folder}: no *.safetensors or *.bin file of {cls.kind} draft weights"
            )
        draft = cls(config, max_positions)
        for f in files:  # (every tensor of the layer must come: checked after the last file)
            draft.load_weights(read(f).items(), check=f == files[-1])
        width = target.cfg.hidden_size
        if draft.own_embedding is None and width != config.model.hidden_size:
            raise ValueError(
                f"the {cls.kind} draft's layer is {config.model.hidden_size} wide and carries no "
                f"embedding of its own; the target's embedding is {width} wide"
            )
        draft = draft.to(device, dtype)
        draft.share_target(target)
        draft.rope.build_tables(device)
        return draft

    def share_target(self, target: nn.Module) -> None:
        """Read what the draft takes from the target (its token embedding) through the target's."""
        self.share_embedding(target.embed_tokens)

    def share_embedding(self, embedding: nn.Module) -> None:
        """Read token embeddings through the target's (unless the checkpoint carried its own)."""
        self._shared = [embedding]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: the checkpoint's own, else the target's (`share_embedding`)."""
        if self.own_embedding is not None:
            return self.own_embedding(ids)
        if not self._shared:
            raise RuntimeError(f"the {self.kind} draft needs the target's embedding: share_target")
        return self._shared[0](ids)

    def save(
        self, folder: str | Path, raw_config: dict, dtype: torch.dtype = torch.float32
    ) -> None:
        """Write the checkpoint folder `load` reads (and SGLang's loader of the kind): config.json
        and model.safetensors under the checkpoint's names (q, k, v and gate, up apart; the
        target's embedding left out, an embedding of the checkpoint's own kept), the weights
        in `dtype`."""
        from safetensors.torch import save_file

        out: dict[str, torch.Tensor] = {}
        if self.own_embedding is not None:  # (the checkpoint's own, saved as it came)
            out["embed_tokens.weight"] = self.own_embedding.weight.detach()
        params = dict(self.named_parameters())
        for stored, (name, rows) in self._checkpoint_layout().items():
            p = params[name].detach()
            out[stored] = p if rows is None else p[rows[0] : rows[1]]
        out.update(self._saved_extra())
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.to(dtype).cpu().contiguous() if v.is_floating_point() else v.cpu().contiguous()
                   for k, v in out.items()}  # fmt: skip
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")

    def _saved_extra(self) -> dict[str, torch.Tensor]:
        """Tensors saved besides the layer's parameters."""
        return {}

    def _checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """A checkpoint tensor's name as `_checkpoint_layout` knows it (names with or without
        "model."), or None where this handled it itself (or it is not needed)."""
        return name.removeprefix("model.")

    def load_weights(self, weights, check: bool = True) -> None:
        """Copy a checkpoint's named tensors in, each of the shape the draft's config implies;
        with `check`, every tensor of the layer must have come (in this call or an earlier
        one)."""
        params = dict(self.named_parameters())
        layout = self._checkpoint_layout()
        loaded = self._loaded
        for name, tensor in weights:
            name = self._checkpoint_tensor(name, tensor)
            if name is None:
                continue
            if name not in layout:
                raise ValueError(f"unexpected weight {name!r} in an {self.kind} draft checkpoint")
            target, rows = layout[name]
            param = params[target]
            dest = param if rows is None else param[rows[0] : rows[1]]
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}; the draft's config "
                    f"implies {tuple(dest.shape)}"
                )
            with torch.no_grad():
                dest.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(layout) - loaded)
        if check and missing:
            raise ValueError(f"the {self.kind} draft checkpoint lacks {missing[:5]}")

    def _take_embedding(self, tensor: torch.Tensor) -> None:
        """Keep a checkpoint's own token embedding (read instead of the target's)."""
        self.own_embedding = nn.Embedding(*tensor.shape).to(tensor.dtype)
        self.own_embedding.weight.data.copy_(tensor)

    def _checkpoint_layout(self) -> dict[str, tuple[str, tuple[int, int] | None]]:
        """Each tensor of the layer as the checkpoint names it -> (our parameter, its rows: the
        part of a fused projection, None for a whole one)."""
        layout = {}
        for name, _ in self.named_parameters():
            if name.startswith("own_embedding."):  # (read and written as embed_tokens.weight)
                continue
            parts = [(p, f, i) for p, (f, i) in STACKED_PARTS.items() if f".{f}." in name]
            if not parts:
                layout[name] = (name, None)
            module = self.get_submodule(name.rpartition(".")[0])
            for part, fused, index in parts:
                layout[name.replace(fused, part)] = (name, module.part_rows(index))
        return layout
