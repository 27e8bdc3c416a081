"""Prefill and decode top-k of every route against the oracle of cases.py (float64 scores,
selection by (-score, id)): random and adversarial batches.

Routes: the reference on CPU; Triton on CUDA and, under TRITON_INTERPRET=1 (the
*_interpret_test target), on CPU with small tiles. Rows may differ from the oracle's only by
swaps among scores tied within the route's rounding (``cases.assert_selection``); exact ties
(identical keys, all scores zero) must follow the rule exactly.
"""
import pytest
import torch

from sparse_mla.ops.indexer import lightning_indexer_decode, lightning_indexer_prefill, \
    triton_impl
from sparse_mla.tests.helpers import cuda_params, seeded, triton_devices
from sparse_mla.tests.ops.indexer import cases

ROUTES = [pytest.param("reference", "cpu", id="reference")] + [
    pytest.param("triton", d, id=f"triton-{d.replace(':', '')}") for d in triton_devices()]
# float64 in another summation order vs fp32 accumulation over bf16 products
TOL = {"reference": 1e-12, "triton": 1e-4}


def _prefill(case, impl, device, topk, chunk=0, max_seqlen_k=None):
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    return lightning_indexer_prefill(
        dev(case.q), dev(case.w), dev(case.k), dev(case.k_scale), dev(case.cu_q),
        dev(case.cu_k), dev(case.positions), topk=topk, ratio=case.ratio, chunk=chunk,
        max_seqlen_k=max_seqlen_k, impl=impl)


def _check_prefill(case, impl, device, topk, **kw):
    got = _prefill(case, impl, device, topk, **kw)
    want, s, allowed = cases.prefill_oracle(case, topk)
    cases.assert_selection(got, want, s, allowed, TOL[impl])
    return got, want


