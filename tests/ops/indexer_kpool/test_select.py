"""kpool_topk_decode / kpool_topk_prefill against a brute-force Python oracle (§13.3-13.4):
ties, poisoned pages, -1 / out-of-range blocks, zero lengths, every tail length, MTP rows."""
import os

import pytest
import torch

from sparse_mla.ops.indexer_kpool import (alloc_cache, kpool_topk_decode, kpool_topk_prefill)
from sparse_mla.ops.indexer_kpool import reference as ref
from sparse_mla.ops.indexer_kpool.format import DIM

KP = 4
BS = 3                                           # odd block size
TOPK = 8                                         # two pools

# the Triton route on CPU only under the interpreter (the BUILD's interpret target)
TRITON = pytest.param("triton", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton needs CUDA or TRITON_INTERPRET=1"))
IMPLS = ["reference", TRITON]


def dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


def oracle(q, w, keys, ok, p, topk=TOPK):
    """One row: keys float64 [P, 128] of its request, ok [P] readable, position p."""
    n_pools = max(0, (p + 1) // KP)
    sc = {j: sum(float(w[h]) * max(0.0, float(q[h].double() @ keys[j]))
                 for h in range(q.shape[0]))
          for j in range(min(n_pools, keys.shape[0])) if ok[j]}
    best = sorted(sc, key=lambda j: (-sc[j], j))[:topk // KP]
    row = []
    for j in best:
        row += [j * KP + o for o in range(KP)]
    row += [-1] * (topk - len(row))
    start = (p + 1) // KP * KP
    row += [start + j if start + j <= p else -1 for j in range(KP - 1)]
    return row


def fill_cache(n_blocks, seed, ties=False):
    gen = torch.Generator().manual_seed(seed)
    cache = alloc_cache(n_blocks, BS, fill=0xFF)          # NaN everywhere not written
    x = torch.randn(n_blocks * BS, DIM, generator=gen).to(torch.bfloat16).float()
    if ties:
        x = x[torch.randint(0, 2, (x.shape[0],), generator=gen)]   # two distinct keys
    vals, scales = ref.quantize_rotated(x)
    page = cache.view(n_blocks, -1)
    page[:, :BS * DIM] = vals.view(n_blocks, -1)
    page[:, BS * DIM:BS * (DIM + 4)] = ref.scale_bytes(scales, "fp32").view(n_blocks, -1)
    return cache, vals.view(torch.float8_e4m3fn).double() * scales.double().unsqueeze(1)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("next_n", [1, 3])
@pytest.mark.parametrize("ties", [False, True])
def test_decode_matches_oracle(next_n, ties, impl):
    gen = torch.Generator().manual_seed(11 + next_n)
    nb, heads = 8, 3
    cache, dense = fill_cache(nb, 1, ties)
    # block 7 is never written (NaN, 0xFF): row 3 maps it only past its causal bound
    cache.view(nb, -1)[nb - 1, :BS * DIM] = 0xFF
    dense[(nb - 1) * BS:nb * BS] = float("nan")
    table = torch.tensor([[0, 1, 2, 3], [4, -1, 5, 99], [6, 2, 1, 0], [3, 3, 7, 7],
                          [5, 4, -1, -1]], dtype=torch.int32)
    seq = torch.tensor([14, 13, 0, 5, 9]) + (next_n - 1)
    seq[2] = 0 if next_n == 1 else 1                      # zero / too short lengths
    b = table.shape[0]
    q = torch.randn(b * next_n, heads, DIM, generator=gen).to(torch.bfloat16)
    w = torch.rand(b * next_n, heads, generator=gen)
    if ties:
        q[:] = q[0]
        w[:] = w[0]
    out = torch.full((b * next_n, TOPK + KP - 1), 77, dtype=torch.int32)
    d = dev() if impl == "triton" else "cpu"
    res = out.to(d)
    kpool_topk_decode(q.to(d), w.to(d), cache.to(d), seq.to(d), table.to(d), res, KP, next_n,
                      impl=impl)
    out = res.cpu()
    for r in range(b):
        ids = table[r].long()
        n = ids.shape[0] * BS
        okb = (ids >= 0) & (ids < nb)
        ok = okb.repeat_interleave(BS)
        keys = torch.zeros(n, DIM, dtype=torch.float64)
        for j in range(n):
            if ok[j]:
                keys[j] = dense[int(ids[j // BS]) * BS + j % BS]
        for i in range(next_n):
            p = int(seq[r]) - next_n + i
            want = oracle(q[r * next_n + i], w[r * next_n + i].double(), keys,
                          ok, max(p, -1))
            assert out[r * next_n + i].tolist() == want, (r, i)


def test_decode_nan_pool_never_candidate_when_future():
    """A poisoned page beyond the causal bound must not leak (scores of future pools are not
    computed into the selection)."""
    cache, _ = fill_cache(2, 4)
    cache.view(2, -1)[1] = 0xFF
    q = torch.randn(1, 2, DIM).to(torch.bfloat16)
    w = torch.ones(1, 2)
    out = torch.empty(1, TOPK + KP - 1, dtype=torch.int32)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    kpool_topk_decode(q, w, cache, torch.tensor([11]), table, out, KP)
    assert sorted(out[0, :TOPK].tolist()) == list(range(8))
    assert out[0, TOPK:].tolist() == [8, 9, 10]


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_matches_oracle(impl):
    gen = torch.Generator().manual_seed(21)
    heads, lens = 2, [13, 1, 7]
    pools = [max(0, n // KP) for n in lens]
    cu_q = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(pools).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(int(cu_k[-1]), DIM, generator=gen).to(torch.bfloat16).float()
    x[1] = x[0]                                            # a tie in request 0
    vals, scales = ref.quantize_rotated(x)
    dense = vals.view(torch.float8_e4m3fn).double() * scales.double().unsqueeze(1)
    pos = torch.cat([torch.arange(n) for n in lens])
    t = pos.shape[0]
    q = torch.randn(t, heads, DIM, generator=gen).to(torch.bfloat16)
    w = torch.rand(t, heads, generator=gen)
    out = torch.empty(t, TOPK + KP - 1, dtype=torch.int32)
    d = dev() if impl == "triton" else "cpu"
    res = out.to(d)
    kpool_topk_prefill(q.to(d), w.to(d), vals.to(d), scales.to(d), cu_q.to(d), cu_k.to(d),
                       pos.to(d), res, KP, chunk=3, impl=impl)
    out = res.cpu()
    for r in range(len(lens)):
        keys = dense[int(cu_k[r]):int(cu_k[r + 1])]
        for i in range(int(cu_q[r]), int(cu_q[r + 1])):
            want = oracle(q[i], w[i].double(), keys, torch.ones(keys.shape[0], dtype=torch.bool),
                          int(pos[i]))
            assert out[i].tolist() == want, (r, i)


@pytest.mark.parametrize("width", [TOPK + KP, TOPK + KP - 2, 3 + KP - 1])
def test_out_width_checked(width):
    cache, _ = fill_cache(2, 4)
    out = torch.empty(1, width, dtype=torch.int32)
    with pytest.raises(ValueError, match="out"):
        kpool_topk_decode(torch.zeros(1, 2, DIM).bfloat16(), torch.ones(1, 2), cache,
                          torch.tensor([5]), torch.tensor([[0]], dtype=torch.int32), out, KP)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("soft_fp8", ["0", "1"])
def test_cuda_decode_matches_cpu(soft_fp8, monkeypatch):
    monkeypatch.setenv("SPARSE_MLA_SOFT_FP8", soft_fp8)
    cache, _ = fill_cache(8, 2)
    table = torch.tensor([[0, 1, 2, 3], [4, -1, 5, 99]], dtype=torch.int32)
    seq = torch.tensor([14, 13])
    q = torch.randn(4, 4, DIM).to(torch.bfloat16)
    w = torch.rand(4, 4)
    want = torch.empty(4, TOPK + KP - 1, dtype=torch.int32)
    kpool_topk_decode(q, w, cache, seq, table, want, KP, 2)
    got = torch.empty_like(want).cuda()
    kpool_topk_decode(q.cuda(), w.cuda(), cache.cuda(), seq.cuda(), table.cuda(), got, KP, 2)
    assert torch.equal(got.cpu(), want)
