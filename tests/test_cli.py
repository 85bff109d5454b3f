"""The command line: every engine option is documented and parses back into an EngineConfig; bad
options, SGLang's flags among them, are refused before an engine starts; a failed start is one line
and leaves no engine behind."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from radixlm import cli
from radixlm.runtime.config import EngineConfig


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    cli._add_engine_options(p)
    return p


def test_every_engine_option_has_its_own_help_line():
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in cli._ENGINE_HELP]
    assert not missing, f"document these EngineConfig fields in cli._ENGINE_HELP: {missing}"


def test_switches_parse_both_ways():
    args = parser().parse_args(["--no-enable-jump-forward", "--disable-cuda-graph"])
    assert args.enable_jump_forward is False and args.disable_cuda_graph is True
    args = parser().parse_args(["--cuda-graph-max-bs", "64"])
    assert args.cuda_graph_max_bs == 64 and args.enable_jump_forward is None  # None: the default


def parse_serve(*argv: str) -> argparse.Namespace:
    return cli._build_parser().parse_args(["serve", *argv])


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What argparse says when it refuses `radixlm serve ARGV` (it exits with status 2)."""
    with pytest.raises(SystemExit) as exit:
        parse_serve(*argv)
    assert exit.value.code == 2
    return capsys.readouterr().err


def test_a_port_outside_0_to_65535_is_refused_before_the_model_loads(capsys):
    assert "0-65535" in refusal(capsys, "--port", "70000")
    assert "0-65535" in refusal(capsys, "--port", "-1")
    assert "0-65535" in refusal(capsys, "--port", "http")
    assert parse_serve("--port", "0").port == 0 and parse_serve("--port", "65535").port == 65535


def test_an_unknown_device_is_refused_saying_which_are_known():
    for device in ("tpu", "cuda:", "cuda:x", "CUDA", "mps"):
        with pytest.raises(ValueError, match=r"use cpu, cuda or cuda:N"):
            EngineConfig(device=device)
    for device in ("cpu", "cuda", "cuda:0", "cuda:7"):
        assert EngineConfig(device=device).device == device


