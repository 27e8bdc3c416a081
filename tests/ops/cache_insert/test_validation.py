"""Bad inputs raise clear errors before anything is written; opcheck for every op."""
import pytest
import torch

from sparse_mla.ops.cache_insert import (fused_qnorm_rope_insert_plain,
                                         fused_qnorm_rope_insert_v4, gather_dequant,
                                         insert_plain, quantize_insert_v32, quantize_insert_v4)
from sparse_mla.ops.common import formats
from sparse_mla.tests.helpers import storage_bytes

POISON = 0xFF


def _cs(max_pos=16):
    return torch.cat([torch.ones(max_pos, 32), torch.zeros(max_pos, 32)], dim=1)


def _v4_args(**over):
    a = dict(k=torch.randn(3, 512, dtype=torch.bfloat16),
             k_cache=formats.alloc_paged_cache("v4", 2, 4, fill=POISON),
             slot_mapping=torch.tensor([0, 3, 7]))
    a.update(over)
    return a


V4_BAD = [
    ("k dtype", dict(k=torch.zeros(3, 512, dtype=torch.int32)), TypeError, "k must have dtype"),
    ("k width", dict(k=torch.zeros(3, 511, dtype=torch.bfloat16)), ValueError,
     r"k must have shape \[3, 512\]"),
    ("slot dtype", dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), TypeError,
     "slot_mapping must have dtype"),
    ("slot too long", dict(slot_mapping=torch.arange(4)), ValueError, "at most 3 entries"),
    ("slot beyond capacity", dict(slot_mapping=torch.tensor([0, 8, -1])), ValueError,
     "slot 8, but the cache has only 8 slots"),
    ("cache last dim bytes", dict(k_cache=torch.zeros(2, 4, 583, dtype=torch.uint8)),
     ValueError, "584 bytes per token"),
    ("cache dtype", dict(k_cache=torch.zeros(2, 4, 584, dtype=torch.float32)), TypeError,
     "k_cache must have dtype"),
    ("cache token stride", dict(k_cache=torch.zeros(2, 8, 584, dtype=torch.uint8)[:, ::2]),
     ValueError, "k_cache is written by the op, so it must be rows of packed elements"),
    ("cache block stride too small",
     dict(k_cache=torch.zeros(4000, dtype=torch.uint8).as_strided((2, 4, 584), (1000, 584, 1))),
     ValueError, "k_cache is written by the op, so it must be rows of packed elements"),
    ("cache rank", dict(k_cache=torch.zeros(4 * 584, dtype=torch.uint8)), ValueError,
     "must be 2-D"),
]


@pytest.mark.parametrize("what,over,exc,msg", V4_BAD, ids=[b[0] for b in V4_BAD])
def test_v4_insert_rejects_bad_input_and_writes_nothing(what, over, exc, msg):
    a = _v4_args(**over)
    before = storage_bytes(a["k_cache"])
    with pytest.raises(exc, match=msg):
        quantize_insert_v4(**a)
    assert torch.equal(storage_bytes(a["k_cache"]), before)


def test_2d_cache_view_needs_block_size_and_enough_bytes():
    raw = torch.full((2, formats.V4.page_bytes(4)), POISON, dtype=torch.uint8)
    k, slots = torch.randn(1, 512, dtype=torch.bfloat16), torch.tensor([5])
    with pytest.raises(ValueError, match="pass block_size"):
        quantize_insert_v4(k, raw, slots)
    with pytest.raises(ValueError, match="fewer than block_size"):
        quantize_insert_v4(k, raw, slots, block_size=5)
    quantize_insert_v4(k, raw, slots, block_size=4)     # vLLM's 2-D [num_blocks, page] view
    as3d = raw.as_strided((2, 4, 584), (raw.stride(0), 584, 1))
    ref = formats.alloc_paged_cache("v4", 2, 4, fill=POISON)
    quantize_insert_v4(k, ref, slots)
    assert torch.equal(storage_bytes(as3d), storage_bytes(ref))


def _fused_args(**over):
    n, h = 2, 4
    a = dict(q=torch.randn(n, h, 512, dtype=torch.bfloat16),
             kv=torch.randn(n, 512, dtype=torch.bfloat16),
             k_cache=formats.alloc_paged_cache("v4", 2, 4, fill=POISON),
             slot_mapping=torch.tensor([1, 2]), positions=torch.tensor([0, 5]),
             cos_sin_cache=_cs(), q_out=torch.empty(n, 8, 512, dtype=torch.bfloat16))
    a.update(over)
    return a


