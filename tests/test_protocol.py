"""The protocol layer's records: the engine's statistics as a typed record and as the mapping
that crosses the engine process's boundary."""

from __future__ import annotations

import msgspec
import pytest

from radixlm.protocol.stats import EngineStats


def test_engine_stats_read_by_attribute_and_as_a_mapping():
    stats = EngineStats(num_running_reqs=3, kv_pool_capacity_tokens=64, spec_verify_ct=5)
    assert stats.num_running_reqs == stats["num_running_reqs"] == 3
    assert stats["spec_verify_ct"] == 5 and "spec_verify_ct" in stats
    # what is off (None) is not in the mapping
    assert stats.spec_accept_rate is None and "spec_accept_rate" not in stats
    with pytest.raises(KeyError):
        stats["spec_accept_rate"]
    assert stats.get("no_such_statistic") is None
    assert dict(stats) == stats.as_dict() and len(stats) == len(stats.as_dict())
    with pytest.raises(AttributeError):  # frozen
        stats.num_running_reqs = 4


def test_engine_stats_cross_the_process_boundary_unchanged():
    stats = EngineStats(
        num_steps=7, cache_hit_rate=0.25, host_seconds_wait=0.5,
        grammar_compile_seconds={"buckets": [0.1], "counts": [1, 0], "sum": 0.05, "count": 1},
    )  # fmt: skip
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.as_dict()))
    assert EngineStats.from_dict(wire) == stats


def test_an_unknown_statistic_is_an_error_naming_it():
    with pytest.raises(ValueError, match="unknown engine statistics \\['num_bananas'\\]"):
        EngineStats.from_dict({"num_steps": 1, "num_bananas": 2})
