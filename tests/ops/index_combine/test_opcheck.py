"""torch.library.opcheck for every index op (schema, fake tensor, autograd registration,
aot_dispatch) on small CPU batches."""
import pytest
import torch

from sparse_mla.ops import index_combine as ic
from sparse_mla.tests.ops.index_combine.batches import make_batch

I32 = torch.int32
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
