"""Both levels of the V4.1 indexer on every route against the brute-force oracle of oracle.py
(vLLM's dense logits, then its masks), decode and prefill.

Exact batches (``oracle.int_case``: logits every route computes exactly, many of them tied
across and inside blocks) must match the oracle to the id, tie rule included; random float
batches may differ only by swaps of scores tied within the route's rounding. Routes: the
reference on CPU; Triton on CUDA and, under TRITON_INTERPRET=1 (the *_interpret_test target),
on CPU.
"""
import pytest
import torch

from sparse_mla.ops.indexer import lightning_indexer_decode
from sparse_mla.ops.indexer_v41 import (lightning_indexer_v41_candidates_decode,
                                        lightning_indexer_v41_candidates_prefill,
                                        lightning_indexer_v41_decode,
                                        lightning_indexer_v41_prefill)
from sparse_mla.tests.helpers import seeded, triton_devices
from sparse_mla.tests.ops.indexer import cases
from sparse_mla.tests.ops.indexer_v41 import oracle

ROUTES = [pytest.param("reference", "cpu", id="reference")] + [
    pytest.param("triton", d, id=f"triton-{d.replace(':', '')}") for d in triton_devices()]
TOL = {"reference": 1e-12, "triton": 1e-4}


def _dev(t, device):
    return None if t is None else t.to(device)


def _decode_both(case, cache, bt, seq_lens, impl, device, *, topk, nb, cb, next_n, bs):
    args = (case.q.to(device), case.w.to(device), cases.to_device(cache, device),
            seq_lens.to(device), bt.to(device))
    out, cand = lightning_indexer_v41_candidates_decode(
        *args, ratio=case.ratio, topk=topk, blocks=nb, next_n=next_n, block_size=bs,
        candidate_block=cb, impl=impl)
    top = lightning_indexer_v41_decode(*args, cand, ratio=case.ratio, topk=topk, next_n=next_n,
                                       block_size=bs, candidate_block=cb, impl=impl)
    return out.cpu(), cand.cpu(), top.cpu()


def _prefill_both(case, impl, device, *, topk, nb, cb, chunk=0):
    args = [_dev(x, device) for x in (case.q, case.w, case.k, case.k_scale, case.cu_q,
                                      case.cu_k, case.positions)]
    out, cand = lightning_indexer_v41_candidates_prefill(
        *args, ratio=case.ratio, topk=topk, blocks=nb, candidate_block=cb, chunk=chunk,
        impl=impl)
    top = lightning_indexer_v41_prefill(*args, cand, ratio=case.ratio, topk=topk,
                                        candidate_block=cb, impl=impl)
    return out.cpu(), cand.cpu(), top.cpu()


def _decode_batch(g, k_lens, next_n, ratio, bs, *, exact, fp8=True, heads=2):
    q_lens = [next_n] * len(k_lens)
    if exact:
        case = oracle.int_case(g, q_lens, k_lens, ratio=ratio, heads=heads, fp8=fp8)
    else:
        case = cases.prefill_case(g, q_lens, k_lens, ratio=ratio, heads=heads, fp8=fp8)
        case.positions = torch.cat([torch.arange(c * ratio - next_n, c * ratio)
                                    for c in k_lens]).clamp_min(0)
    cache, bt = cases.paged(case, g, bs)
    return case, cache, bt, oracle.decode_seq_lens(case, next_n)


@pytest.mark.parametrize("impl,device", ROUTES)
@pytest.mark.parametrize("ratio,bs,cb,next_n", [(1, 3, 8, 1), (2, 5, 8, 3), (2, 4, 3, 2),
                                                (2, 4, 3, 8), (1, 5, 8, 7)],
                         ids=["r1-bs3", "r2-bs5-mtp3", "r2-bs4-cb3-mtp2", "r2-bs4-cb3-mtp8",
                              "r1-bs5-mtp7"])
def test_decode_exact_ties(impl, device, ratio, bs, cb, next_n):
    """Three distinct key rows: logits tie exactly across and inside blocks; every MTP row has
    its own causal length (its own newest block); a request shorter than NB blocks; the
    unused cache rows are NaN (never read)."""
    g = seeded(100 + ratio * 10 + bs)
    case, cache, bt, seq_lens = _decode_batch(g, [45, 9, 30], next_n, ratio, bs, exact=True)
    readable = oracle.readable_fn(bt, cache.shape[0], bs)
    topk, nb = 6, 4
    want_out, want_cand, _ = oracle.level1(case, topk, nb, cb, readable)
    out, cand, top = _decode_both(case, cache, bt, seq_lens, impl, device, topk=topk, nb=nb,
                                  cb=cb, next_n=next_n, bs=bs)
    assert torch.equal(cand, want_cand), (cand, want_cand)
    assert torch.equal(out, want_out)
    want_top, _ = oracle.level2(case, want_cand, topk, cb, readable)
    assert torch.equal(top, want_top), (top, want_top)


