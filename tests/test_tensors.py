"""runtime/tensors.py: host lists to tensors, and packed copies whose views Triton sees aligned."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.tensors import int64_tensor, packed_to_device


def test_int64_tensor_equals_torch_tensor():
    values = [3, -1, 2**40, 0, True]
    assert torch.equal(int64_tensor(values), torch.tensor(values, dtype=torch.int64))
    assert int64_tensor([]).shape == (0,)


@pytest.mark.parametrize("lengths", [(1, 1, 1), (3, 0, 5, 2), (7, 7, 7, 2, 1), (0,), (2, 4)])
def test_packed_views_hold_their_lists_and_start_16_byte_aligned(lengths):
    sections = [list(range(10 * k, 10 * k + n)) for k, n in enumerate(lengths)]
    views = packed_to_device(sections, torch.device("cpu"))
    assert [v.tolist() for v in views] == sections
    base = views[0].data_ptr() - views[0].storage_offset() * 8
    for v in views:
        assert (v.data_ptr() - base) % 16 == 0


def test_packed_float32_views_hold_their_lists_and_start_16_byte_aligned():
    sections = [[0.5, 1.0, 0.25], [], [2.0], [0.125] * 5]
    views = packed_to_device(sections, torch.device("cpu"), torch.float32)
    assert [v.tolist() for v in views] == sections and views[0].dtype == torch.float32
    base = views[0].data_ptr() - views[0].storage_offset() * 4
    for v in views:
        assert (v.data_ptr() - base) % 16 == 0
