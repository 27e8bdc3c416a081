"""Bad inputs raise clear errors (TypeError / ValueError naming the argument) before anything
is written to ``out``."""
import pytest
import torch

from sparse_mla.ops import trtllm_decode as td
from sparse_mla.tests.helpers import seeded
from sparse_mla.tests.ops.trtllm_decode.cases import I32

BF16 = torch.bfloat16
SENTINEL = 3.0


def _args(**over):
    a = dict(query=torch.randn(3, 8, 512).to(BF16), swa_kv_cache=torch.randn(2, 64, 512).to(BF16),
             sparse_indices=torch.zeros(3, 136, dtype=I32),
             compressed_kv_cache=torch.randn(2, 64, 512).to(BF16),
             sparse_topk_lens=torch.full((3,), 130, dtype=I32),
             seq_lens=torch.tensor([4, 9], dtype=I32),
             out=torch.full((3, 8, 512), SENTINEL, dtype=BF16),
             cum_seq_lens_q=torch.tensor([0, 1, 3], dtype=I32), max_q_len=2)
    a.update(over)
    return a


BAD = [
    ("TOPK % 4", dict(sparse_indices=torch.zeros(3, 130, dtype=I32)), ValueError,
     "multiple of 4"),
    ("TOPK < 128", dict(sparse_indices=torch.zeros(3, 124, dtype=I32)), ValueError,
     "TOPK >= 128"),
    ("lens below 128", dict(sparse_topk_lens=torch.tensor([130, 127, 130], dtype=I32)),
     ValueError, r"sparse_topk_lens must be in \[128, 136\].*token 1 has 127"),
    ("lens above TOPK", dict(sparse_topk_lens=torch.tensor([130, 137, 130], dtype=I32)),
     ValueError, r"sparse_topk_lens must be in \[128, 136\]"),
    ("q/cache dtype mismatch", dict(swa_kv_cache=torch.zeros(2, 64, 512).to(torch.float8_e4m3fn)),
     TypeError, "swa_kv_cache dtype must match query dtype"),
    ("q/compressed dtype mismatch",
     dict(query=torch.zeros(3, 8, 512).to(torch.float8_e4m3fn),
          swa_kv_cache=torch.zeros(2, 64, 512).to(torch.float8_e4m3fn)),
     TypeError, "compressed_kv_cache dtype must match query dtype"),
    ("seq_len < q_len", dict(seq_lens=torch.tensor([4, 1], dtype=I32)), ValueError,
     "request 1 has seq_len 1 < q_len 2"),
    ("heads > 128", dict(query=torch.zeros(3, 129, 512).to(BF16),
                         out=torch.full((3, 129, 512), SENTINEL, dtype=BF16)),
     ValueError, "129 heads; expected 1..128"),
    ("query dtype", dict(query=torch.zeros(3, 8, 512)), TypeError, "query must have dtype"),
    ("query width", dict(query=torch.zeros(3, 8, 576).to(BF16)), ValueError,
     r"query must have shape \[sum_q, num_heads, 512\]"),
    ("missing max_q_len", dict(max_q_len=None), ValueError, "max_q_len is required"),
    ("max_q_len too small", dict(max_q_len=1), ValueError, "max_q_len = 1 is smaller"),
    ("indices dtype", dict(sparse_indices=torch.zeros(3, 136, dtype=torch.int64)), TypeError,
     "sparse_indices must have dtype int32"),
    ("indices rows", dict(sparse_indices=torch.zeros(2, 136, dtype=I32)), ValueError,
     r"sparse_indices must have shape \[3, TOPK\]"),
    ("slot beyond pool", dict(sparse_indices=torch.full((3, 136), 128, dtype=I32)), ValueError,
     "is not a row of its pool"),
    ("seq_lens shape", dict(seq_lens=torch.tensor([4, 9, 9], dtype=I32)), ValueError,
     r"seq_lens must have shape \[2\]"),
    ("NHD with 3-D cache", dict(kv_layout="NHD"), ValueError, "only with kv_layout='HND'"),
    ("bad layout", dict(kv_layout="XYZ"), ValueError, "kv_layout must be 'HND' or 'NHD'"),
    ("4-D HND two heads", dict(swa_kv_cache=torch.zeros(2, 2, 64, 512).to(BF16)), ValueError,
     "one KV head"),
    ("sinks shape", dict(sinks=torch.zeros(7)), ValueError, r"sinks must have shape \[8\]"),
    ("sinks dtype", dict(sinks=torch.zeros(8, dtype=BF16)), TypeError, "sinks must have dtype"),
    ("bmm1 tensor dtype", dict(bmm1_scale=torch.tensor([1.0], dtype=torch.float64)), TypeError,
     "bmm1_scale must have dtype float32"),
    ("cum_seq_lens decreasing", dict(cum_seq_lens_q=torch.tensor([0, 2, 1], dtype=I32)),
     ValueError, "non-decreasing"),
]


