"""checks.unit_stride: what the ops hand kernels that take lists by base pointer."""
import torch

from sparse_mla.ops.common.checks import unit_stride
from sparse_mla.tests.helpers import gapped


def test_unit_stride_copies_only_views_with_gaps():
    rows = torch.arange(24, dtype=torch.int32).view(4, 6)
    assert unit_stride(None) is None
    for same in (rows, rows[1:], rows[:, 2:5], rows[:, :1], torch.tensor(3.0)):
        assert unit_stride(same) is same          # unit last stride (or nothing to stride)
    for view in (rows[:, ::2], rows[:, 0], gapped(rows, -7)):
        got = unit_stride(view)
        assert got.stride(-1) == 1 and torch.equal(got, view)
        assert got.data_ptr() != view.data_ptr()