def test_generate_refuses_an_unknown_device_in_one_line(capsys):
    assert cli.main(["generate", "hi", "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixlm generate: error: EngineConfig: device='tpu'")
    assert err.count("\n") == 1


def test_cuda_without_a_cuda_device_is_a_bad_option_before_the_model_loads(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["generate", "hi", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixlm generate: error: device='cuda', but torch")
    assert "use device='cpu'" in err and err.count("\n") == 1


def test_a_cuda_index_beyond_the_devices_is_a_bad_option(monkeypatch):
    import torch

    import radixlm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"device='cuda:1', but torch sees only 1 CUDA device"):
        radixlm.Engine(device="cuda:1")


def test_an_engine_process_that_fails_to_start_is_reported_in_one_line(monkeypatch, capsys):
    from radixlm.server import engine_process

    def fail_to_start(*args, **kwargs):
        raise RuntimeError("the engine failed to start: out of memory")

    monkeypatch.setattr(engine_process, "EngineProcessBackend", fail_to_start)
    assert cli.main(["serve"]) == 1
    err = capsys.readouterr().err
    assert err == "radixlm serve: error: the engine failed to start: out of memory\n"


@pytest.mark.parametrize("engine_in_process", [False, True])
@pytest.mark.parametrize("failing", ["create_app", "uvicorn.run"])
def test_serve_stops_the_engine_when_the_server_fails_to_start(
    monkeypatch, engine_in_process, failing
):
    import uvicorn

    import radixlm
    from radixlm.server import app, engine_process

    started = []

    class FakeEngine:
        def __init__(self, *args, **kwargs) -> None:
            self.shutdowns = 0
            started.append(self)

        def shutdown(self) -> None:
            self.shutdowns += 1

    def fail(*args, **kwargs):
        raise OverflowError("bind(): port must be 0-65535")

    monkeypatch.setattr(engine_process, "EngineProcessBackend", FakeEngine)
    monkeypatch.setattr(radixlm, "Engine", FakeEngine)
    monkeypatch.setattr(app, "create_app", fail if failing == "create_app" else lambda *a, **k: 0)
    monkeypatch.setattr(uvicorn, "run", fail)
    argv = ["serve", "--engine-in-process"] if engine_in_process else ["serve"]
    with pytest.raises(OverflowError):
        cli.main(argv)
    assert [engine.shutdowns for engine in started] == [1]


def test_python_dash_m_radixlm_is_the_command(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "radixlm", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: radixlm") and "serve" in done.stdout


@pytest.mark.parametrize("flag", ["--tp", "--tp-size", "--tensor-parallel-size"])
def test_tensor_parallel_size_takes_sglang_spellings(flag):
    from radixlm.runtime.config import EngineConfig

    kwargs = cli._engine_kwargs(parse_serve(flag, "2"))
    assert kwargs["tp_size"] == 2
    assert EngineConfig.from_kwargs(None, **kwargs).tp_size == 2


def test_multi_node_options_are_checked():
    from radixlm.runtime.config import EngineConfig

    def config(*argv):
        return EngineConfig.from_kwargs(None, **cli._engine_kwargs(parse_serve(*argv)))

    two = ("--tp-size", "2", "--nnodes", "2")
    assert config(*two, "--node-rank", "1", "--dist-init-addr", "127.0.0.1:5000").node_rank == 1
    with pytest.raises(ValueError, match="nnodes > 1 needs dist_init_addr"):
        config(*two)
    with pytest.raises(ValueError, match="node_rank=2"):
        config(*two, "--node-rank", "2", "--dist-init-addr", "127.0.0.1:5000")
    with pytest.raises(ValueError, match="nnodes=3 must be at least 1 and divide tp_size=2"):
        config("--tp-size", "2", "--nnodes", "3", "--dist-init-addr", "127.0.0.1:5000")
    with pytest.raises(ValueError, match="give host:port"):
        config("--tp-size", "2", "--dist-init-addr", "localhost")


def test_sglang_dtype_names_mean_float16_and_float32():
    from radixlm.runtime.config import EngineConfig

    for name, dtype in (("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")):
        kwargs = cli._engine_kwargs(parse_serve("--dtype", name))
        assert EngineConfig.from_kwargs(None, **kwargs).dtype == dtype  # the CLI and Engine()


def test_log_levels_in_any_case_critical_included():
    assert parse_serve("--log-level", "DEBUG").log_level == "debug"
    assert parse_serve("--log-level", "critical").log_level == "critical"


def test_trust_remote_code_is_accepted_and_changes_no_engine_option():
    args = parse_serve("--trust-remote-code")
    assert args.trust_remote_code is True and cli._engine_kwargs(args) == {}


def test_a_busy_port_is_refused_at_once_naming_the_flag(tmp_path):
    import socket
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "radixlm", "serve", "--port", str(port)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert f"port {port} is in use" in done.stderr
    assert "--port" in done.stderr and 'make serve ARGS="--port ' in done.stderr
    assert done.stderr.count("\n") == 1  # one line, no trace
    assert elapsed < 2.0, f"refused after {elapsed:.1f}s: the model must not load first"


def test_a_host_that_is_not_this_machines_is_refused_naming_the_flag(capsys):
    assert cli.main(["serve", "--host", "192.0.2.1", "--port", "0"]) == 2  # TEST-NET-1
    err = capsys.readouterr().err
    assert "is not an address of this machine" in err and "--host" in err


def test_the_parsers_take_sglangs_names_and_refuse_others(capsys):
    for name in ("hermes", "qwen25", "llama3", "pythonic", "mistral", "deepseekv3", "auto"):
        assert parse_serve("--tool-call-parser", name).tool_call_parser == name
    for name in ("deepseek-r1", "qwen3"):
        assert parse_serve("--reasoning-parser", name).reasoning_parser == name
    args = parse_serve()
    assert args.tool_call_parser is None and args.reasoning_parser is None  # the server's own
    assert "invalid choice: 'gpt4'" in refusal(capsys, "--tool-call-parser", "gpt4")
    assert "invalid choice: 'o1'" in refusal(capsys, "--reasoning-parser", "o1")
