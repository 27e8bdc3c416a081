"""Index lists from additive masks: every visible column, in order, on the mask's device."""
import os
import subprocess
import sys

import pytest
import torch

from sparse_mla.integration.transformers.index_lists import visible_index_lists
from sparse_mla.tests.helpers import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def _random_mask(b, s, n, dtype, device, p_visible=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    visible = torch.rand(b, s, n, generator=g) < p_visible
    hidden = torch.where(torch.rand(b, s, n, generator=g) < 0.5, float("-inf"),
                         torch.finfo(dtype).min)
    return torch.where(visible, 0.0, hidden).to(dtype).to(device), visible


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lists_are_the_visible_columns_in_order(device, dtype):
    mask, visible = _random_mask(3, 17, 41, dtype, device)
    width = int(visible.sum(-1).max())
    idx, lengths, bad = visible_index_lists(mask, width + 3)
    assert idx.shape == (3, 17, width + 3) and idx.dtype == torch.int32
    assert not bad.any()
    for b in range(3):
        for s in range(17):
            want = visible[b, s].nonzero().flatten().tolist()
            assert lengths[b, s] == len(want)
            assert idx[b, s].tolist() == want + [-1] * (width + 3 - len(want))


@pytest.mark.parametrize("device", DEVICES)
def test_flat_lists_offset_each_batch_by_its_keys(device):
    mask, visible = _random_mask(3, 5, 23, torch.bfloat16, device, seed=1)
    idx, lengths, _ = visible_index_lists(mask, 23)
    flat, flat_lengths, _ = visible_index_lists(mask, 23, flat=True)
    offset = torch.arange(3, device=device, dtype=torch.int32).view(3, 1, 1) * 23
    assert torch.equal(flat, torch.where(idx >= 0, idx + offset, -1))
    assert torch.equal(flat_lengths, lengths)


_INTERPRETED = """
import torch
from sparse_mla.integration.transformers import index_lists as il
g = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    # rows wider than a block, overflowing rows, no keys, no queries
    for b, s, n, w in [(3, 17, 41, 20), (2, 5, 2500, 1200), (1, 4, 7, 2), (2, 3, 0, 4),
                       (2, 0, 5, 3)]:
        vis = torch.rand(b, s, n, generator=g) < 0.4
        hid = torch.where(torch.rand(b, s, n, generator=g) < 0.5, float("-inf"),
                          torch.finfo(dtype).min)
        m = torch.where(vis, 0.0, hid).to(dtype)
        if n > 3 and s > 1:
            m[0, 1, 2] = -0.5                                   # a finite bias: bad
        m = m.transpose(0, 1).contiguous().transpose(0, 1)      # strided rows
        for flat in (False, True):
            want = il.visible_index_lists(m, w, flat=flat)      # torch ops on CPU
            got = il._lists_triton(m, w, flat)
            assert all(torch.equal(x, y) for x, y in zip(want, got)), (dtype, b, s, n, w, flat)
print("interpreted lists equal")
"""


@pytest.mark.skipif(CUDA, reason="with a GPU the tests above run the kernel itself (and "
                    "Triton 3.6's interpreter cannot loop over a runtime bound with numpy 2.4)")
def test_triton_lists_equal_the_torch_lists_interpreted():
    """The GPU kernel, run by Triton's interpreter on CPU, against the torch form."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and "interpreted lists equal" in res.stdout, res.stderr[-2000:]


def test_chunked_rows_give_the_same_lists(monkeypatch):
    from sparse_mla.integration.transformers import index_lists
    mask, _ = _random_mask(2, 33, 29, torch.float32, "cpu", seed=3)
    whole = visible_index_lists(mask, 29)
    monkeypatch.setattr(index_lists, "_CHUNK_ELEMENTS", 2 * 29 * 5)   # 5 rows per chunk
    chunked = visible_index_lists(mask, 29)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


def test_overflowing_and_biased_rows_are_flagged():
    mask = torch.full((1, 4, 6), float("-inf"))
    mask[0, 0, :2] = 0            # fits a width of 3
    mask[0, 1, :4] = 0            # 4 visible columns: overflow
    mask[0, 2, 1] = -0.5          # a finite bias the sparse kernels cannot apply
    mask[0, 3, :] = torch.finfo(torch.float32).min   # fully masked: fine, an empty list
    idx, lengths, bad = visible_index_lists(mask, 3)
    assert bad.tolist() == [[False, True, True, False]]
    assert lengths.tolist() == [[2, 3, 0, 0]]
    assert idx[0, 0].tolist() == [0, 1, -1] and idx[0, 3].tolist() == [-1, -1, -1]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="mask must have shape"):
        visible_index_lists(torch.zeros(2, 3), 1)
    with pytest.raises(TypeError, match="additive float mask"):
        visible_index_lists(torch.zeros(1, 2, 3, dtype=torch.bool), 1)
    with pytest.raises(ValueError, match="width must be >= 0"):
        visible_index_lists(torch.zeros(1, 2, 3), -1)
