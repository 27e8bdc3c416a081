"""The reference against hand-worked examples (docs/semantics.md §4), plus the same examples through
Triton wherever Triton runs in this process."""
import pytest
import torch

from sparse_mla.ops import index_combine as ic
from sparse_mla.tests.helpers import triton_params

I32 = torch.int32


def _impls():
    out = [("cpu", "reference")]
    for d in triton_params():
        if isinstance(d, str):
            out.append((d, "triton"))
        else:   # a skipped pytest.param: keep its skip mark
            out.append(pytest.param(d.values[0], "triton", marks=d.marks))
    return out


IMPLS = _impls()
P = 12345


def t32(x, device="cpu"):
    return torch.tensor(x, dtype=I32, device=device)


def full(shape, device):
    return torch.full(shape, P, dtype=I32, device=device)


@pytest.mark.parametrize("device,impl", IMPLS)
def test_global_topk_hand(device, impl):
    bt = t32([[3, 7], [5, 0]], device)                     # block_size 4
    topk = t32([[0, 5, -1, 7], [2, -1, -1, -1], [1, -1, -1, -1]], device)
    valid = torch.tensor([True, True, False], device=device)
    out, lens = full((3, 4), device), full((3,), device)
    ic.global_topk_indices_and_lens(topk, t32([0, 1, 0], device), bt, valid, out, lens, 4,
                                    impl=impl)
    # 0 -> 3*4+0, 5 -> 7*4+1, 7 -> 7*4+3; req 1: 2 -> 5*4+2; the invalid token is still
    # converted (as vLLM) but has length 0
    assert out.cpu().tolist() == [[12, 29, -1, 31], [22, -1, -1, -1], [13, -1, -1, -1]]
    assert lens.cpu().tolist() == [3, 1, 0]


@pytest.mark.parametrize("device,impl", IMPLS)
def test_convert_v32_hand(device, impl):
    bt = t32([[3, 7]], device)                              # block_size 4, stride rows 10
    tok = t32([[0, 5, -1, 8], [0, 3, -1, 9]], device)
    out, cnt = full((2, 4), device), full((2,), device)
    ic.convert_req_index_to_global(t32([0, 0], device), bt, tok, out, cnt, t32([-1, 0], device),
                                   t32([100], device), 4, 10, impl=impl)
    # decode row: 0 -> 3*10+0, 5 -> 7*10+1, 8 -> block 2 beyond the table -> -1
    # prefill row: workspace start 100 + tok; 9 -> block 2 beyond the table -> -1 (as vLLM)
    assert out.cpu().tolist() == [[30, 71, -1, -1], [100, 103, -1, -1]]
    assert cnt.cpu().tolist() == [2, 2]
    # vLLM-compatible wrapper without prefill, default stride
    o = ic.triton_convert_req_index_to_global_index(t32([0, 0], device), bt, tok, BLOCK_SIZE=4,
                                                    NUM_TOPK_TOKENS=4, impl=impl)
    assert o.cpu().tolist() == [[12, 29, -1, -1], [12, 15, -1, -1]]


@pytest.mark.parametrize("device,impl", IMPLS)
def test_swa_hand(device, impl):
    # W = 4, block size 2. req 0: seq 6, query 2 (positions 4, 5); req 1: seq 2, query 1 (pos 1)
    qsl, seq = t32([0, 2, 3], device), t32([6, 2], device)
    bt = t32([[9, 4, 6], [3, 0, 0]], device)
    t2r = t32([0, 0, 1, 0], device)
    valid = torch.tensor([True, True, True, False], device=device)
    out, lens = full((4, 4), device), full((4,), device)
    ic.swa_indices_and_lens(qsl, seq, t2r, valid, bt, out, lens, 2, 4, impl=impl)
    # pos 4: positions 1..4 -> 9*2+1, 4*2+0, 4*2+1, 6*2+0; pos 5: 2..5; pos 1: 0..1 of req 1
    assert out.cpu().tolist() == [[19, 8, 9, 12], [8, 9, 12, 13], [6, 7, -1, -1],
                                  [-1, -1, -1, -1]]
    assert lens.cpu().tolist() == [4, 4, 2, 0]
    # token_offset: rows for tokens 2.. only
    out2, lens2 = full((2, 1, 4), device), full((2,), device)
    ic.swa_indices_and_lens(qsl, seq, t2r, valid, bt, out2, lens2, 2, 4, 2, impl=impl)
    assert out2[:, 0].cpu().tolist() == [[6, 7, -1, -1], [-1, -1, -1, -1]]
    assert lens2.cpu().tolist() == [2, 0]


@pytest.mark.parametrize("device,impl", IMPLS)
def test_c128a_hand(device, impl):
    # ratio 4 for a small example, block size 2; tokens 0, 1 decode (0 is graph padding),
    # token 2 prefill
    pos = t32([3, 9, 12], device)
    dec, dl, pre = full((2, 128), device), full((2,), device), full((1, 128), device)
    ic.c128a_indices_and_lens(pos, torch.tensor([-1, 0], device=device), t32([0, 0], device),
                              t32([[5, 1, 8]], device), dec, dl, pre, 2, 4, impl=impl)
    dec, dl, pre = dec.cpu(), dl.cpu(), pre.cpu()
    assert (dec[0] == -1).all() and dl[0] == 0
    assert dec[1, :2].tolist() == [10, 11] and (dec[1, 2:] == -1).all() and dl[1] == 2
    assert pre[0, :3].tolist() == [0, 1, 2] and (pre[0, 3:] == -1).all()
    assert ic.c128a_width(1 << 20) == 8192 and ic.c128a_width(1000) == 128