@pytest.mark.parametrize("what,over,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_dsv4_rejects_bad_input_and_writes_nothing(what, over, exc, msg):
    a = _args(**over)
    out = a.pop("out")
    query = a.pop("query")
    swa = a.pop("swa_kv_cache")
    with pytest.raises(exc, match=msg):
        td.trtllm_batch_decode_sparse_mla_dsv4(query, swa, None, out=out, impl="reference", **a)
    assert bool((out == SENTINEL).all())


def test_dsv4_out_wrong_shape_is_rejected_before_writing():
    a = _args(out=torch.full((3, 8, 511), SENTINEL, dtype=BF16))
    out = a.pop("out")
    with pytest.raises(ValueError, match=r"out must have shape \[3, 8, 512\]"):
        td.trtllm_batch_decode_sparse_mla_dsv4(a.pop("query"), a.pop("swa_kv_cache"), None,
                                               out=out, impl="reference", **a)
    assert bool((out == SENTINEL).all())


def test_dsv4_good_arguments_pass_and_write():
    """The baseline of the table above is valid: every failure comes from its one change."""
    a = _args()
    out = a.pop("out")
    td.trtllm_batch_decode_sparse_mla_dsv4(a.pop("query"), a.pop("swa_kv_cache"), None, out=out,
                                           impl="reference", **a)
    assert not bool((out == SENTINEL).all())


def _v32_args(**over):
    a = dict(query=torch.randn(2, 4, 576).to(BF16), kv_cache=torch.randn(2, 64, 576).to(BF16),
             block_tables=torch.zeros(2, 8, dtype=I32), seq_lens=torch.tensor([3, 8], dtype=I32),
             out=torch.full((2, 4, 512), SENTINEL, dtype=BF16))
    a.update(over)
    return a


V32_BAD = [
    ("query width", dict(query=torch.zeros(2, 4, 512).to(BF16)), ValueError,
     "query must have shape"),
    ("dtype mismatch", dict(kv_cache=torch.zeros(2, 64, 576).to(torch.float8_e4m3fn)),
     TypeError, "kv_cache dtype must match query dtype"),
    ("cache width", dict(kv_cache=torch.zeros(2, 64, 512).to(BF16)), ValueError,
     "kv_cache head dim must be 576"),
    ("negative count", dict(seq_lens=torch.tensor([3, -1], dtype=I32)), ValueError,
     "seq_lens .* must be >= 0"),
    ("table rows", dict(block_tables=torch.zeros(3, 8, dtype=I32)), ValueError,
     "block_tables must hold one row"),
    ("slot beyond cache", dict(block_tables=torch.full((2, 8), 128, dtype=I32)), ValueError,
     "is not a row of its pool"),
    ("heads > 128", dict(query=torch.zeros(2, 130, 576).to(BF16),
                         out=torch.full((2, 130, 512), SENTINEL, dtype=BF16)),
     ValueError, "130 heads"),
]


@pytest.mark.parametrize("what,over,exc,msg", V32_BAD, ids=[b[0] for b in V32_BAD])
def test_v32_rejects_bad_input_and_writes_nothing(what, over, exc, msg):
    a = _v32_args(**over)
    out = a["out"]
    with pytest.raises(exc, match=msg):
        td.trtllm_decode_v32(a["query"], a["kv_cache"], a["block_tables"], a["seq_lens"], out,
                             impl="reference")
    assert bool((out == SENTINEL).all())


def test_v32_wrapper_checks_flashinfer_arguments():
    a = _v32_args()
    with pytest.raises(ValueError, match="sparse_mla_top_k = 4 must equal"):
        td.trtllm_batch_decode_with_kv_cache_mla(a["query"], a["kv_cache"], None, 128, 512, 64,
                                                 a["block_tables"], a["seq_lens"], 8, 4)
    with pytest.raises(ValueError, match="kv_lora_rank 512, qk_rope_head_dim 64"):
        td.trtllm_batch_decode_with_kv_cache_mla(a["query"], a["kv_cache"], None, 128, 512, 0,
                                                 a["block_tables"], a["seq_lens"], 8, 8)


# ---- opcheck
# torch.library.opcheck for both ops on CPU tensors; the bench's small cases run and agree.


def _dsv4_args(varlen, fp8=False):
    g = seeded(0)
    dt = torch.float8_e4m3fn if fp8 else BF16
    q = torch.randn(3, 4, 512, generator=g).to(dt)
    idx = torch.randint(-1, 128, (3, 132), generator=g, dtype=I32)
    lens = torch.tensor([130, 128, 132], dtype=I32)
    swa = torch.randn(2, 64, 512, generator=g).to(dt)
    cmp = torch.randn(2, 64, 512, generator=g).to(dt)
    out = torch.empty(3, 4, 512, dtype=BF16)
    sinks = torch.randn(4, generator=g)
    if varlen:
        return (q, swa, idx, cmp, lens, torch.tensor([5, 9], dtype=I32), out, 0.05, None, 1.0,
                None, sinks, "HND", torch.tensor([0, 1, 3], dtype=I32), 2, None, "reference")
    return (q.view(3, 1, 4, 512), swa.unsqueeze(1), idx, cmp.unsqueeze(1), lens,
            torch.tensor([5, 9, 1], dtype=I32), out.view(3, 1, 4, 512), 0.05,
            torch.tensor([0.04]), 1.0, torch.tensor([2.0]), None, "HND", None, None, None,
            "reference")


CASES = {
    "dsv4_varlen_bf16": (torch.ops.sparse_mla.trtllm_decode_dsv4, _dsv4_args(True, False)),
    # bf16 only: opcheck's test_schema multiplies inputs, which CPU torch cannot do for e4m3
    # ("mul_cpu_reduced_float" not implemented); fp8 numerics are in test_reference.py.
    "dsv4_dense_tensor_scales": (torch.ops.sparse_mla.trtllm_decode_dsv4,
                                 _dsv4_args(False, False)),
    "v32": (torch.ops.sparse_mla.trtllm_decode_v32,
            (torch.randn(2, 4, 576).to(BF16), torch.randn(2, 32, 576).to(BF16),
             torch.tensor([[0, 5, -1, 7], [1, 2, 3, 63]], dtype=I32),
             torch.tensor([3, 4], dtype=I32), torch.empty(2, 4, 512, dtype=BF16), 0.04, None,
             1.0, None, None, None, None, None, "reference")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name):
    op, args = CASES[name]
    torch.library.opcheck(op, args)


def test_bench_cases_small_run_and_agree():
    from sparse_mla.ops.trtllm_decode import bench
    cs = bench.cases("cpu", small=True)
    assert {c.op for c in cs} == {"trtllm_decode_dsv4"} and len(cs) == 2
    for c in cs:
        a = c.run(c.make(), "reference")
        b = c.run(c.make(), "reference")
        assert c.compare(a, b) == 0 and c.bytes > 0 and c.flops > 0 and c.reference
        assert torch.isfinite(a[0].float()).all() and a[0].float().abs().sum() > 0


def test_bench_full_grid_shapes():
    """The GPU grid: 2 dtypes x (h, compressed) 4 x batch 4, reference only up to 64 tokens."""
    from sparse_mla.ops.trtllm_decode import bench
    cs = bench.cases("cpu", small=False)
    assert len(cs) == 32
    assert sum(c.reference for c in cs) == 16         # batch 1 and 4 (2 and 8 tokens)
    c = next(c for c in cs if c.shape == "bf16 h=128 W=128+1024 B=64 s_q=2")
    assert c.flops == 4 * 128 * 512 * (128 + 1024) * 128
    assert c.bytes == 128 * (1152 * 1024 + 128 * 512 * 2 + 128 * 512 * 2)