FUSED_BAD = [
    ("q heads > 128", dict(q=torch.zeros(2, 129, 512, dtype=torch.bfloat16)), ValueError,
     "129 heads"),
    ("q head dim", dict(q=torch.zeros(2, 4, 576, dtype=torch.bfloat16)), ValueError,
     r"q must have shape \[num_tokens, num_heads, 512\]"),
    ("q_out fewer heads", dict(q_out=torch.empty(2, 2, 512, dtype=torch.bfloat16)), ValueError,
     "4 <= H_padded"),
    ("q_out dtype", dict(q_out=torch.empty(2, 8, 512)), TypeError, "q_out must have dtype"),
    ("positions beyond table", dict(positions=torch.tensor([0, 16])), ValueError,
     r"positions must be in \[0, 16\)"),
    ("negative position", dict(positions=torch.tensor([-1, 0])), ValueError, "positions must"),
    ("cos_sin width", dict(cos_sin_cache=torch.zeros(16, 32)), ValueError, "max_position, 64"),
    ("cos_sin dtype", dict(cos_sin_cache=torch.zeros(16, 64, dtype=torch.bfloat16)), TypeError,
     "cos_sin_cache must have dtype float32"),
    ("kv rows", dict(kv=torch.zeros(3, 512, dtype=torch.bfloat16)), ValueError,
     r"kv must have shape \[2, 512\]"),
]


@pytest.mark.parametrize("what,over,exc,msg", FUSED_BAD, ids=[b[0] for b in FUSED_BAD])
def test_fused_v4_rejects_bad_input_and_writes_nothing(what, over, exc, msg):
    a = _fused_args(**over)
    before = storage_bytes(a["k_cache"]), a["q_out"].clone()
    with pytest.raises(exc, match=msg):
        fused_qnorm_rope_insert_v4(**a)
    assert torch.equal(storage_bytes(a["k_cache"]), before[0])
    assert torch.equal(a["q_out"].view(torch.int16), before[1].view(torch.int16))


PLAIN_CACHE_SHAPE = r"k_cache must have shape \[num_blocks, block_size, 512\]"


