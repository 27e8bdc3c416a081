"""Bad arguments raise before anything is written, naming the argument; the ops pass
torch.library.opcheck; dispatch names the routes."""
import pytest
import torch

from sparse_mla.ops.common import dispatch
from sparse_mla.ops.indexer import (alloc_cache, indexer_k_insert, indexer_topk_decode,
                                    indexer_topk_prefill)
from sparse_mla.tests.helpers import seeded
from sparse_mla.tests.ops.indexer import cases


def _prefill_args(fp8=True):
    case = cases.prefill_case(seeded(1), [3, 2], [4, 6], fp8=fp8)
    out = torch.full((5, 4), 7, dtype=torch.int32)
    return dict(q=case.q, weights=case.w, k=case.k, k_scale=case.k_scale,
                cu_seqlens_q=case.cu_q, cu_seqlens_k=case.cu_k, positions=case.positions,
                out=out)


def _decode_args():
    case, seq_lens = cases.decode_case(seeded(2), [5, 9], next_n=2)
    cache, bt = cases.paged(case, seeded(3), 4)
    out = torch.full((4, 4), 7, dtype=torch.int32)
    return dict(q=case.q, weights=case.w, k_cache=cache, seq_lens=seq_lens, block_table=bt,
                out=out, next_n=2)


def _insert_args():
    return dict(k=torch.randn(3, 128), k_cache=alloc_cache(2, 4, fill=0xFF),
                slot_mapping=torch.tensor([0, 5, -1]))


PREFILL_BAD = [
    ("q", lambda a: a["q"].float(), TypeError, "q must have dtype"),
    ("q", lambda a: a["q"][:, :, :64], ValueError, r"q must have shape \[num_tokens"),
    ("weights", lambda a: a["weights"][:, :2], ValueError, "weights must have shape"),
    ("k_scale", lambda a: None, ValueError, "fp8 keys need k_scale"),
    ("k_scale", lambda a: a["k_scale"][:3], ValueError, "k_scale must have shape"),
    ("cu_seqlens_q", lambda a: torch.tensor([0, 3, 4]), ValueError, r"cu_seqlens_q\[-1\]"),
    ("cu_seqlens_q", lambda a: torch.tensor([1, 3, 5]), ValueError, r"cu_seqlens_q\[0\]"),
    ("cu_seqlens_k", lambda a: torch.tensor([0, 7, 6]), ValueError, "non-decreasing"),
    ("cu_seqlens_k", lambda a: torch.tensor([0, 4, 99]), ValueError, "rows of k"),
    ("cu_seqlens_k", lambda a: torch.tensor([0, 4]), ValueError, "cu_seqlens_k must"),
    ("positions", lambda a: a["positions"] - 20, ValueError, "positions must be >= 0"),
    ("positions", lambda a: a["positions"][:2], ValueError, "positions must be 1-D"),
    ("out", lambda a: a["out"].long(), TypeError, "out must have dtype int32"),
    ("out", lambda a: a["out"][:4], ValueError, "out must have shape"),
]


@pytest.mark.parametrize("name,bad,exc,match", PREFILL_BAD,
                         ids=[f"{p[0]}-{i}" for i, p in enumerate(PREFILL_BAD)])
def test_prefill_rejects(name, bad, exc, match):
    _expect_rejected(indexer_topk_prefill, _prefill_args(), name, bad, exc, match)


def _expect_rejected(op, args, name, bad, exc, match):
    """``op`` with argument ``name`` replaced by ``bad(args)`` raises ``exc`` matching
    ``match`` and leaves ``out`` as it was."""
    args[name] = bad(args)
    before = args["out"].clone() if name != "out" else None
    with pytest.raises(exc, match=match):
        op(**args)
    if before is not None:
        assert torch.equal(args["out"], before)


