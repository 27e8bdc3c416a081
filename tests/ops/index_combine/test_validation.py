"""Bad inputs raise clear errors (reference path, CPU: value checks on) before anything is
written."""
import pytest
import torch

from sparse_mla.ops import index_combine as ic
from sparse_mla.tests.ops.index_combine.cases import make_batch

I32 = torch.int32
P = 12345


def t32(x):
    return torch.tensor(x, dtype=I32)


def swa_args(**over):
    a = dict(query_start_loc=t32([0, 2, 3]), seq_lens=t32([6, 2]),
             token_to_req_indices=t32([0, 0, 1]),
             is_valid_token=torch.ones(3, dtype=torch.bool),
             block_table=t32([[9, 4, 6], [3, 0, 0]]),
             out_indices=torch.full((3, 4), P, dtype=I32), out_lens=torch.full((3,), P, dtype=I32),
             block_size=2, window_size=4)
    a.update(over)
    return a


@pytest.mark.parametrize("over,exc,msg", [
    (dict(seq_lens=torch.tensor([6, 2])), TypeError, "seq_lens must have dtype int32"),
    (dict(block_table=torch.tensor([[9, 4, 6], [3, 0, 0]])), TypeError,
     "block_table must have dtype int32"),
    (dict(is_valid_token=torch.ones(3, dtype=I32)), TypeError,
     "is_valid_token must have dtype bool"),
    (dict(token_to_req_indices=t32([0, 0])), ValueError,
     "token_to_req_indices must be 1-D with at least 3"),
    (dict(query_start_loc=t32([0, 3])), ValueError, "query_start_loc must have shape [3]"),
    (dict(out_indices=torch.full((3, 5), P, dtype=I32)), ValueError,
     "out_indices must have shape [3, 4]"),
    (dict(seq_lens=t32([6, -1])), ValueError, "seq_lens must be >= 0"),
    (dict(seq_lens=t32([1, 2])), ValueError,
     "seq_lens must be >= the request's query_len: request 0 has seq_len 1 < query_len 2"),
    (dict(query_start_loc=t32([0, 3, 2])), ValueError, "non-decreasing"),
    (dict(block_table=t32([[9, 4], [3, 0]])), ValueError, "too few for position 4 of request 0"),
    (dict(token_to_req_indices=t32([0, 1, 1])), ValueError,
     "mapped by token_to_req_indices to request 1"),
    (dict(block_size=0), ValueError, "block_size"),
])
def test_swa_bad_inputs(over, exc, msg):
    a = swa_args(**over)
    with pytest.raises(exc, match=pytest.importorskip("re").escape(msg)):
        ic.swa_indices_and_lens(**a)
    assert (a["out_indices"] == P).all() and (a["out_lens"] == P).all(), "wrote before raising"


def test_swa_good_inputs_pass():
    a = swa_args()
    ic.swa_indices_and_lens(**a)
    assert a["out_lens"].tolist() == [4, 4, 2]


def test_global_topk_bad_inputs():
    bt = t32([[3, 7]])
    out, lens = torch.full((1, 2), P, dtype=I32), torch.full((1,), P, dtype=I32)
    ok = torch.ones(1, dtype=torch.bool)
    with pytest.raises(TypeError, match="topk_indices must have dtype int32"):
        ic.global_topk_indices_and_lens(torch.zeros(1, 2, dtype=torch.int64), t32([0]), bt, ok,
                                        out, lens, 4)
    with pytest.raises(ValueError, match="too few for top-k index 8 of request 0"):
        ic.global_topk_indices_and_lens(t32([[8, -1]]), t32([0]), bt, ok, out, lens, 4)
    with pytest.raises(ValueError, match="is not a request id"):
        ic.global_topk_indices_and_lens(t32([[1, -1]]), t32([1]), bt, ok, out, lens, 4)
    with pytest.raises(ValueError, match=r"out_lens must have shape \[1\]"):
        ic.global_topk_indices_and_lens(t32([[1, -1]]), t32([0]), bt, ok, out, lens[:0], 4)
    assert (out == P).all() and (lens == P).all()
    # the same junk on a graph-padding token is fine (stale persistent buffers)
    ic.global_topk_indices_and_lens(t32([[8, -1]]), t32([5]), bt, ~ok, out, lens, 4)
    assert out.tolist() == [[-1, -1]] and lens.tolist() == [0]


