"""The one-launch Triton length kernel gives exactly the PyTorch definition's counts."""
import pytest
import torch

from sparse_mla.ops.trtllm_decode import ops
from sparse_mla.tests.helpers import triton_params

I32 = torch.int32


def _varlen(g, B, max_q):
    q_lens = torch.randint(0, max_q + 1, (B,), generator=g)
    cu = torch.zeros(B + 1, dtype=torch.long)
    cu[1:] = q_lens.cumsum(0)
    return cu.to(I32), int(q_lens.max()) if B else 1


CASES = [  # (B, Q, varlen, extra rows beyond the last request)
    (1, 1, False, 0), (3, 2, False, 0), (70, 3, False, 0), (5, 4, True, 0), (130, 2, True, 3),
    (1, 3, True, 2)]


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("B,Q,varlen,extra", CASES)
def test_triton_lengths_equal_torch_definition(device, B, Q, varlen, extra):
    from sparse_mla.ops.trtllm_decode import triton_lengths
    g = torch.Generator().manual_seed(B * 10 + Q)
    topk = 128 + 64
    if varlen:
        cu, Q = _varlen(g, B, Q)
        T = int(cu[-1]) + extra
    else:
        cu, T = None, B * Q
    seq_lens = torch.randint(-2, 300, (B,), generator=g, dtype=I32)   # < q_len and < 0 too
    topk_lens = torch.randint(100, topk + 40, (T,), generator=g, dtype=I32)   # out of range too
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    want = ops._dsv4_lengths(T, B, Q, dev(topk_lens), dev(seq_lens), dev(cu), topk)
    got = triton_lengths.dsv4_lengths(T, B, Q, dev(topk_lens), dev(seq_lens), dev(cu), topk)
    for w, x in zip(want, got):
        assert x.dtype == I32 and torch.equal(x.cpu(), w.cpu())
    want = ops._v32_lengths(T, B, Q, dev(seq_lens), dev(cu), 200)
    got = triton_lengths.v32_lengths(T, B, Q, dev(seq_lens), dev(cu), 200)
    assert torch.equal(got.cpu(), want.cpu())
    assert (want > 0).any()          # the case is not trivially all-zero


@pytest.mark.parametrize("B,Q", [(1, 1), (3, 2), (70, 3)])
def test_dense_batch_sources_count_like_torch_definition(B, Q):
    """A dense batch's key sources carry seq_lens / sparse_topk_lens as they are (the kernels
    derive the counts); ``KeySource.usable`` must give the PyTorch definition's counts,
    out-of-range lens and seq_len < q_len included."""
    g = torch.Generator().manual_seed(7 * B + Q)
    topk, T, H = 128 + 64, B * Q, 1
    seq_lens = torch.randint(-2, 300, (B,), generator=g, dtype=I32)
    topk_lens = torch.randint(100, topk + 40, (T,), generator=g, dtype=I32)
    query = torch.zeros(B, Q, H, 512, dtype=torch.bfloat16)
    pool = torch.zeros(4, 16, 512, dtype=torch.bfloat16)
    idx = torch.zeros(T, topk, dtype=I32)
    out = torch.empty(B, Q, H, 512, dtype=torch.bfloat16)
    _, sources, _ = ops._dsv4_problem(query, pool, idx, pool, topk_lens, seq_lens, out, "HND",
                                      None, None)
    want = ops._dsv4_lengths(T, B, Q, topk_lens, seq_lens, None, topk)
    for src, w in zip(sources, want):
        assert [src.usable(t) for t in range(T)] == w.tolist()
    v32_q = torch.zeros(B, Q, H, 576, dtype=torch.bfloat16)
    _, (src,), _ = ops._v32_problem(v32_q, torch.zeros(4, 16, 576, dtype=torch.bfloat16),
                                    torch.zeros(T, 200, dtype=I32), seq_lens, out, None, None)
    want = ops._v32_lengths(T, B, Q, seq_lens, None, 200)
    assert [src.usable(t) for t in range(T)] == want.tolist()
    assert (want > 0).any()          # the case is not trivially all-zero