@pytest.mark.parametrize("impl,device", ROUTES)
def test_decode_level1_matches_v4_topk_and_pins_newest(impl, device):
    """Level 1's ``out`` is ``indexer_topk_decode``'s (exact logits: the two kernels' sums
    cannot round apart); the newest block leads every row even where its logits are the
    lowest (its keys zero: scores 0, the others' >= 0)."""
    g = seeded(7)
    case, cache, bt, seq_lens = _decode_batch(g, [40, 21], 2, 2, 4, exact=True, fp8=False)
    case.w = case.w.abs()
    for r, c in enumerate([40, 21]):
        for j in range(8 * ((c - 1) // 8), c):
            cases.write_entry(cache, int(bt[r, j // 4]), j % 4, 4, torch.zeros(128,
                              dtype=torch.bfloat16), None)
    args = (case.q.to(device), case.w.to(device), cases.to_device(cache, device),
            seq_lens.to(device), bt.to(device))
    out, cand = lightning_indexer_v41_candidates_decode(*args, ratio=2, topk=8, blocks=2,
                                                        next_n=2, impl=impl)
    v4 = lightning_indexer_decode(*args, topk=8, ratio=2, next_n=2, impl=impl)
    assert torch.equal(out.cpu(), v4.cpu())
    n = (case.positions + 1) // 2
    assert cand[:, 0].cpu().tolist() == ((n - 1) // 8).tolist()
    assert (cand[:, 1] >= 0).all() and (cand[:, 1] != cand[:, 0]).all()


@pytest.mark.parametrize("impl,device", ROUTES)
def test_decode_random_unreadable_blocks(impl, device):
    """Random float logits (rows compared up to rounding ties); block-table cells -1, past
    the cache and past the table make their entries unreadable at both levels (a block with
    no readable entry scores -inf: not listed); a graph-padding request with seq_lens 0."""
    g = seeded(8)
    bs, cb, ratio = 4, 8, 2
    case, cache, bt, seq_lens = _decode_batch(g, [50, 33, 1], 1, ratio, bs, exact=False)
    bt[0, 2] = -1                      # entries 8..11: inside block 1 (8..15)
    bt[0, 4] = -1                      # entries 16..19,
    bt[0, 5] = cache.shape[0] + 3      # 20..23: block 2 has none readable
    bt[1, 7] = 2 ** 30
    seq_lens[2] = 0                    # no causal entry: everything -1
    case.positions[2] = -1
    readable = oracle.readable_fn(bt, cache.shape[0], bs)
    want_out, want_cand, rows = oracle.level1(case, 8, 5, cb, readable)
    out, cand, top = _decode_both(case, cache, bt, seq_lens, impl, device, topk=8, nb=5, cb=cb,
                                  next_n=1, bs=bs)
    assert 2 not in cand[0].tolist()
    oracle.assert_blocks(cand, want_cand, rows, TOL[impl])
    cases.assert_selection(out, want_out, [r[0] for r in rows], [r[1] for r in rows], TOL[impl])
    assert (out[2] == -1).all() and (cand[2] == -1).all() and (top[2] == -1).all()
    want_top, rows2 = oracle.level2(case, cand, 8, cb, readable)
    cases.assert_selection(top, want_top, [r[0] for r in rows2], [r[1] for r in rows2],
                           TOL[impl])


@pytest.mark.parametrize("impl,device", ROUTES)
def test_level2_candidate_lists_as_given(impl, device):
    """Level 2 over hand-made lists: -1 entries, repeats, blocks past the causal range, past
    the table and negative ones add nothing; an empty list (all -1) selects nothing; order
    of the list does not matter."""
    g = seeded(9)
    bs, cb = 5, 8
    case, cache, bt, seq_lens = _decode_batch(g, [40, 40, 40, 40], 1, 1, bs, exact=True)
    cand = torch.tensor([[3, -1, 3, 0, 99],
                         [-1, -1, -1, -1, -1],
                         [4, 2, -7, 2 ** 28, 1],
                         [2, 2, 2, 2, 2]], dtype=torch.int32)
    args = (case.q.to(device), case.w.to(device), cases.to_device(cache, device),
            seq_lens.to(device), bt.to(device))
    top = lightning_indexer_v41_decode(*args, cand.to(device), ratio=1, topk=12, block_size=bs,
                                       candidate_block=cb, impl=impl).cpu()
    readable = oracle.readable_fn(bt, cache.shape[0], bs)
    want, _ = oracle.level2(case, cand, 12, cb, readable)
    assert torch.equal(top, want), (top, want)
    assert (top[1] == -1).all()
    assert sorted(top[3, :8].tolist()) == list(range(16, 24)) and (top[3, 8:] == -1).all()
    flipped = lightning_indexer_v41_decode(*args, cand.flip(1).contiguous().to(device), ratio=1,
                                           topk=12, block_size=bs, candidate_block=cb,
                                           impl=impl).cpu()
    assert torch.equal(flipped, top)


@pytest.mark.parametrize("impl,device", ROUTES)
def test_decode_nan_logit_block_first(impl, device):
    """A NaN logit inside the causal, readable range (the entry's fp32 scale is NaN, which
    every route carries into the score; a NaN e4m3 value may vanish in a ReLU as max(x, 0)):
    its block ranks first, before the pinned +inf block (as torch.topk ranks NaN)."""
    g = seeded(10)
    bs, cb = 4, 8
    case, cache, bt, seq_lens = _decode_batch(g, [40], 1, 1, bs, exact=True)
    j = 13                             # block 1
    cases.write_entry(cache, int(bt[0, j // bs]), j % bs, bs, case.k[j],
                      torch.tensor(float("nan")))
    case.keys[0] = case.keys[0].clone()
    case.keys[0][j] = float("nan")
    readable = oracle.readable_fn(bt, cache.shape[0], bs)
    _, want_cand, _ = oracle.level1(case, 4, 3, cb, readable)
    _, cand, _ = _decode_both(case, cache, bt, seq_lens, impl, device, topk=4, nb=3, cb=cb,
                              next_n=1, bs=bs)
    assert want_cand[0, :2].tolist() == [1, 4]
    assert torch.equal(cand, want_cand), (cand, want_cand)


@pytest.mark.parametrize("impl,device", ROUTES)
@pytest.mark.parametrize("ratio,cb,fp8", [(1, 8, True), (2, 8, False), (2, 5, True)])
def test_prefill_exact_ties(impl, device, ratio, cb, fp8):
    """Ragged prefill: requests with no tokens, no keys, fewer blocks than NB; chunks of 4
    tokens cut across requests; exact ties everywhere."""
    g = seeded(200 + ratio + cb)
    case = oracle.int_case(g, [5, 0, 1, 7, 2], [37, 4, 0, 26, 9], ratio=ratio, fp8=fp8)
    topk, nb = 5, 3
    want_out, want_cand, _ = oracle.level1(case, topk, nb, cb)
    out, cand, top = _prefill_both(case, impl, device, topk=topk, nb=nb, cb=cb, chunk=4)
    assert torch.equal(cand, want_cand), (cand, want_cand)
    assert torch.equal(out, want_out)
    want_top, _ = oracle.level2(case, want_cand, topk, cb)
    assert torch.equal(top, want_top), (top, want_top)


@pytest.mark.parametrize("impl,device", ROUTES)
def test_prefill_random(impl, device):
    """Random float logits, bf16 keys, ratio 2: equal to the oracle up to rounding ties."""
    g = seeded(12)
    case = cases.prefill_case(g, [6, 3], [30, 17], ratio=2, heads=3)
    case.positions = torch.tensor([50, 55, 57, 58, 59, 60, 12, 20, 33])
    out, cand, top = _prefill_both(case, impl, device, topk=7, nb=3, cb=8)
    want_out, want_cand, rows = oracle.level1(case, 7, 3, 8)
    cases.assert_selection(out, want_out, [r[0] for r in rows], [r[1] for r in rows], TOL[impl])
    oracle.assert_blocks(cand, want_cand, rows, TOL[impl])
    want_top, rows2 = oracle.level2(case, cand, 7, 8)
    cases.assert_selection(top, want_top, [r[0] for r in rows2], [r[1] for r in rows2],
                           TOL[impl])


@pytest.mark.parametrize("device", triton_devices() or
                         [pytest.param("cpu", marks=pytest.mark.skip(reason="no Triton route"))])
def test_triton_route_declines_selections_wider_than_select(device):
    """K or NB above triton_select.MAX_K: the Triton route says why and auto takes another;
    within it, Triton runs."""
    from sparse_mla.ops.common import dispatch
    from sparse_mla.ops.indexer import triton_select
    g = seeded(13)
    case, cache, bt, seq_lens = _decode_batch(g, [9], 1, 1, 4, exact=True)
    args = [case.q, case.w, cache, seq_lens, bt]
    args = [cases.to_device(a, device) if a is cache else a.to(device) for a in args]

    def rows(k):
        return torch.empty(1, k, dtype=torch.int32, device=device)
    for out, cand in ((rows(triton_select.MAX_K + 1), rows(4)),
                      (rows(4), rows(triton_select.MAX_K + 1))):
        choice = dispatch.explain("indexer_v41_candidates_decode", *args, out, cand, 1)
        assert choice.impl != "triton"
        assert "at most" in choice.rejected["triton"]
    choice = dispatch.explain("indexer_v41_candidates_decode", *args, rows(4), rows(4), 1)
    assert choice.impl == "triton"
