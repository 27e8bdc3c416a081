"""Bad decode / prefill inputs raise clear errors and write nothing; opcheck."""
import pytest
import torch

from sparse_mla.ops.common import formats
from sparse_mla.ops.flashmla_decode import (flash_mla_with_kvcache, flashmla_sparse_decode,
                                            flashmla_sparse_prefill)
from sparse_mla.tests.ops.flashmla_decode.cases import decode_case, prefill_case


def _args(**over):
    a = decode_case("cpu", b=2, s_q=1, h=4, topk=64, extra=True, extra_topk=64, seed=1)
    a.update(over)
    return a


BAD = [
    ("q dtype", dict(q=torch.zeros(2, 1, 4, 512)), TypeError, "q must have dtype bfloat16"),
    ("q dim for v4", dict(q=torch.zeros(2, 1, 4, 576, dtype=torch.bfloat16)), ValueError,
     r"q must have shape \[batch, s_q, heads, 512\]"),
    ("heads > 128", dict(q=torch.zeros(2, 1, 129, 512, dtype=torch.bfloat16)), ValueError,
     "129 heads"),
    ("indices dtype", dict(indices=torch.zeros(2, 1, 64, dtype=torch.int64)), TypeError,
     "indices must have dtype int32"),
    ("indices batch", dict(indices=torch.zeros(3, 1, 64, dtype=torch.int32)), ValueError,
     r"indices must have shape \[2, 1, \*\]"),
    ("topk_length > topk", dict(topk_length=torch.tensor([65, 1], dtype=torch.int32)),
     ValueError, r"topk_length must be in \[0, 64\]"),
    ("topk_length per token", dict(topk_length=torch.tensor([1], dtype=torch.int32)),
     ValueError, r"topk_length must have shape \[2\]"),
    ("extra format differs", dict(extra_k_cache=formats.alloc_paged_cache("v32", 4, 2)),
     ValueError, "extra_k_cache must use the same format as k_cache"),
    ("extra indices without cache", dict(extra_k_cache=None), ValueError,
     "need extra_k_cache"),
    ("sink shape", dict(attn_sink=torch.zeros(5)), ValueError, r"attn_sink must have shape \[4\]"),
    ("unknown format", dict(kv_format="v5"), ValueError, "kv_format must be 'v4'"),
]


@pytest.mark.parametrize("what,over,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_decode_rejects_bad_input_and_writes_nothing(what, over, exc, msg):
    a = _args(**over)
    out = torch.full((2, 1, 4, 512), 7.0, dtype=torch.bfloat16)
    lse = torch.full((2, 4, 1), 7.0)
    q, cache, idx = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    with pytest.raises(exc, match=msg):
        flash_mla_with_kvcache(q, cache, idx, out=out, lse=lse, **a)
    assert out.eq(7).all() and lse.eq(7).all()


def test_prefill_rejects_bad_input():
    a = prefill_case("cpu", s_q=3, h=2, s_kv=10, topk=8)
    out, mx, lse = torch.empty(3, 2, 512, dtype=torch.bfloat16), torch.empty(3, 2), \
        torch.empty(3, 2)
    with pytest.raises(ValueError, match=r"kv must have shape \[\*, 1, 512\]"):
        flashmla_sparse_prefill(a["q"], a["kv"][:, 0], a["indices"], out, mx, lse, 0.1)
    with pytest.raises(ValueError, match=r"indices must have shape \[3, 1, \*\]"):
        flashmla_sparse_prefill(a["q"], a["kv"], a["indices"][:2], out, mx, lse, 0.1)
    with pytest.raises(ValueError, match=r"lse must have shape \[3, 2\]"):
        flashmla_sparse_prefill(a["q"], a["kv"], a["indices"], out, mx, lse[:2], 0.1)


def test_opcheck_decode_and_prefill():
    a = _args()
    out = torch.empty(2, 1, 4, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 1, 4).transpose(1, 2)
    torch.library.opcheck(flashmla_sparse_decode, (
        a["q"], a["k_cache"], a["indices"], out, lse, a["topk_length"], a["extra_k_cache"],
        a["extra_indices_in_kvcache"], a["extra_topk_length"], a["attn_sink"]))
    p = prefill_case("cpu", s_q=3, h=2, s_kv=10, topk=8)
    torch.library.opcheck(flashmla_sparse_prefill, (
        p["q"], p["kv"], p["indices"], torch.empty(3, 2, 512, dtype=torch.bfloat16),
        torch.empty(3, 2), torch.empty(3, 2), p["sm_scale"], p["topk_length"], p["attn_sink"]))