def test_convert_bad_inputs():
    bt, tok = t32([[3, 7]]), t32([[0, 1]])
    out = torch.full((1, 2), P, dtype=I32)
    with pytest.raises(ValueError, match="given together"):
        ic.convert_req_index_to_global(t32([0]), bt, tok, out, None, t32([0]), None, 4)
    with pytest.raises(ValueError, match="prefill_workspace_starts has only 1"):
        ic.convert_req_index_to_global(t32([0]), bt, tok, out, None, t32([1]), t32([0]), 4)
    with pytest.raises(ValueError, match="block_stride_rows"):
        ic.convert_req_index_to_global(t32([0]), bt, tok, out, None, None, None, 4, 3)
    with pytest.raises(ValueError, match="NUM_TOPK_TOKENS=2048"):
        ic.triton_convert_req_index_to_global_index(t32([0]), bt, tok)
    assert (out == P).all()


def test_c128a_bad_inputs():
    dec, dl, pre = (torch.full((1, 128), P, dtype=I32), torch.full((1,), P, dtype=I32),
                    torch.full((1, 128), P, dtype=I32))
    args = lambda **o: {**dict(positions=t32([300, 5]), slot_mapping=torch.tensor([0]),  # noqa
                               token_to_req_indices=t32([0]), block_table=t32([[1, 2]]),
                               out_decode=dec, out_decode_lens=dl, out_prefill=pre,
                               block_size=1, compress_ratio=128), **o}
    with pytest.raises(ValueError, match="too few for compressed entry 1"):
        ic.c128a_indices_and_lens(**args(block_table=t32([[1]])))
    with pytest.raises(ValueError, match="positions must be >= 0"):
        ic.c128a_indices_and_lens(**args(positions=t32([300, -2])))
    with pytest.raises(ValueError, match="multiple of 128"):
        ic.c128a_indices_and_lens(**args(out_decode=dec[:, :64], out_prefill=pre[:, :64]))
    assert (dec == P).all() and (pre == P).all()
    ic.c128a_indices_and_lens(**args())
    assert dec[0, :3].tolist() == [1, 2, -1] and dl.tolist() == [2]


def test_combine_bad_inputs():
    out, lens = torch.full((3, 128), P, dtype=I32), torch.full((3,), P, dtype=I32)
    args = lambda **o: {**dict(topk_indices=torch.full((3, 2), -1, dtype=I32),  # noqa: E731
                               query_start_loc=t32([0, 3]), seq_lens=t32([3]),
                               gather_lens=t32([3]), out_indices=out, out_lens=lens,
                               window_size=4, compress_ratio=2, topk=2, M=10, N=3), **o}
    with pytest.raises(ValueError, match=r"gather_lens\[0\] = 2 must be in"):
        ic.combine_topk_swa_indices(**args(gather_lens=t32([2])))
    with pytest.raises(ValueError, match="exceeds the workspace rows"):
        ic.combine_topk_swa_indices(**args(M=5))
    with pytest.raises(ValueError, match="seq_lens must be >= the request's query_len: "
                                         "request 0 has seq_len 2 < query_len 3"):
        ic.combine_topk_swa_indices(**args(seq_lens=t32([2]), gather_lens=t32([2])))
    with pytest.raises(ValueError, match="not a compressed row"):
        ic.combine_topk_swa_indices(**args(topk_indices=t32([[-1, -1], [3, -1], [-1, -1]])))
    with pytest.raises(ValueError, match="spans 4 tokens but the output has 3 rows"):
        ic.combine_topk_swa_indices(**args(query_start_loc=t32([0, 4]), seq_lens=t32([4]),
                                           gather_lens=t32([4])))
    with pytest.raises(ValueError, match=r"out_indices must have shape \[3, 256\]"):
        ic.combine_topk_swa_indices(**args(topk=200))
    assert (out == P).all() and (lens == P).all()


def test_mixed_bad_inputs():
    base = dict(decode_swa_indices=torch.zeros(0, 4, dtype=I32), decode_compressed_indices=None,
                decode_compressed_topk_lens=None, prefill_topk_indices=t32([[0, -1]]),
                query_start_loc=t32([0, 1]), seq_lens=t32([5]), token_to_req_indices=t32([0]),
                swa_block_table=t32([[1, 2, 3]]), swa_block_size=2, compressed_block_table=None,
                compressed_block_size=2, window_size=4, compress_ratio=2, topk=2)
    with pytest.raises(ValueError, match="too few for position 4"):
        ic.build_flashinfer_mixed_sparse_indices(**{**base, "swa_block_table": t32([[1, 2]])})
    with pytest.raises(ValueError, match="seq_lens must be >= the request's query_len: "
                                         "request 0 has seq_len 0 < query_len 1"):
        ic.build_flashinfer_mixed_sparse_indices(**{**base, "query_start_loc": t32([0, 1]),
                                                    "seq_lens": t32([0])})
    with pytest.raises(ValueError, match="decode_is_valid_token is required"):
        ic.build_flashinfer_mixed_sparse_indices(**{
            **base, "decode_swa_indices": torch.zeros(1, 4, dtype=I32),
            "decode_compressed_indices": t32([[0]]), "token_to_req_indices": t32([0, 0]),
            "decode_compressed_indices_are_local": True})
    out = torch.full((1, 8), P, dtype=I32)
    with pytest.raises(ValueError, match=r"out_indices must have shape \[1, 8\]"):
        ic.build_flashinfer_mixed_sparse_indices(**base, out_indices=out[:, :7])
    si, sl = ic.build_flashinfer_mixed_sparse_indices(**base, out_indices=out)
    assert si.data_ptr() == out.data_ptr() and sl.tolist() == [4 + 2]


