"""Bad inputs raise clear errors (TypeError / ValueError naming the argument) before anything
is written to ``out``."""
import pytest
import torch

from sparse_mla.ops import trtllm_decode as td
from sparse_mla.tests.ops.trtllm_decode.expect import I32

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
