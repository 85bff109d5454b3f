"""The command line: every engine option is documented and parses back into an EngineConfig."""

from __future__ import annotations

import argparse
import dataclasses

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
