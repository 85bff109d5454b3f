"""The pure helpers the GPU benchmarks report with (benchmarks/common.py), checked on the CPU."""

from benchmarks.common import kernel_breakdown, kernel_group, union_length


def test_union_length_counts_overlaps_once():
    assert union_length([]) == 0.0
    assert union_length([(0.0, 1.0), (2.0, 3.0)]) == 2.0
    # overlapping, nested and out of order
    assert union_length([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (1.5, 1.8)]) == 4.0


def test_kernel_groups_by_name():
    assert kernel_group("_decode_partial_kernel") == "attention, decode rows"
    assert kernel_group("_extend_kernel_0d1d2d") == "attention, prompt rows"
    assert kernel_group("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "matmul (cuBLAS)"
    assert kernel_group("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul (cuBLAS)"
    assert (
        kernel_group("_grouped_gemm_kernel") == "Triton GEMV, INT4 matmul"
    )  # (not cuBLAS's "gemm")
    assert kernel_group("_rope_store_kv_kernel") == "norm, rotary, SiLU, KV store"
    assert kernel_group("_argmax_rows_kernel") == "sampling"
    assert kernel_group("Memcpy HtoD (Pinned -> Device)") == "copies and fills"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4, add>") == "other"


def test_kernel_breakdown_sums_by_group_and_name():
    kernels = [
        ("nvjet_a", 0.0, 3.0),
        ("nvjet_a", 4.0, 5.0),
        ("_decode_partial_kernel", 2.0, 4.0),  # overlaps the first matmul by 1
        ("Memset (Device)", 10.0, 10.5),
    ]
    groups, names, busy = kernel_breakdown(kernels)
    assert groups == {
        "matmul (cuBLAS)": (2, 4.0),
        "attention, decode rows": (1, 2.0),
        "copies and fills": (1, 0.5),
    }
    assert list(groups) == ["matmul (cuBLAS)", "attention, decode rows", "copies and fills"]
    assert names[0] == ("nvjet_a", 2, 4.0)
    assert busy == 5.5


def test_core_profile_reads_py_spys_raw_lines_and_shares_the_core_threads_busy_time(tmp_path):
    from benchmarks.core_profile import read_raw, summarize

    outer = (
        "Thread._bootstrap (threading.py:995);EngineCore._run (radixlm/runtime/engine_core.py:"
        "324);EngineCore._loop (radixlm/runtime/engine_core.py:380)"
    )
    raw = tmp_path / "raw.txt"
    raw.write_text(
        f"thread (12): radixlm-core;{outer};EngineCore._complete (e.py:441);"
        "accept_batch (l.py:606) 30\n"
        f"thread (12): radixlm-core;{outer};EngineCore._complete (e.py:441);"
        "OutputProcessor.deliver (o.py:441) 10\n"
        f"thread (12): radixlm-core;{outer};EngineCore._drain_inbox (e.py:460);"
        "Queue.get (queue.py:171) 60\n"
        "thread (7): MainThread;asyncio.run (runners.py:190) 25\n"
        "thread (9): grammar-compile_3;Thread._bootstrap (threading.py:995) 5\n"
    )
    rows = read_raw(raw)
    assert [(name, n) for name, _, n in rows] == [
        ("radixlm-core", 30), ("radixlm-core", 10), ("radixlm-core", 60), ("MainThread", 25),
        ("grammar-compile", 5),
    ]  # fmt: skip
    text = summarize(rows, top=5)
    assert "radixlm-core 100, MainThread 25, grammar-compile 5" in text
    assert "40 samples busy (60 waiting for work left out)" in text
    assert "100.0%  EngineCore._complete" in text and "75.0%  accept_batch" in text
    assert "Thread._bootstrap" not in text.split("by function")[1]  # (every sample's frames)
    assert " 75.0%  accept_batch:606 < EngineCore._complete:441" in text
