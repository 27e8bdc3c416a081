"""The FlashInfer (vendor) path on CPU: the argument translation is pure and checked here
exactly; the dispatcher rejects the vendor here and says why. FlashInfer's kernel itself was
never run (no SM100/SM103 GPU)."""
import pytest
import torch

from sparse_mla.ops import trtllm_decode as td
from sparse_mla.ops.common.dispatch import explain, triton_interpreting
from sparse_mla.ops.common.errors import ImplementationUnavailable
from sparse_mla.tests.ops.trtllm_decode.cases import I32

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


def _dsv4(H, dense=False, cache_dim=3, layout="HND", dtype=BF16, sinks=True):
    q = torch.randn(4, H, 512).to(dtype)
    cache = torch.zeros(2, 64, 512).to(dtype)
    if cache_dim == 4:
        cache = cache.unsqueeze(1) if layout == "HND" else cache.unsqueeze(2)
    a = dict(query=q, swa_kv_cache=cache, sparse_indices=torch.zeros(4, 132, dtype=I32),
             compressed_kv_cache=cache, sparse_topk_lens=torch.full((4,), 130, dtype=I32),
             seq_lens=torch.tensor([3, 7], dtype=I32), out=torch.empty(4, H, 512, dtype=BF16),
             sinks=torch.randn(H) if sinks else None, kv_layout=layout,
             cum_seq_lens_q=torch.tensor([0, 2, 4], dtype=I32), max_q_len=2,
             workspace_buffer=torch.zeros(16, dtype=torch.uint8))
    if dense:
        a.update(query=q.view(2, 2, H, 512), out=a["out"].view(2, 2, H, 512),
                 cum_seq_lens_q=None, max_q_len=None)
    return a


@pytest.mark.parametrize("H,Hp", [(1, 8), (8, 8), (9, 16), (16, 16), (20, 32), (64, 64),
                                  (65, 128), (100, 128), (128, 128)])
def test_dsv4_heads_padded_to_flashinfer_counts(H, Hp):
    a = _dsv4(H)
    plan = td.dsv4_vendor_arguments(**a)
    kw = plan["kwargs"]
    assert plan["function"] == "trtllm_batch_decode_sparse_mla_dsv4"
    assert kw["query"].shape == (4, Hp, 512) and kw["out"].shape == (4, Hp, 512)
    assert kw["sinks"].shape == (Hp,) and kw["sinks"].dtype == torch.float32
    assert torch.equal(kw["query"][:, :H], a["query"])
    if Hp == H:
        assert kw["query"] is a["query"] and kw["out"] is a["out"] and kw["sinks"] is a["sinks"]
        assert plan["copy_out"] is None
    else:
        assert bool((kw["query"][:, H:].float() == 0).all())
        assert bool((kw["sinks"][H:] == float("-inf")).all())
        assert torch.equal(kw["sinks"][:H], a["sinks"])
        padded, out = plan["copy_out"]
        assert padded is kw["out"] and out is a["out"]


def test_dsv4_passes_everything_else_unchanged():
    a = _dsv4(16)
    kw = td.dsv4_vendor_arguments(**a)["kwargs"]
    for name in ("swa_kv_cache", "compressed_kv_cache", "sparse_indices", "sparse_topk_lens",
                 "seq_lens", "cum_seq_lens_q", "workspace_buffer"):
        assert kw[name] is a[name], name
    assert kw["max_q_len"] == 2 and kw["kv_layout"] == "HND" and kw["backend"] == "trtllm-gen"
    assert kw["bmm1_scale"] == 1.0 and isinstance(kw["bmm1_scale"], float)


@pytest.mark.parametrize("cache_dim,layout", [(3, "HND"), (4, "HND"), (4, "NHD")])
def test_dsv4_cache_rank_and_layout_pass_through(cache_dim, layout):
    a = _dsv4(8, cache_dim=cache_dim, layout=layout)
    kw = td.dsv4_vendor_arguments(**a)["kwargs"]
    assert kw["swa_kv_cache"].dim() == cache_dim and kw["kv_layout"] == layout


def test_dsv4_dense_query_and_fp8():
    a = _dsv4(32, dense=True, dtype=E4M3, sinks=False)
    kw = td.dsv4_vendor_arguments(**a)["kwargs"]
    assert kw["query"].shape == (2, 2, 32, 512) and kw["query"].dtype == E4M3
    assert kw["cum_seq_lens_q"] is None and kw["max_q_len"] is None and kw["sinks"] is None