@pytest.mark.parametrize("device,impl", IMPLS)
def test_combine_spec_worked_example(device, impl):
    """docs/semantics.md §4.4: W=128, ratio=4, top_k=512, pos=1000, query_len = seq_len = 1024 ⇒
    gather_start 0, SWA positions 873..1000 in columns 250..377 = b*M + N + 873 … + 1000,
    topk_len = 250. Here the request is b = 1 of the chunk (b*M offsets)."""
    W, ratio, topk, N, M = 128, 4, 512, 256, 256 + 1024 + 7
    q0 = 5
    qsl = t32([0, q0, q0 + 1024], device) + 40       # not rebased: first element 40
    seq = t32([q0, 1024], device)
    gl = t32([q0, 1024], device)
    T = q0 + 1024
    tk = torch.full((T, topk), -1, dtype=I32)
    tk[3:5, 0] = 0                                     # request 0: positions 3, 4 have 1 entry
    for t in range(q0, T):
        n = min((t - q0 + 1) // ratio, topk)
        tk[t, :n] = torch.arange(n - 1, -1, -1, dtype=I32)   # any order, left-aligned
    out, lens = full((T, 640), device), full((T,), device)
    ic.combine_topk_swa_indices(tk.to(device), qsl, seq, gl, out, lens, W, ratio, topk, M, N,
                                impl=impl)
    row = out[q0 + 1000].cpu()
    assert lens[q0 + 1000] == 250 + 128
    assert row[:250].tolist() == [M + i for i in range(249, -1, -1)]
    assert row[250:378].tolist() == [M + N + p for p in range(873, 1001)]
    assert (row[378:] == -1).all()
    # request 0 (positions 0..4, gather_len 5): window only while pos+1 < ratio
    assert out[0, :2].cpu().tolist() == [N + 0, -1] and lens[0] == 1
    assert lens[4] == 1 + 5 and out[4, :6].cpu().tolist() == [0, N, N + 1, N + 2, N + 3,
                                                                  N + 4]


@pytest.mark.parametrize("device,impl", IMPLS)
def test_combine_hand_small(device, impl):
    # W=4, ratio 2, topk 2; r0: seq 3 query 3; r1: seq 6 query 2 (gather_len 5, start 1);
    # N=3, M=10; query_start_loc starts at 7 (rebased)
    tk = t32([[-1, -1], [0, -1], [0, -1], [1, 0], [2, 1]], device)
    out, lens = full((5, 128), device), full((5,), device)
    ic.combine_topk_swa_indices(tk, t32([7, 10, 12], device), t32([3, 6], device),
                                t32([3, 5], device), out, lens, 4, 2, 2, 10, 3, impl=impl)
    o = out[:, :8].cpu().tolist()
    assert o[0] == [3, -1, -1, -1, -1, -1, -1, -1]
    assert o[1] == [0, 3, 4, -1, -1, -1, -1, -1]
    assert o[2] == [0, 3, 4, 5, -1, -1, -1, -1]
    assert o[3] == [11, 10, 13, 14, 15, 16, -1, -1]
    assert o[4] == [12, 11, 14, 15, 16, 17, -1, -1]
    assert lens.cpu().tolist() == [1, 3, 4, 6, 6]
    assert (out[:, 8:] == -1).all()


@pytest.mark.parametrize("device,impl", IMPLS)
@pytest.mark.parametrize("packed", [False, True])
def test_mixed_hand(device, impl, packed):
    # W=4, SWA and compressed block size 2, ratio 2, topk 3 (width 4 + 4).
    # req 0 decode (seq 3, query 1); req 1 prefill (seq 5, query 2: positions 3, 4)
    swa_bt = t32([[2, 0, 1], [5, 3, 4]], device)
    cbt = t32([[7, 4], [6, 1]], device)
    dswa = t32([[4, 5, 0, -1]], device)
    dcomp = t32([[0, 3, -1]], device)
    ptopk = t32([[1, 0, -1], [2, 1, 0]], device)
    spans = (3, 5) if packed else (None, None)
    si, sl = ic.build_flashinfer_mixed_sparse_indices(
        dswa, dcomp, None, ptopk, t32([0, 1, 3], device), t32([3, 5], device),
        t32([0, 1, 1], device), swa_bt, 2, cbt, 2, 4, 2, 3, True,
        torch.tensor([True], device=device), spans[0], spans[1], impl=impl)
    rows = [[4, 5, 0, -1, 14, 9, -1, -1],
            [10, 11, 6, 7, 13, 12, -1, -1],     # positions 0..3; local 1, 0
            [11, 6, 7, 8, 2, 13, -1, -1]]       # positions 1..4; local 2, 1 (topk_len 2)
    if packed:
        sw = lambda s: -1 if s < 0 else (s // 2) * 3 + s % 2  # noqa: E731
        cp = lambda s: -1 if s < 0 else (s // 2) * 5 + s % 2  # noqa: E731
        rows = [[sw(s) for s in r[:4]] + [cp(s) for s in r[4:]] for r in rows]
    assert si.cpu().tolist() == rows
    assert sl.cpu().tolist() == [6, 6, 6]
    # C128A-style decode (already global), with and without lengths; SWA-only (topk 0)
    si, sl = ic.build_flashinfer_mixed_sparse_indices(
        dswa, dcomp, t32([1], device), ptopk[:, :0], t32([0, 1, 3], device), t32([3, 5], device),
        t32([0, 1, 1], device), swa_bt, 2, cbt, 2, 4, 2, 0, impl=impl)
    assert si[0].cpu().tolist() == [4, 5, 0, -1, 0, 3, -1, -1]
    assert sl.cpu().tolist() == [5, 4, 4]
