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


@requires_cuda
def test_steady_launch_gives_the_lists_of_the_torch_form():
    """Decode-sized lists come from the kernel compiled once per device and dtype and launched
    without Triton's binding: over growing key counts (every divisibility by 16), both dtypes,
    flat and per-batch lists, finite biases and overflowing rows, and a mask whose key stride is
    not 1 (the ordinary launch), they equal the torch form's lists on the CPU."""
    from sparse_mla.integration.transformers import index_lists as il
    g = torch.Generator().manual_seed(5)
    il._STEADY.clear()
    for dtype in (torch.bfloat16, torch.float32):
        for n in range(150, 190):
            b, s, width = (2, 1, 64) if n % 3 else (1, 2, 48)
            vis = torch.rand(b, s, n, generator=g) < 0.3
            hid = torch.where(torch.rand(b, s, n, generator=g) < 0.5, float("-inf"),
                              torch.finfo(dtype).min)
            m = torch.where(vis, 0.0, hid).to(dtype)
            if n % 7 == 0:
                m[0, 0, n // 2] = -0.25                      # a finite bias: a bad row
            cuda = m.cuda()
            if n % 11 == 0:                                  # key stride 2: ordinary launch
                cuda = torch.stack([cuda, cuda], -1).select(-1, 0)
            for flat in (False, True):
                want = il.visible_index_lists(m, width, flat=flat)
                got = il.visible_index_lists(cuda, width, flat=flat, reuse=True)
                assert all(torch.equal(w, x.cpu()) for w, x in zip(want, got)), (dtype, n, flat)
    assert set(il._STEADY) == {(torch.device("cuda", torch.cuda.current_device()), dt)
                               for dt in (torch.bfloat16, torch.float32)}