def test_dsv4_float_and_tensor_scales():
    """docs/semantics.md §6: a float passes as a float; a tensor passes as the same fp32 tensor in
    natural units (FlashInfer multiplies it by log2(e) itself — pre-multiplying would be wrong)."""
    a = _dsv4(8)
    kw = td.dsv4_vendor_arguments(**a, bmm1_scale=0.044, bmm2_scale=0.5)["kwargs"]
    assert kw["bmm1_scale"] == 0.044 and kw["bmm2_scale"] == 0.5
    t1, t2 = torch.tensor([0.044]), torch.tensor([0.5])
    kw = td.dsv4_vendor_arguments(**a, bmm1_scale_tensor=t1, bmm2_scale_tensor=t2)["kwargs"]
    assert kw["bmm1_scale"] is t1 and kw["bmm2_scale"] is t2


def test_v32_arguments_match_vllm_call():
    """vLLM FlashInferMLASparseImpl: query.unsqueeze(1), kv_cache.unsqueeze(1), block tables
    [T, 1, K], seq_lens = per-token valid counts, max_seq_len = sparse_mla_top_k = K."""
    q = torch.randn(5, 16, 576).to(BF16)
    cache = torch.zeros(3, 64, 576).to(BF16)
    bt = torch.zeros(5, 2048, dtype=I32)
    seq = torch.full((5,), 7, dtype=I32)
    out = torch.empty(5, 16, 512, dtype=BF16)
    plan = td.v32_vendor_arguments(q, cache, bt, seq, out, 0.04, None, 1.0, None)
    kw = plan["kwargs"]
    assert plan["function"] == "trtllm_batch_decode_with_kv_cache_mla"
    assert kw["query"].shape == (5, 1, 16, 576) and kw["kv_cache"].shape == (3, 1, 64, 576)
    assert kw["block_tables"].shape == (5, 1, 2048) and kw["seq_lens"] is seq
    assert kw["max_seq_len"] == 2048 and kw["sparse_mla_top_k"] == 2048
    assert (kw["qk_nope_head_dim"], kw["kv_lora_rank"], kw["qk_rope_head_dim"]) == (128, 512, 64)
    assert kw["out"].shape == (5, 1, 16, 512) and kw["out"].data_ptr() == out.data_ptr()
    assert kw["bmm1_scale"] == 0.04 and kw["sinks"] is None and plan["copy_out"] is None
    assert "cum_seq_lens_q" not in kw


def test_v32_heads_between_64_and_128_padded():
    q = torch.randn(2, 96, 576).to(BF16)
    out = torch.empty(2, 96, 512, dtype=BF16)
    sinks = torch.zeros(96)
    plan = td.v32_vendor_arguments(q, torch.zeros(1, 64, 576).to(BF16),
                                   torch.zeros(2, 8, dtype=I32), torch.ones(2, dtype=I32), out,
                                   sinks=sinks)
    kw = plan["kwargs"]
    assert kw["query"].shape == (2, 1, 128, 576) and isinstance(kw["sinks"], list)
    assert kw["sinks"][0].shape == (128,) and bool((kw["sinks"][0][96:] == float("-inf")).all())
    assert plan["copy_out"][1].shape == (2, 1, 96, 512)


def test_vendor_rejected_here_with_reason():
    a = _dsv4(8)
    args = (a["query"], a["swa_kv_cache"], a["sparse_indices"], a["compressed_kv_cache"],
            a["sparse_topk_lens"], a["seq_lens"], a["out"], 1.0, None, 1.0, None, a["sinks"],
            "HND", a["cum_seq_lens_q"], 2, None)
    choice = explain("trtllm_decode_dsv4", *args)
    # CPU tensors: the reference, or Triton where its interpreter is on (TRITON_INTERPRET=1)
    assert choice.impl == ("triton" if triton_interpreting() else "reference")
    assert "SM100/SM103" in choice.rejected["vendor"]
    assert "flashinfer" in choice.rejected["vendor"]
    assert "never run" in choice.rejected["vendor"]
    with pytest.raises(ImplementationUnavailable, match="needs an SM100/SM103 GPU"):
        td.trtllm_decode_dsv4(*args, "vendor")
