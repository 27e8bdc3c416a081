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
     ValueError, r"topk_length must be in \[0, 64\].*batch row 0 has 65"),
    ("topk_length per token", dict(topk_length=torch.tensor([1], dtype=torch.int32)),
     ValueError, r"topk_length must have shape \[2\]"),
    ("extra format differs", dict(extra_k_cache=formats.alloc_paged_cache("v32", 4, 2)),
     ValueError, "extra_k_cache must use the same format as k_cache"),
    ("extra indices without cache", dict(extra_k_cache=None), ValueError,
     "need extra_k_cache"),
    ("sink shape", dict(attn_sink=torch.zeros(5)), ValueError, r"attn_sink must have shape \[4\]"),
    ("sink dtype", dict(attn_sink=torch.zeros(4, dtype=torch.float64)), TypeError,
     "attn_sink must have dtype float32"),
    ("unknown format", dict(kv_format="v5"), ValueError, "kv_format must be 'v4'"),
    ("extra_topk_length > extra topk",
     dict(extra_topk_length=torch.tensor([3, 65], dtype=torch.int32)), ValueError,
     r"extra_topk_length must be in \[0, 64\]"),
    ("negative topk_length", dict(topk_length=torch.tensor([-1, 3], dtype=torch.int32)),
     ValueError, r"topk_length must be in \[0, 64\]"),
    ("extra indices dtype", dict(extra_indices_in_kvcache=torch.zeros(2, 1, 64,
                                                                        dtype=torch.int64)),
     TypeError, "extra_indices_in_kvcache must have dtype int32"),
    ("extra indices s_q", dict(extra_indices_in_kvcache=torch.zeros(2, 2, 64, dtype=torch.int32)),
     ValueError, r"extra_indices_in_kvcache must have shape \[2, 1, \*\]"),
    ("extra cache without indices", dict(extra_indices_in_kvcache=None, extra_topk_length=None),
     ValueError, "extra_k_cache needs extra_indices_in_kvcache"),
    ("k_cache dtype", dict(k_cache=torch.zeros(3, 64, 584)), TypeError,
     "k_cache must have dtype uint8 or int8 or float8_e4m3fn"),
    ("k_cache token bytes", dict(k_cache=torch.zeros(3, 64, 656, dtype=torch.uint8)), ValueError,
     "k_cache last dimension must be 584 bytes per token for format v4, got 656"),
    ("k_cache 2-D without block_size", dict(k_cache=torch.zeros(3, 37440, dtype=torch.uint8)),
     ValueError, r"k_cache is a 2-D \[num_blocks, bytes\] view: pass block_size"),
    ("k_cache tokens not packed",
     dict(k_cache=torch.zeros(3, 64, 600, dtype=torch.uint8)[:, :, :584]), ValueError,
     r"k_cache is a cache the op reads in place .* rows of packed elements"),
    ("extra_k_cache dtype", dict(extra_k_cache=torch.zeros(40, 2, 584)), TypeError,
     "extra_k_cache must have dtype uint8"),
    ("topk_length dtype", dict(topk_length=torch.tensor([64, 1])), TypeError,
     "topk_length must have dtype int32, got int64"),
    ("extra_topk_length shape", dict(extra_topk_length=torch.zeros(3, dtype=torch.int32)),
     ValueError, r"extra_topk_length must have shape \[2\], got \[3\]"),
    ("devices differ", dict(attn_sink=torch.zeros(4, device="meta")), ValueError,
     "all tensors must be on one device"),
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


def _prefill_args(**over):
    a = prefill_case("cpu", s_q=3, h=2, s_kv=10, topk=8)
    a.update(over)
    return a


