"""The attention function's hot path on a GPU (GPU-only: not in the CPU Bazel target, where it
could only skip; `bash tools/gpu_check.sh` runs it): no host sync in any call, and the kept
index-list buffers give each call its own lists."""
import torch

from sparse_mla.integration.transformers import op_route
from sparse_mla.tests.helpers import requires_cuda
from sparse_mla.tests.integration.transformers.test_hot_path import _calls, _run


@requires_cuda
def test_no_host_sync_in_any_call_on_cuda():
    calls = _calls("cuda")
    op_route.forget()
    for c in calls:
        _run(c)                        # first calls of each kind: the op, Triton compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        op_route.forget()
        for c in calls + calls:        # first calls of each kind (the op), then kept routes
            _run(c)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@requires_cuda
def test_reused_list_buffers_give_fresh_lists_each_call():
    """Decode-sized lists are written into kept buffers: the same buffers for the same shape,
    each call's lists those of its own mask (what a fresh build gives)."""
    from sparse_mla.integration.transformers.index_lists import visible_index_lists
    masks = []
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        m = torch.zeros(1, 1, 40)
        m[torch.rand(1, 1, 40, generator=g) < 0.5] = float("-inf")
        masks.append(m.to(torch.bfloat16).cuda())
    got = []
    for m in masks:
        lists = visible_index_lists(m, 32, flat=True, reuse=True)
        want = visible_index_lists(m, 32, flat=True)
        for a, b in zip(lists, want):
            assert torch.equal(a, b)
        got.append(lists)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(*got))
