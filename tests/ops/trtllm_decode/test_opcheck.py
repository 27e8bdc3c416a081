"""torch.library.opcheck for both ops on CPU tensors; the bench's small cases run and agree."""
import pytest
import torch

from sparse_mla.ops import trtllm_decode as td  # noqa: F401 - registers the ops
from sparse_mla.tests.helpers import seeded
from sparse_mla.tests.ops.trtllm_decode.expect import I32

BF16 = torch.bfloat16


def _dsv4_args(varlen, fp8=False):
    g = seeded(0)
    dt = torch.float8_e4m3fn if fp8 else BF16
    q = torch.randn(3, 4, 512, generator=g).to(dt)
    idx = torch.randint(-1, 128, (3, 132), generator=g, dtype=I32)
    lens = torch.tensor([130, 128, 132], dtype=I32)
    swa = torch.randn(2, 64, 512, generator=g).to(dt)
    cmp = torch.randn(2, 64, 512, generator=g).to(dt)
    out = torch.empty(3, 4, 512, dtype=BF16)
    sinks = torch.randn(4, generator=g)
    if varlen:
        return (q, swa, idx, cmp, lens, torch.tensor([5, 9], dtype=I32), out, 0.05, None, 1.0,
                None, sinks, "HND", torch.tensor([0, 1, 3], dtype=I32), 2, None, "reference")
    return (q.view(3, 1, 4, 512), swa.unsqueeze(1), idx, cmp.unsqueeze(1), lens,
            torch.tensor([5, 9, 1], dtype=I32), out.view(3, 1, 4, 512), 0.05,
            torch.tensor([0.04]), 1.0, torch.tensor([2.0]), None, "HND", None, None, None,
            "reference")


CASES = {
    "dsv4_varlen_bf16": (torch.ops.sparse_mla.trtllm_decode_dsv4, _dsv4_args(True, False)),
    # bf16 only: opcheck's test_schema multiplies inputs, which CPU torch cannot do for e4m3
    # ("mul_cpu_reduced_float" not implemented); fp8 numerics are in test_reference.py.
    "dsv4_dense_tensor_scales": (torch.ops.sparse_mla.trtllm_decode_dsv4,
                                 _dsv4_args(False, False)),
    "v32": (torch.ops.sparse_mla.trtllm_decode_v32,
            (torch.randn(2, 4, 576).to(BF16), torch.randn(2, 32, 576).to(BF16),
             torch.tensor([[0, 5, -1, 7], [1, 2, 3, 63]], dtype=I32),
             torch.tensor([3, 4], dtype=I32), torch.empty(2, 4, 512, dtype=BF16), 0.04, None,
             1.0, None, None, None, None, None, "reference")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    op, args = CASES[name]
    torch.library.opcheck(op, args)


def test_bench_cases_small_run_and_agree():
    from sparse_mla.ops.trtllm_decode import bench
    cs = bench.cases("cpu", small=True)
    assert {c.op for c in cs} == {"trtllm_decode_dsv4"} and len(cs) == 2
    for c in cs:
        a = c.run(c.make(), "reference")
        b = c.run(c.make(), "reference")
        assert c.compare(a, b) == 0 and c.bytes > 0 and c.flops > 0 and c.reference
        assert torch.isfinite(a[0].float()).all() and a[0].float().abs().sum() > 0


def test_bench_full_grid_shapes():
    """The GPU grid: 2 dtypes x (h, compressed) 4 x batch 4, reference only up to 64 tokens."""
    from sparse_mla.ops.trtllm_decode import bench
    cs = bench.cases("cpu", small=False)
    assert len(cs) == 32
    assert sum(c.reference for c in cs) == 16         # batch 1 and 4 (2 and 8 tokens)
    c = next(c for c in cs if c.shape == "bf16 h=128 W=128+1024 B=64 s_q=2")
    assert c.flops == 4 * 128 * 512 * (128 + 1024) * 128
    assert c.bytes == 128 * (1152 * 1024 + 128 * 512 * 2 + 128 * 512 * 2)