BAD_PREFILL = [
    ("kv rank", lambda a: dict(kv=a["kv"][:, 0]), ValueError,
     r"kv must have shape \[s_kv, 1, 512\]"),
    ("q 576 over kv 512", lambda a: dict(q=torch.zeros(3, 2, 576, dtype=torch.bfloat16)),
     ValueError, r"kv must have shape \[s_kv, 1, 576\] \(the width of q\), got \[10, 1, 512\]"),
    ("q width", lambda a: dict(q=torch.zeros(3, 2, 520, dtype=torch.bfloat16)), ValueError,
     r"q must have shape \[s_q, heads, 512\] \(DeepSeek-V4\) or \[s_q, heads, 576\]"),
    ("kv dtype", lambda a: dict(kv=a["kv"].float()), TypeError, "kv must have dtype bfloat16"),
    ("q dtype", lambda a: dict(q=a["q"].float()), TypeError, "q must have dtype bfloat16"),
    ("heads > 128", lambda a: dict(q=torch.zeros(3, 129, 512, dtype=torch.bfloat16)),
     ValueError, "129 heads"),
    ("indices rows", lambda a: dict(indices=a["indices"][:2]), ValueError,
     r"indices must have shape \[3, 1, \*\]"),
    ("indices dtype", lambda a: dict(indices=a["indices"].long()), TypeError,
     "indices must have dtype int32"),
    ("topk_length > topk", lambda a: dict(topk_length=torch.tensor([9, 1, 0],
                                                                    dtype=torch.int32)),
     ValueError, r"topk_length must be in \[0, 8\]"),
    ("topk_length shape", lambda a: dict(topk_length=torch.zeros(2, dtype=torch.int32)),
     ValueError, r"topk_length must have shape \[3\]"),
    ("sink shape", lambda a: dict(attn_sink=torch.zeros(3)), ValueError,
     r"attn_sink must have shape \[2\]"),
]


@pytest.mark.parametrize("what,over,exc,msg", BAD_PREFILL, ids=[b[0] for b in BAD_PREFILL])
def test_prefill_rejects_bad_input_and_writes_nothing(what, over, exc, msg):
    a = _prefill_args()
    a.update(over(a))
    out = torch.full((3, 2, 512), 7.0, dtype=torch.bfloat16)
    mx, lse = torch.full((3, 2), 7.0), torch.full((3, 2), 7.0)
    with pytest.raises(exc, match=msg):
        flashmla_sparse_prefill(a["q"], a["kv"], a["indices"], out, mx, lse, a["sm_scale"],
                                a["topk_length"], a["attn_sink"])
    assert out.eq(7).all() and mx.eq(7).all() and lse.eq(7).all()


@pytest.mark.parametrize("name,shape,dtype,exc,msg", [
    ("out", (3, 2, 256), torch.bfloat16, ValueError, r"out must have shape \[3, 2, 512\]"),
    ("out", (3, 2, 512), torch.float32, TypeError, "out must have dtype bfloat16"),
    ("max_logits", (3, 3), torch.float32, ValueError, r"max_logits must have shape \[3, 2\]"),
    ("lse", (3, 2), torch.bfloat16, TypeError, "lse must have dtype float32")])
def test_prefill_rejects_bad_output_buffers(name, shape, dtype, exc, msg):
    a = _prefill_args()
    bufs = dict(out=torch.empty(3, 2, 512, dtype=torch.bfloat16), max_logits=torch.empty(3, 2),
                lse=torch.empty(3, 2))
    bufs[name] = torch.empty(shape, dtype=dtype)
    with pytest.raises(exc, match=msg):
        flashmla_sparse_prefill(a["q"], a["kv"], a["indices"], bufs["out"], bufs["max_logits"],
                                bufs["lse"], a["sm_scale"], a["topk_length"], a["attn_sink"])


@pytest.mark.parametrize("name,make,exc,msg", [
    ("out", lambda: torch.empty(2, 1, 4, 256, dtype=torch.bfloat16), ValueError,
     r"out must have shape \[2, 1, 4, 512\]"),
    ("out", lambda: torch.empty(2, 1, 4, 512), TypeError, "out must have dtype bfloat16"),
    ("lse", lambda: torch.empty(2, 1, 4), ValueError, r"lse must have shape \[2, 4, 1\]"),
    ("lse", lambda: torch.empty(2, 4, 1, dtype=torch.float64), TypeError,
     "lse must have dtype float32")])
def test_decode_rejects_bad_output_buffers(name, make, exc, msg):
    a = _args()
    bufs = dict(out=torch.empty(2, 1, 4, 512, dtype=torch.bfloat16), lse=torch.empty(2, 4, 1))
    bufs[name] = make()
    q, cache, idx = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    with pytest.raises(exc, match=msg):
        flash_mla_with_kvcache(q, cache, idx, **bufs, **a)


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
