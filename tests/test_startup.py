"""What a start says: every step of a first start (converting a GGUF, loading, building) has its
line, the counted ones a line when done; a second start says it reuses the converted folder. On
stderr where logging is not configured (a script, `radixlm generate`), as log records where it is
(`radixlm serve`), and nothing where the `radixlm` logger is set above INFO."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from radixlm.runtime import model_loader, startup
from tests.test_gguf_conversion import tokenizer_fields, weights, write_gguf

__all__ = ["tokenizer_fields", "weights"]  # (fixtures: a tiny Llama and its GGUF tokenizer)

FIRST_START = [
    "loading the engine (torch)",
    "converting tiny.gguf to safetensors in ",
    "reading tiny.gguf (its settings and vocabulary)",
    "building its tokenizer",
    "de-quantizing its ",
    "writing model.safetensors (",
    "converted tiny.gguf in ",
    "loading tiny-",
    "building the model on cpu (float32)",
    "loading weights ...",
    "loading weights: 21 tensors in ",
    "starting the engine core (KV pool: ",
    "engine ready in ",
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, weights, tokenizer_fields):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", weights, tokenizer_fields)


def test_a_first_start_says_every_step_on_stderr_and_a_second_that_it_reuses_the_cache(
    tmp_path, tiny_gguf, caplog
):
    command = [sys.executable, "-m", "radixlm", "generate", "Hi", "--max-new-tokens", "1"]
    command += ["--model-path", str(tiny_gguf), "--max-total-tokens", "256"]
    env = {**os.environ, "RADIXLM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    said = [
        line[len("radixlm: ") :]
        for line in done.stderr.splitlines()
        if line.startswith("radixlm: ")
    ]
    assert len(said) == len(FIRST_START), said
    for line, start in zip(said, FIRST_START):
        assert line.startswith(start), (line, start)

    # a second start (here in-process, where pytest has configured logging): its log records
    import radixlm

    caplog.set_level(logging.INFO, logger="radixlm.startup")
    with radixlm.Engine(str(tiny_gguf), cache_dir=str(tmp_path / "cache"), max_total_tokens=256):
        pass
    records = [r.getMessage() for r in caplog.records if r.name == "radixlm.startup"]
    assert records[0].startswith("using tiny.gguf as converted before, in ")
    assert not any(r.startswith("converting") for r in records)
    assert records[-1].startswith("engine ready in ")


def test_lines_go_to_stderr_without_logging_and_stop_above_info(capsys, monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # as in a script that configured no logging
    startup.say("hello")
    assert list(startup.progress(range(3), 3, "counting", "things")) == [0, 1, 2]
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "radixlm: hello" and err[1] == "radixlm: counting ..."
    assert err[2].startswith("radixlm: counting: 3 things in ")
    monkeypatch.setattr(logging.getLogger("radixlm"), "level", logging.WARNING)
    startup.say("quiet")
    assert capsys.readouterr().err == ""


def test_the_tensor_count_is_what_loading_yields(default_model_folder):
    from pathlib import Path

    folder = Path(default_model_folder)
    assert model_loader.count_safetensors(folder) == 272  # the default model's
    assert model_loader.count_safetensors(folder / "no-such-folder") == 0
