from __future__ import annotations

import os

import pytest
import torch


def _import_hub_kernels() -> None:
    """transformers imports Hugging Face's `kernels` distribution (a dependency of it) by that
    top-level name, and the repository root, on sys.path for `tests` and `benchmarks`, holds
    radixlm's own `kernels` package: imported first with the root left out, the distribution's
    is the one that name means from here on (radixlm's own is `radixlm.kernels`)."""
    import importlib
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    hidden = [p for p in sys.path if p in ("", ".", root) or Path(p or ".").resolve() == Path(root)]
    sys.path[:] = [p for p in sys.path if p not in hidden]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # (not installed: nothing to stand in for)
    finally:
        sys.path[:0] = hidden


_import_hub_kernels()

# Triton kernels run on the CPU through the interpreter when there is no GPU; this must be set
# before triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _find_interpreter_builtins_once() -> None:
    """Triton's CPU interpreter, at every kernel launch, walks triton.language's modules and its
    tensor class (inspect.getmembers) for the builtins, wraps each in a new function that calls
    it interpreted, swaps those in, and swaps the originals back after: 17-20% of a test that
    runs a small engine on the Triton backend, by py-spy. What the modules hold does not change
    between launches, so here each is walked and its wrappers made once (by the interpreter's own
    code), then swapped in at every launch as before; the kernels run exactly as they did (the
    padded decode-graph test of test_attention_backends.py ran 3-27% faster with this, in five
    pairs of runs taken in turn). Left alone where the interpreter is off or its internals are
    not those this was written against."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_attr = getattr(interpreter, "_patch_attr", None)
    walk = getattr(interpreter, "_patch_builtin", None)
    if (
        patch_attr is None
        or walk is None
        or list(inspect.signature(walk).parameters) != ["pkg", "builder", "scope"]
        or not callable(getattr(getattr(tl, "core", None), "is_builtin", None))
    ):
        return

    class Wrappers:  # a scope that keeps the wrappers instead of swapping them in
        def __init__(self):
            self.made: list[tuple[str, object]] = []

        def set_attr(self, obj, name, value):
            self.made.append((name, value))

    # (id of the module or class, of the builder) -> (it, held so that its id stays its own;
    # its wrappers)
    found: dict[tuple[int, int], tuple[object, list]] = {}

    def swap_builtins(pkg, builder, scope):
        key = (id(pkg), id(builder))
        known = found.get(key)
        if known is None:  # (the first launch: nothing swapped yet)
            wrappers = Wrappers()
            for name, member in inspect.getmembers(pkg):
                if tl.core.is_builtin(member):
                    patch_attr(pkg, name, member, builder, wrappers)
            known = found[key] = (pkg, wrappers.made)
        for name, wrapper in known[1]:
            scope.set_attr(pkg, name, wrapper)

    interpreter._patch_builtin = swap_builtins


_find_interpreter_builtins_once()

# With pytest-xdist each worker gets its share of the cores (two workers each running torch on
# every core would only take turns).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(4, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(_THREADS)
if _WORKERS > 1:
    # and so do the processes a test starts (servers, engine processes, benchmarks), which would
    # otherwise each take every core while the other workers run
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

# A test that needs one of these runs the real default model, as does one that needs its folder
# other than for the tiny model's tokenizer: marked `real_model` (`make test-fast` skips those).
_REAL_MODEL_FIXTURES = {"engine", "hf_model", "tokenizer"}


# The files that take longest (minutes on two cores), longest first: run first, so that under
# pytest-xdist (each file on one worker) none of them starts last and leaves the other worker idle.
_LONGEST_FIRST = (
    "test_engine_reference.py",
    "test_attention_backends.py",
    "test_server_soak.py",
    "test_radix_engine.py",
    "test_pipeline_parallel.py",
    "test_tensor_parallel.py",
    "test_overlap_schedule.py",
    "test_server_fuzz.py",
    "test_server_process.py",
    "test_server_live.py",
    "test_examples.py",
    "test_engine_api.py",
    "test_speculative_engine.py",
    "test_chat_template_families.py",
    "test_speculative_standalone.py",
    "test_lang.py",
    "test_constrained_engine.py",
    "test_data_parallel.py",
    "test_sglang_client.py",
    "test_startup.py",
)


def pytest_configure(config):
    # pytest-xdist hands out the files in the order above only without its own reordering (by
    # number of tests, on by default), which would leave the long files of few tests for last
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: in-file order kept)
    real_model = pytest.mark.real_model
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & _REAL_MODEL_FIXTURES or (
            "default_model_folder" in names and "tiny_model_folder" not in names
        ):
            item.add_marker(real_model)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def torch_path(monkeypatch):
    """runtime/layers.py's torch code even on CUDA (RADIXLM_DISABLE_FUSED=1): the oracle."""
    monkeypatch.setenv("RADIXLM_DISABLE_FUSED", "1")


@pytest.fixture
def count_launches(monkeypatch) -> list[str]:
    """The names of the kernels/gemv.py entry points called while the test runs, in order."""
    from radixlm.kernels import gemv

    launched: list[str] = []
    for name in ("gemv", "gemv_rms_norm", "gemv_silu_and_mul"):
        real = getattr(gemv, name)
        monkeypatch.setattr(
            gemv,
            name,
            lambda *a, _real=real, _name=name, **kw: launched.append(_name) or _real(*a, **kw),
        )
    return launched


@pytest.fixture(scope="session")
def default_model_folder() -> str:
    """The embedded default model as a Hugging Face folder (converted once from its GGUF)."""
    from radixlm.runtime.config import default_cache_dir
    from radixlm.runtime.model_loader import resolve_model_folder

    return str(resolve_model_folder(None, default_cache_dir()))


@pytest.fixture(scope="session")
def engine(default_model_folder):
    """The real default model with the default settings, shared by the tests that only read."""
    import radixlm

    with radixlm.Engine(default_model_folder) as eng:
        yield eng


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def hf_model(default_model_folder):
    """Hugging Face transformers' own implementation of the same weights: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_folder, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory, default_model_folder) -> str:
    """A tiny random Llama with the default model's tokenizer: for mechanics, not for quality."""
    from benchmarks.common import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), default_model_folder))