# ---- opcheck
# torch.library.opcheck for every index op (schema, fake tensor, autograd registration,
# aot_dispatch) on small CPU batches.

W = 16


def _cases():
    b = make_batch(4, ratio=4, swa_bs=4, comp_bs=2, mtp=2, topk=8)
    x = b.t
    Td, Tp = b.Td, b.Tp
    T = Td + Tp + b.n_tail_pad
    e = lambda *s: torch.empty(*s, dtype=I32)  # noqa: E731
    rd = b.n_decode_reqs
    qsl_p, seq_p = x["query_start_loc"][rd:], x["seq_lens"][rd:]
    ql = (qsl_p[1:] - qsl_p[:-1]).long()
    gl = (ql + torch.clamp(seq_p.long() - ql, max=W - 1)).to(I32)
    N = 80
    dswa = e(Td, W)
    ic.swa_indices_and_lens(x["query_start_loc"], x["seq_lens"], x["token_to_req"],
                            x["is_valid"], x["swa_bt"], dswa, e(Td), 4, W)
    return {
        "global_topk": (torch.ops.sparse_mla.global_topk_indices_and_lens,
                        (x["topk"], x["token_to_req"], x["comp_bt"], x["is_valid"], e(T, 8), e(T),
                         2)),
        "convert": (torch.ops.sparse_mla.convert_req_index_to_global,
                    (x["token_to_req"][:T].clamp(0, len(x["seq_lens"]) - 1), x["swa_bt"],
                     x["topk"], e(T, 8), e(T), None, None, 4, 6)),
        "convert_prefill": (torch.ops.sparse_mla.convert_req_index_to_global,
                            (x["token_to_req"][:T].clamp(0, 0), x["swa_bt"], x["topk"], e(T, 8),
                             None, torch.full((T,), -1, dtype=I32), torch.zeros(1, dtype=I32),
                             4)),
        "swa": (torch.ops.sparse_mla.swa_indices_and_lens,
                (x["query_start_loc"], x["seq_lens"], x["token_to_req"], x["is_valid"],
                 x["swa_bt"], e(T, W), e(T), 4, W, 0)),
        "c128a": (torch.ops.sparse_mla.c128a_indices_and_lens,
                  (x["positions"], x["slot_mapping"], x["token_to_req"], x["comp_bt"],
                   e(Td, 128), e(Td), e(Tp, 128), 2, 4)),
        "combine": (torch.ops.sparse_mla.combine_topk_swa_indices,
                    (x["topk"][Td:Td + Tp], qsl_p, seq_p, gl, e(Tp, 128), e(Tp), W, 4, 8,
                     N + W + 64, N)),
        "mixed": (torch.ops.sparse_mla.flashinfer_mixed_sparse_indices,
                  (dswa, x["topk"][:Td], None, x["topk"][Td:Td + Tp], x["query_start_loc"],
                   x["seq_lens"], x["token_to_req"], x["swa_bt"], x["comp_bt"],
                   x["is_valid"][:Td], e(Td + Tp, W + 8), e(Td + Tp), 4, 2, W, 4, 8, True, 6,
                   None)),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    op, args = CASES[name]
    # Default test_utils, aot_dispatch included: these ops mutate only their output buffers
    # and return None, which aot_dispatch handles.
    torch.library.opcheck(op, args)


def test_bench_cases_small_run_and_agree():
    """bench.cases(small=True) on CPU: every case runs with the reference and compares 0."""
    from sparse_mla.ops.index_combine import bench
    cs = bench.cases("cpu", small=True)
    assert {c.op for c in cs} == {"swa_indices_and_lens", "global_topk_indices_and_lens",
                                  "c128a_indices_and_lens", "flashinfer_mixed_sparse_indices",
                                  "combine_topk_swa_indices"}
    for c in cs:
        a = c.run(c.make(), "reference")
        assert c.compare(a, c.run(c.make(), "reference")) == 0 and c.bytes > 0
        assert c.error_unit == "mismatches"