@pytest.mark.parametrize("impl,device", ROUTES)
@pytest.mark.parametrize("fp8,q_fp8", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("select_max_rows", [2048, 0], ids=["select", "torch_topk"])
def test_prefill_mixed_batch(impl, device, fp8, q_fp8, select_max_rows, monkeypatch):
    """Requests of 5, 1, 0 and 19 tokens over 9, 3, 4 and 37 keys (one with none allowed,
    one token per request short of K), three chunks, tiles spanning requests. Triton: the
    top-k by the select kernel and by ``torch.topk`` (``CONFIG["select_max_rows"]``)."""
    if impl == "reference" and not select_max_rows:
        pytest.skip("a Triton launch option")
    monkeypatch.setitem(triton_impl.CONFIG, "select_max_rows", select_max_rows)
    g = seeded(11 + fp8 + 2 * q_fp8)
    case = cases.prefill_case(g, [5, 1, 0, 19], [9, 3, 4, 37], fp8=fp8, q_fp8=q_fp8)
    _check_prefill(case, impl, device, topk=8, chunk=7)


@pytest.mark.parametrize("impl,device", ROUTES)
def test_prefill_many_requests_some_empty(impl, device):
    """Eleven requests, five without tokens and two without keys: every token's request is
    found from cu_seqlens_q (the Triton kernel bisects it), chunks cut across requests."""
    g = seeded(12)
    case = cases.prefill_case(g, [0, 3, 0, 0, 1, 2, 0, 5, 1, 0, 2],
                              [2, 9, 0, 4, 6, 0, 3, 11, 1, 5, 7], heads=2)
    _check_prefill(case, impl, device, topk=6, chunk=4)


@pytest.mark.parametrize("impl,device", ROUTES)
def test_prefill_positions_decide_the_candidates(impl, device):
    """(p + 1) < ratio: no candidate (all -1); then one more entry every `ratio` tokens, up
    to the request's keys; fewer candidates than K pad with -1."""
    g = seeded(3)
    pos = torch.arange(0, 24)
    case = cases.prefill_case(g, [24], [5], positions=pos, heads=3, ratio=4)
    got, _ = _check_prefill(case, impl, device, topk=4, chunk=5)
    valid = (got >= 0).sum(1).cpu()
    assert valid.tolist() == [min(4, 5, (p + 1) // 4) for p in range(24)]


@pytest.mark.parametrize("impl,device", ROUTES)
def test_prefill_ties_go_to_the_lower_id(impl, device):
    """Every key the same row: every score equal, so the first K ids in order."""
    g = seeded(5)
    case = cases.prefill_case(g, [3, 2], [20, 6], heads=2)
    case.k[:] = case.k[0]
    case.keys = [torch.broadcast_to(case.k[0].double(), kk.shape) for kk in case.keys]
    got, want = _check_prefill(case, impl, device, topk=8)
    assert torch.equal(got.cpu(), want)
    assert got[0].tolist() == list(range(8))


@pytest.mark.parametrize("impl,device", ROUTES)
def test_prefill_all_negative_dots_score_zero(impl, device):
    """q . k < 0 for every pair: ReLU makes every score 0 (+0 or -0 by the weights' signs),
    a tie broken by the lower id."""
    g = seeded(6)
    case = cases.prefill_case(g, [4], [12], heads=3)
    case.q = case.q.abs()
    case.k = -case.k.abs()
    case.keys = [case.k.double()]
    got, want = _check_prefill(case, impl, device, topk=16)
    assert torch.equal(got.cpu(), want)
    assert want[-1, :12].tolist() == list(range(12))


@pytest.mark.parametrize("impl,device", ROUTES)
def test_prefill_without_keys(impl, device):
    g = seeded(7)
    case = cases.prefill_case(g, [3, 2], [0, 0])
    got = _prefill(case, impl, device, 4)
    assert (got == -1).all()


@pytest.mark.parametrize("impl,device", ROUTES)
def test_prefill_chunking_changes_nothing(impl, device):
    g = seeded(8)
    case = cases.prefill_case(g, [9, 4], [13, 30], heads=2)
    outs = [_prefill(case, impl, device, 8, chunk=c, max_seqlen_k=m).cpu()
            for c, m in ((0, None), (1, 30), (4, 40), (64, None))]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def _decode(case, seq_lens, cache, bt, impl, device, topk, next_n, **kw):
    return lightning_indexer_decode(
        case.q.to(device), case.w.to(device), cases.to_device(cache, device), seq_lens.to(device),
        bt.to(device), topk=topk, ratio=case.ratio, next_n=next_n, impl=impl, **kw)


@pytest.mark.parametrize("impl,device", ROUTES)
@pytest.mark.parametrize("fp8,q_fp8", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("next_n,block_size", [(1, 16), (2, 4)])
@pytest.mark.parametrize("heads_n", [False, True], ids=["heads_m", "heads_n"])
def test_decode_over_a_poisoned_paged_cache(impl, device, fp8, q_fp8, next_n, block_size,
                                            heads_n, monkeypatch):
    """Unwritten cache bytes are 0xFF (NaN in both formats) and never chosen; MTP tokens see
    one entry fewer every `ratio` positions back. Triton: both orientations of the decode
    kernel's dot (``CONFIG["decode_heads_n"]``), the top-k by the select kernel (heads_m) and
    by ``torch.topk`` (heads_n)."""
    if impl == "reference" and heads_n:
        pytest.skip("Triton launch options")
    monkeypatch.setitem(triton_impl.CONFIG, "decode_heads_n", heads_n)
    monkeypatch.setitem(triton_impl.CONFIG, "select_max_rows", 0 if heads_n else 2048)
    g = seeded(20 + fp8 + 2 * next_n + 4 * q_fp8)
    case, seq_lens = cases.decode_case(g, [7, 1, 33, 12], next_n=next_n, fp8=fp8,
                                       q_fp8=q_fp8)
    cache, bt = cases.paged(case, g, block_size)
    got = _decode(case, seq_lens, cache, bt, impl, device, 8, next_n)
    want, s, allowed = cases.decode_oracle(case, bt, cache.shape[0], block_size, 8)
    cases.assert_selection(got, want, s, allowed, TOL[impl])


@pytest.mark.parametrize("impl,device", ROUTES)
@pytest.mark.parametrize("next_n", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("token_cols", [128, 32], ids=["one_group", "groups_of_2"])
@pytest.mark.parametrize("heads_n", [False, True], ids=["heads_m", "heads_n"])
def test_decode_long_mtp_drafts(impl, device, next_n, token_cols, heads_n, monkeypatch):
    """Drafts of up to 8 tokens over a poisoned paged cache with -1 table cells: each MTP row
    sees only its own causal prefix (a 1-entry request's first rows see none), ties between
    duplicated keys are broken as the oracle allows. ``decode_token_cols`` 32 (16 padded
    heads) splits a draft into programs of 2 tokens, odd drafts leaving a half-empty group;
    both orientations of the kernel's dot."""
    if impl == "reference" and (token_cols != 128 or heads_n):
        pytest.skip("Triton launch options")
    monkeypatch.setitem(triton_impl.CONFIG, "decode_token_cols", token_cols)
    monkeypatch.setitem(triton_impl.CONFIG, "decode_heads_n", heads_n)
    g = seeded(60 + next_n)
    case, seq_lens = cases.decode_case(g, [1, 9, 26], next_n=next_n, fp8=next_n % 2 == 1)
    case.k[2] = case.k[1]               # a tie: request 1's first two keys
    case.keys[1][1] = case.keys[1][0]
    if case.k_scale is not None:
        case.k_scale[2] = case.k_scale[1]
    cache, bt = cases.paged(case, g, 4)
    got = _decode(case, seq_lens, cache, bt, impl, device, 8, next_n)
    want, s, allowed = cases.decode_oracle(case, bt, cache.shape[0], 4, 8)
    cases.assert_selection(got, want, s, allowed, TOL[impl])
    assert got.shape == (3 * next_n, 8)
    short = got[:next_n]                # request 0: one entry, rows at 7 - next_n .. 6
    for i in range(next_n):
        assert (short[i] >= 0).sum() == (1 if 7 - next_n + i + 1 >= 4 else 0)


def test_decode_token_groups_fit_the_dot():
    """A draft is split so that tokens x padded heads stays within ``decode_token_cols``: 64
    heads take 2 tokens a program, 16 heads all 8, and no group is ever empty."""
    cfg = dict(triton_impl.CONFIG, decode_token_cols=128)
    assert [triton_impl.decode_token_group(n, 64, cfg) for n in (1, 2, 3, 8)] == [1, 2, 2, 2]
    assert [triton_impl.decode_token_group(n, 16, cfg) for n in (1, 5, 8)] == [1, 8, 8]
    assert triton_impl.decode_token_group(8, 256, cfg) == 1


def test_decode_dot_orientation_by_arch(monkeypatch):
    """Heads on the dot's N axis where it was measured faster (sm_90), on M elsewhere (sm_120
    spills with N: test_arch_compile) and on the software e4m3 route (what sm_80 runs, also
    when forced on a Hopper); ``decode_heads_n`` True / False overrides."""
    monkeypatch.setitem(triton_impl.CONFIG, "decode_heads_n", None)
    assert triton_impl.decode_heads_n(90, soft=False)
    assert not triton_impl.decode_heads_n(90, soft=True)
    for arch in (0, 80, 86, 89, 100, 120):
        assert not triton_impl.decode_heads_n(arch, soft=arch < 89)
    for forced in (True, False):
        monkeypatch.setitem(triton_impl.CONFIG, "decode_heads_n", forced)
        assert triton_impl.decode_heads_n(120, soft=False) is forced
        assert triton_impl.decode_heads_n(90, soft=True) is forced


@pytest.mark.parametrize("impl,device", ROUTES)
def test_decode_skips_missing_and_out_of_range_blocks(impl, device):
    g = seeded(30)
    case, seq_lens = cases.decode_case(g, [20, 20], next_n=1, fp8=True)
    cache, bt = cases.paged(case, g, 4)
    bt[0, 1] = -1
    bt[1, 0] = cache.shape[0]
    bt[1, 3] = 1 << 20
    got = _decode(case, seq_lens, cache, bt, impl, device, 24, 1)
    want, s, allowed = cases.decode_oracle(case, bt, cache.shape[0], 4, 24)
    assert (want >= 0).sum(1).tolist() == [16, 12]
    cases.assert_selection(got, want, s, allowed, TOL[impl])


@pytest.mark.parametrize("impl,device", ROUTES)
def test_decode_width_bound_and_short_requests(impl, device):
    """``max_candidates`` bounds the columns; seq_len 0 (a padding request) and seq_len <
    ratio select nothing."""
    g = seeded(31)
    case, seq_lens = cases.decode_case(g, [9, 30, 0], next_n=1)
    seq_lens[2] = 0
    cache, bt = cases.paged(case, g, 8)
    got = _decode(case, seq_lens, cache, bt, impl, device, 8, 1, max_candidates=16)
    want, s, allowed = cases.decode_oracle(case, bt, cache.shape[0], 8, 8, width=16)
    cases.assert_selection(got, want, s, allowed, TOL[impl])
    assert (got[2] == -1).all()


@pytest.mark.parametrize("device", cuda_params())
def test_decode_replays_in_a_cuda_graph(device):
    """Captured once, replayed after the step's lengths and block table change in place:
    the same rows as an eager call on the new metadata (no host sync, no shape change)."""
    g = seeded(50)
    case, seq_lens = cases.decode_case(g, [40, 25], next_n=2, fp8=True)
    cache, bt = cases.paged(case, g, 8)
    dev = lambda t: t.to(device)  # noqa: E731
    q, w, bt, sl = dev(case.q), dev(case.w), dev(bt), dev(seq_lens)
    cache = cases.to_device(cache, device)
    out = torch.full((q.shape[0], 16), 7, dtype=torch.int32, device=device)

    def step():
        lightning_indexer_decode(q, w, cache, sl, bt, topk=16, next_n=2, out=out,
                                 impl="triton")
    step()                              # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    sl.sub_(13)                         # earlier positions: fewer candidates
    bt[1, 0] = -1                       # and one block of request 1 gone
    graph.replay()
    torch.cuda.synchronize()
    want = lightning_indexer_decode(q, w, cache, sl, bt, topk=16, next_n=2, impl="triton")
    assert torch.equal(out, want)
    ref, s, allowed = cases.decode_oracle(
        cases.Case(case.q, case.w, case.keys, case.k, case.k_scale, case.cu_q, case.cu_k,
                   case.positions - 13, case.ratio), bt.cpu(), cache.shape[0], 8, 16)
    cases.assert_selection(out, ref, s, allowed, TOL["triton"])