def test_prefill_rejects_scalars():
    with pytest.raises(ValueError, match="ratio must be in"):
        indexer_topk_prefill(**_prefill_args(), ratio=0)
    with pytest.raises(ValueError, match="max_seqlen_k=3 is less than"):
        indexer_topk_prefill(**_prefill_args(), max_seqlen_k=3)
    args = _prefill_args()
    args["k"], args["k_scale"] = args["k"].float().to(torch.bfloat16), args["k_scale"]
    with pytest.raises(ValueError, match="k_scale applies only to fp8 keys"):
        indexer_topk_prefill(**args)


DECODE_BAD = [
    ("seq_lens", lambda a: a["seq_lens"][:1], ValueError, "seq_lens must be 1-D"),
    ("seq_lens", lambda a: a["seq_lens"] - 100, ValueError, "seq_lens must be >= 0"),
    ("block_table", lambda a: a["block_table"].long(), TypeError, "block_table must have"),
    ("block_table", lambda a: a["block_table"][:1], ValueError, "block_table must have shape"),
    ("k_cache", lambda a: a["k_cache"].view(torch.uint8)[:, :, :128], ValueError,
     "k_cache is a cache the op reads in place .* rows of packed elements"),
    ("k_cache", lambda a: torch.zeros(2, 4, 128), TypeError, "k_cache must be a bfloat16"),
    ("out", lambda a: a["out"][:, :0], ValueError, "at least one column"),
]


@pytest.mark.parametrize("name,bad,exc,match", DECODE_BAD,
                         ids=[f"{p[0]}-{i}" for i, p in enumerate(DECODE_BAD)])
def test_decode_rejects(name, bad, exc, match):
    _expect_rejected(indexer_topk_decode, _decode_args(), name, bad, exc, match)


def test_decode_rejects_tokens_not_a_multiple_of_next_n():
    args = _decode_args()
    args["q"], args["weights"], args["out"] = args["q"][:3], args["weights"][:3], args["out"][:3]
    with pytest.raises(ValueError, match="not a multiple of next_n=2"):
        indexer_topk_decode(**args)


INSERT_BAD = [
    ("k", lambda a: a["k"][:, :64], ValueError, "k must have shape"),
    ("k", lambda a: a["k"].long(), TypeError, "k must have dtype"),
    ("slot_mapping", lambda a: torch.tensor([0, 8, 1]), ValueError, "only 8 slots"),
    ("slot_mapping", lambda a: torch.tensor([0, 1, 2, 3]), ValueError, "at most 3"),
    ("k_cache", lambda a: torch.zeros(2, 4, 130, dtype=torch.uint8), ValueError,
     "132 bytes per token"),
]


@pytest.mark.parametrize("name,bad,exc,match", INSERT_BAD,
                         ids=[f"{p[0]}-{i}" for i, p in enumerate(INSERT_BAD)])
def test_insert_rejects_and_writes_nothing(name, bad, exc, match):
    args = _insert_args()
    args[name] = bad(args)
    before = args["k_cache"].clone()
    with pytest.raises(exc, match=match):
        indexer_k_insert(**args)
    assert torch.equal(args["k_cache"].view(torch.uint8), before.view(torch.uint8))


def test_opcheck():
    a = _prefill_args(fp8=False)     # opcheck compares inputs with allclose: no fp8 there
    torch.library.opcheck(indexer_topk_prefill, tuple(a.values()))
    d = _decode_args()
    torch.library.opcheck(indexer_topk_decode, (d["q"], d["weights"], d["k_cache"],
                                                d["seq_lens"], d["block_table"], d["out"], 4, 2))
    i = _insert_args()
    torch.library.opcheck(indexer_k_insert, tuple(i.values()))


def test_dispatch_names_the_routes():
    a = _prefill_args()
    choice = dispatch.explain("indexer_topk_prefill", *a.values())
    # on a CPU tensor: the reference, or Triton where its interpreter runs kernels
    assert choice.impl == ("triton" if dispatch.triton_interpreting() else "reference")
    assert "no vendor route" in choice.rejected["vendor"]
    for op in dispatch.OPS_BY_FAMILY["indexer"]:
        assert dispatch.dispatcher(op).op == op
