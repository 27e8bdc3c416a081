"""Bad arguments of the V4.1 indexer ops raise before anything is written, naming the argument
(the shared ones through ops/indexer's checks, the candidate ones here); the ops pass
torch.library.opcheck; dispatch names the routes."""
import pytest
import torch

from sparse_mla.ops.common import dispatch
from sparse_mla.ops.indexer_v41 import (indexer_v41_candidates_decode,
                                        indexer_v41_candidates_prefill,
                                        indexer_v41_topk_in_candidates_decode,
                                        indexer_v41_topk_in_candidates_prefill)
from sparse_mla.tests.helpers import seeded
from sparse_mla.tests.ops.indexer import cases
from sparse_mla.tests.ops.indexer_v41 import oracle


def _decode_args(level1):
    case = oracle.int_case(seeded(1), [2, 2], [12, 5], ratio=2)
    cache, bt = cases.paged(case, seeded(2), 4)
    a = dict(q=case.q, weights=case.w, k_cache=cache,
             seq_lens=oracle.decode_seq_lens(case, 2), block_table=bt,
             out=torch.full((4, 3), 7, dtype=torch.int32),
             candidates=torch.full((4, 2), 7 if level1 else 0, dtype=torch.int32),
             ratio=2, next_n=2)
    return a


def _prefill_args(level1):
    case = oracle.int_case(seeded(3), [3, 2], [9, 4], ratio=1, fp8=False)
    return dict(q=case.q, weights=case.w, k=case.k, k_scale=None, cu_seqlens_q=case.cu_q,
                cu_seqlens_k=case.cu_k, positions=case.positions,
                out=torch.full((5, 3), 7, dtype=torch.int32),
                candidates=torch.full((5, 2), 7 if level1 else 0, dtype=torch.int32), ratio=1)


OPS = [(indexer_v41_candidates_decode, _decode_args, True),
       (indexer_v41_topk_in_candidates_decode, _decode_args, False),
       (indexer_v41_candidates_prefill, _prefill_args, True),
       (indexer_v41_topk_in_candidates_prefill, _prefill_args, False)]
OP_IDS = ["cand-decode", "topk-decode", "cand-prefill", "topk-prefill"]

BAD = [
    ("candidates", lambda a: a["candidates"].long(), TypeError, "candidates must have dtype"),
    ("candidates", lambda a: a["candidates"][:1], ValueError, "candidates must have shape"),
    ("candidate_block", lambda a: 0, ValueError, "candidate_block must be"),
    ("ratio", lambda a: 0, ValueError, "ratio must be"),
    ("out", lambda a: a["out"][:, :0], ValueError, "at least one column"),
    ("q", lambda a: a["q"].float(), TypeError, "q must have dtype"),
]


@pytest.mark.parametrize("op,make", [OPS[0][:2], OPS[2][:2]], ids=[OP_IDS[0], OP_IDS[2]])
def test_level1_refuses_candidates_it_cannot_write_in_place(op, make):
    """Level 1 writes ``candidates``: a column-major view is refused by name (level 2 only
    reads it, so the op boundary copies such a view there)."""
    a = make(True)
    a["candidates"] = a["candidates"].t().contiguous().t()
    before = _written(a)
    with pytest.raises(ValueError, match="candidates"):
        op(**a)
    assert all(torch.equal(x, y) for x, y in zip(before, _written(a)))


def _written(a):
    return [a["out"].clone(), a["candidates"].clone()]


@pytest.mark.parametrize("op,make,level1", OPS, ids=OP_IDS)
@pytest.mark.parametrize("name,bad,exc,match", BAD, ids=[f"{b[0]}-{i}" for i, b in
                                                         enumerate(BAD)])
def test_rejects_before_writing(op, make, level1, name, bad, exc, match):
    a = make(level1)
    a[name] = bad(a)
    before = _written(a)
    with pytest.raises(exc, match=match):
        op(**a)
    for was, now in zip(before, _written(a)):
        assert was.shape != now.shape or torch.equal(was, now)


@pytest.mark.parametrize("op,make", [OPS[0][:2], OPS[2][:2]], ids=[OP_IDS[0], OP_IDS[2]])
def test_level1_needs_a_candidate_column(op, make):
    a = make(True)
    a["candidates"] = a["candidates"][:, :0]
    with pytest.raises(ValueError, match="candidates must have at least one column"):
        op(**a)


@pytest.mark.parametrize("op,make", [OPS[1][:2], OPS[3][:2]], ids=[OP_IDS[1], OP_IDS[3]])
def test_level2_without_candidates_selects_nothing(op, make):
    a = make(False)
    a["candidates"] = a["candidates"][:, :0]
    op(**a)
    assert (a["out"] == -1).all()


@pytest.mark.parametrize("op,make,level1", OPS, ids=OP_IDS)
def test_opcheck_and_routes(op, make, level1):
    torch.library.opcheck(op, tuple(make(level1).values()))
    name = str(op._name).removeprefix("sparse_mla::")
    assert name in dispatch.OPS_BY_FAMILY["indexer_v41"]
    choice = dispatch.explain(name, *make(level1).values())
    # on a CPU tensor: the reference, or Triton where its interpreter runs kernels
    assert choice.impl == ("triton" if dispatch.triton_interpreting() else "reference")
    assert "no vendor kernel" in choice.rejected["vendor"]