def test_plain_insert_scale_rules():
    q = torch.randn(1, 2, 512, dtype=torch.bfloat16)
    kv = torch.randn(1, 512, dtype=torch.bfloat16)
    base = dict(q=q, kv=kv, slot_mapping=torch.tensor([0]), positions=torch.tensor([0]),
                cos_sin_cache=_cs())
    c8 = torch.zeros(1, 4, 512, dtype=torch.float8_e4m3fn)
    q8 = torch.empty(1, 2, 512, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_scale is required"):
        fused_qnorm_rope_insert_plain(**base, k_cache=c8, q_out=q8)
    with pytest.raises(ValueError, match="kv_scale applies only"):
        fused_qnorm_rope_insert_plain(**base, k_cache=torch.zeros(1, 4, 512, dtype=torch.bfloat16),
                                      q_out=q.clone(), kv_scale=torch.tensor([1.0]))
    with pytest.raises(TypeError, match="q_out must have dtype float8_e4m3fn"):
        fused_qnorm_rope_insert_plain(**base, k_cache=c8, q_out=q.clone(),
                                      kv_scale=torch.tensor([1.0]),
                                      q_scale_inv=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="exactly 2 heads"):
        fused_qnorm_rope_insert_plain(**base, k_cache=c8,
                                      q_out=torch.empty(1, 4, 512, dtype=torch.float8_e4m3fn),
                                      kv_scale=torch.tensor([1.0]),
                                      q_scale_inv=torch.tensor([1.0]))
    with pytest.raises(ValueError, match=PLAIN_CACHE_SHAPE):
        fused_qnorm_rope_insert_plain(**base, k_cache=torch.zeros(4, 512, dtype=torch.bfloat16),
                                      q_out=q.clone())


def test_insert_plain_rejects_bad_input_and_writes_nothing():
    rows = torch.zeros(3, 512)
    c16 = torch.full((2, 4, 512), 7.0, dtype=torch.bfloat16)
    c8 = torch.zeros(2, 4, 512, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="kv_scale is required"):
        insert_plain(rows, c8, slots)
    with pytest.raises(ValueError, match="kv_scale applies only"):
        insert_plain(rows, c16, slots, torch.tensor([1.0]))
    with pytest.raises(ValueError, match=PLAIN_CACHE_SHAPE):
        insert_plain(rows, c16.view(2, 2048), slots)
    with pytest.raises(ValueError, match="slot_mapping must be 1-D with at most 3"):
        insert_plain(rows, c16, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match=r"slot_mapping"):
        insert_plain(rows, c16, torch.tensor([0, 1, 8]))
    assert bool((c16 == 7.0).all())


def test_v32_and_gather_reject_bad_input():
    cache = formats.alloc_paged_cache("v32", 1, 4, fill=POISON)
    before = storage_bytes(cache)
    with pytest.raises(ValueError, match="scale_format must be"):
        quantize_insert_v32(torch.zeros(1, 512), torch.zeros(1, 64), cache, torch.tensor([0]),
                            scale_format="e8m0")
    with pytest.raises(ValueError, match=r"k_pe must have shape \[1, 64\]"):
        quantize_insert_v32(torch.zeros(1, 512), torch.zeros(1, 128), cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="656 bytes per token"):
        quantize_insert_v32(torch.zeros(1, 512), torch.zeros(1, 64),
                            formats.alloc_paged_cache("v4", 1, 4), torch.tensor([0]))
    assert torch.equal(storage_bytes(cache), before)
    out = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    args = (cache, torch.tensor([2]), None, torch.tensor([[0]]))
    with pytest.raises(ValueError, match="unknown cache format 'v5'"):
        gather_dequant(out, *args, cache_format="v5")
    with pytest.raises(ValueError, match="quantized paged format"):
        gather_dequant(out, *args, cache_format="plain_bf16")
    with pytest.raises(ValueError, match=r"out must have shape \[num_reqs, max_tokens, 512\]"):
        gather_dequant(out, *args, cache_format="v4") if False else gather_dequant(
            out, formats.alloc_paged_cache("v4", 1, 4), *args[1:], cache_format="v4")
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        gather_dequant(out, cache, torch.tensor([-1]), None, torch.tensor([[0]]),
                       cache_format="v32")
    with pytest.raises(ValueError, match=r"gather_lens must be in \[0, seq_lens\]"):
        gather_dequant(out, cache, torch.tensor([2]), torch.tensor([3]), torch.tensor([[0]]),
                       cache_format="v32")
    with pytest.raises(TypeError, match="out must have dtype bfloat16"):
        gather_dequant(out.float(), *args, cache_format="v32")


ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")


def _opcheck(op, args, utils=ALL_UTILS):
    torch.library.opcheck(op, args, test_utils=utils)


def test_opcheck_every_op():
    g = torch.Generator().manual_seed(0)
    cache = formats.alloc_paged_cache("v4", 2, 4, fill=POISON)
    k = torch.randn(3, 512, generator=g).to(torch.bfloat16)
    _opcheck(quantize_insert_v4, (k, cache, torch.tensor([0, -1, 6])))
    a = _fused_args()
    _opcheck(fused_qnorm_rope_insert_v4, (a["q"], a["kv"], a["k_cache"], a["slot_mapping"],
                                          a["positions"], a["cos_sin_cache"], a["q_out"]))
    c32 = formats.alloc_paged_cache("v32", 2, 4, fill=POISON)
    _opcheck(quantize_insert_v32, (k, k[:, :64].contiguous(), c32, torch.tensor([1, 2, 3])))
    c16 = torch.zeros(2, 4, 512, dtype=torch.bfloat16)
    _opcheck(fused_qnorm_rope_insert_plain,
             (a["q"], a["kv"], c16, a["slot_mapping"], a["positions"], a["cos_sin_cache"],
              torch.empty(2, 4, 512, dtype=torch.bfloat16)))
    c8 = torch.zeros(2, 4, 512, dtype=torch.float8_e4m3fn)
    q8 = torch.empty(2, 4, 512, dtype=torch.float8_e4m3fn)
    # torch's schema / aot checks compare outputs with arithmetic fp8 tensors do not support
    # on CPU ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn): fake + autograd only.
    _opcheck(fused_qnorm_rope_insert_plain,
             (a["q"], a["kv"], c8, a["slot_mapping"], a["positions"], a["cos_sin_cache"], q8,
              torch.tensor([0.5]), torch.tensor([2.0])),
             ("test_autograd_registration", "test_faketensor"))
    _opcheck(insert_plain, (k, c16, torch.tensor([0, -1, 6])))
    _opcheck(insert_plain, (k, c8, torch.tensor([0, -1, 6]), torch.tensor([0.5])),
             ("test_autograd_registration", "test_faketensor"))
    out = torch.zeros(2, 6, 512, dtype=torch.bfloat16)
    _opcheck(gather_dequant, (out, cache, torch.tensor([3, 5]), torch.tensor([2, 5]),
                              torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)))


def test_ops_trace_under_torch_compile_fake_tensors():
    """The fake kernels let torch.compile trace the mutating ops without running them."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        cache = torch.empty(2, 4, 584, dtype=torch.uint8)
        quantize_insert_v4(torch.empty(3, 512, dtype=torch.bfloat16), cache,
                           torch.empty(3, dtype=torch.int64))
        with pytest.raises(ValueError, match="584 bytes per token"):
            quantize_insert_v4(torch.empty(3, 512, dtype=torch.bfloat16),
                               torch.empty(2, 4, 583, dtype=torch.uint8),
                               torch.empty(3, dtype=torch.int64))
