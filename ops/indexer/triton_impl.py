"""The indexer ops' Triton implementations: launchers of triton_kernels.py with the ops'
signatures. ops.py validates the arguments before these run.

The scores kernels write selection keys (triton_kernels.py); the top-k over them is
triton_select.py's radix select (K up to ``triton_select.MAX_K``), else ``torch.topk`` over
the int64 keys: both exact by construction and free of host syncs. Prefill runs one chunk of
tokens at a time. ``bench.py`` times each stage apart and the whole op.
"""
from __future__ import annotations

import torch
import triton

from sparse_mla.ops.common import checks
from sparse_mla.ops.common.dispatch import triton_interpreting
from sparse_mla.ops.common.triton_utils import soft_fp8
from sparse_mla.ops.indexer import format as fmt
from sparse_mla.ops.indexer import triton_select
from sparse_mla.ops.indexer.triton_kernels import (NOT_A_CANDIDATE, decode_keys_kernel,
                                                   k_insert_kernel, prefill_keys_kernel)

_LAUNCH = dict(enable_fp_fusion=False)

# prefill: BT tokens x BN entries per program; a prefill program reads every head's q rows once
# per BN entries, so a wider BN moves less. decode: TILES tiles of BN entries of one request
# per program, its tokens' q loaded once and all of them in one dot per tile (a key tile is read
# once for every token): on an H200 at b 64 x 16k entries, s_q 1 / 2 / 4, 86 / 119 / 222 us
# against 96 / 166 / 244 for one tile per program and a dot per token. A program that looped
# over 4,096 entries to select among them itself ran 2.9x slower (the block-table lookups
# serialize its loads). Decode puts the heads on the dot's N axis ([BN, 128] keys as stored
# times [128, heads] q) on the archs in ``decode_heads_n_archs`` (heads on M took 2-3x as long
# on an H200); elsewhere, and on the software e4m3 route, heads on M (heads on N spilled
# 200-216 B of registers at sm_120 under Triton 3.9, against 32-64 on M:
# tests/ops/test_arch_compile.py). ``decode_heads_n`` True / False forces one orientation.
# Measured with lab/tools/indexer_speed.py --sweep (lab/perf-log.md, "The indexer at the
# step's speed").
# The top-k: triton_select's kernels wherever K <= triton_select.MAX_K (8,192 x 16k prefill
# keys on an H200: 3.6 ms against torch.topk's 4.3), else ``torch.topk`` over the keys. A
# prefill chunk (``chunk=0``) holds ``prefill_chunk_bytes`` of keys.
CONFIG = {"prefill_bt": 64, "prefill_bn": 128, "prefill_warps": 4, "prefill_stages": 2,
          "prefill_chunk_bytes": 1 << 30,
          "decode_bn": 64, "decode_tiles": 4, "decode_warps": 4, "decode_heads_n": None,
          "decode_token_cols": 128,
          "decode_heads_n_archs": (90,),
          "insert_tokens": 4, "insert_warps": 1}
# the interpreter: small tiles keep it quick
INTERPRET_CONFIG = {"prefill_bt": 16, "prefill_bn": 16, "decode_bn": 16, "decode_tiles": 2}


def _config(device):
    if device.type == "cpu":
        return {**CONFIG, **INTERPRET_CONFIG}
    return CONFIG


def decode_heads_n(arch: int, soft: bool) -> bool:
    """Whether the decode scores kernel puts the heads on the dot's N axis at ``arch`` (major
    x 10 + minor; 0: the interpreter) on the software e4m3 route or not (see ``CONFIG``)."""
    forced = CONFIG["decode_heads_n"]
    if forced is not None:
        return bool(forced)
    return arch in CONFIG["decode_heads_n_archs"] and not soft


def decode_tiles(heads_n: bool, cfg=CONFIG) -> int:
    """Tiles per decode program: ``cfg["decode_tiles"]`` with the heads on N; one with the
    heads on M, where four unrolled tiles spilled 2.8 KB of registers at sm_80 (Triton 3.9)."""
    return cfg["decode_tiles"] if heads_n else 1


def decode_token_group(next_n: int, hp: int, cfg=CONFIG) -> int:
    """Tokens of a request one decode program scores (a power of two): all ``next_n`` while
    their q (tokens x ``hp`` padded heads) fits in ``cfg["decode_token_cols"]`` rows of the
    dot, else as many as fit (at least one). 128 is s_q 2 at 64 heads, the launch that
    tests/ops/test_arch_compile.py bounds on sm_80-120. All 8 tokens of a draft in one program
    (512 rows) took 136 KB of shared memory (over sm_86 / 89 / 120's 99 KB) and spilled 20 KB
    of registers at sm_90 (7 KB at sm_80; Triton 3.9). The groups of a request read the same
    key tiles: a draft of 8 reads them 8 / group times, not 8."""
    nt = triton.next_power_of_2(next_n)
    return max(1, min(nt, cfg["decode_token_cols"] // hp))


def _arch(device) -> int:
    if device.type != "cuda" or triton_interpreting():
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _cache_args(k_cache, block_size):
    """(fp8?, the cache as the kernels take it, bytes or rows between blocks, between
    entries): fp8 pages as bytes addressed through ``stride(0)``, bf16 rows as they are."""
    if k_cache.dtype == torch.bfloat16:
        return False, k_cache, k_cache.stride(0), k_cache.stride(1)
    cache = k_cache.view(torch.uint8) if k_cache.dtype != torch.uint8 else k_cache
    return True, cache, checks.block_stride(k_cache, fmt.FP8, block_size), fmt.DIM


def select(keys: torch.Tensor, out: torch.Tensor, lim: torch.Tensor | None = None) -> None:
    """``out`` [n, K] <- the top-K columns of ``keys`` [n, width], columns from ``lim[row]``
    on not candidates (the scores kernels also write them as such): triton_select.py's kernels
    (``keys`` overwritten) where K allows, else ``torch.topk``."""
    if triton_select.selectable(out.shape[1]):
        triton_select.select_topk(keys, out, lim)
    else:
        select_from_keys(keys, out)


def select_from_keys(keys: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` [n, K] <- the ids (decoded from the keys) of the K largest keys of each row, in
    key order, -1 where the key says "not a candidate" and for columns beyond the keys'
    width."""
    k = min(out.shape[1], keys.shape[1])
    if k:
        vals = torch.topk(keys, k, dim=1, largest=True, sorted=True).values
        ids = 0xFFFFFFFF - (vals & 0xFFFFFFFF)
        out[:, :k] = torch.where(vals == NOT_A_CANDIDATE, -1, ids).to(out.dtype)
    if k < out.shape[1]:
        out[:, k:] = -1


def k_insert(k, k_cache, slot_mapping, block_size):
    n = slot_mapping.shape[0]
    if n == 0:
        return
    fp8, cache, s0, s1 = _cache_args(k_cache, block_size)
    tpp = CONFIG["insert_tokens"]
    k_insert_kernel[(triton.cdiv(n, tpp),)](
        k, k.stride(0), cache, s0, s1, slot_mapping, n, k_cache.shape[0] * block_size,
        block_size, FP8=fp8, TPP=tpp, SOFT=soft_fp8(k.device),
        num_warps=CONFIG["insert_warps"], **_LAUNCH)


def topk_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, ratio, out,
                 chunk, max_seqlen_k):
    n = q.shape[0]
    if n == 0:
        return
    width = max_seqlen_k
    if width is None:        # one host sync; pass max_seqlen_k to avoid it
        lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        width = int(lens.max()) if lens.numel() else 0
    if width == 0:
        out.fill_(-1)
        return
    rows = min(chunk or fmt.auto_chunk(width, _config(q.device)["prefill_chunk_bytes"]), n)
    keys = torch.empty(rows, width, dtype=torch.int64, device=q.device)
    lim = torch.empty(rows, dtype=torch.int32, device=q.device)
    for s in range(0, n, rows):
        m = min(rows, n - s)
        prefill_keys(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, ratio, s,
                     keys[:m], lim[:m])
        select(keys[:m], out[s:s + m], lim[:m])


def prefill_keys(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, ratio, start,
                 keys, lim):
    """Selection keys of tokens ``start..start + keys.shape[0]`` into ``keys`` [m, width] and
    each token's candidate count (min(C_r, (p + 1) // ratio), 0 outside every request) into
    ``lim`` [m]: the scores half of a prefill chunk, one launch, the requests found on the
    device."""
    m, width = keys.shape
    cfg = _config(q.device)
    kfp8 = k.dtype != torch.bfloat16
    bt, bn = cfg["prefill_bt"], cfg["prefill_bn"]
    n_req = cu_seqlens_q.shape[0] - 1
    prefill_keys_kernel[(triton.cdiv(m, bt), triton.cdiv(width, bn))](
        _bytes(q), q.stride(0), q.stride(1), weights, weights.stride(0), _bytes(k), k.stride(0),
        k_scale if kfp8 else weights, cu_seqlens_q, cu_seqlens_k, positions, keys,
        keys.stride(0), lim, start, m, n_req, (n_req + 1).bit_length(), ratio, q.shape[1],
        width, BT=bt, BN=bn, QFP8=q.dtype == torch.float8_e4m3fn, KFP8=kfp8,
        SOFT=soft_fp8(q.device), DOT_F32=triton_interpreting(),
        num_warps=cfg["prefill_warps"], num_stages=cfg["prefill_stages"], **_LAUNCH)


def decode_keys(q, weights, k_cache, seq_lens, block_table, ratio, next_n, block_size, width):
    """(selection keys [B * next_n, width], lim [B * next_n] int32) of a decode step (the
    scores half of the op): token t's candidates are columns below ``lim[t]``."""
    n = q.shape[0]
    keys = torch.empty(n, width, dtype=torch.int64, device=q.device)
    lim = torch.empty(n, dtype=torch.int32, device=q.device)
    batch = n // next_n
    if batch == 0 or width == 0:
        return keys, lim.fill_(0)
    cfg = _config(q.device)
    kfp8, cache, s0, s1 = _cache_args(k_cache, block_size)
    hp = max(16, triton.next_power_of_2(q.shape[1]))
    bn = cfg["decode_bn"]
    soft = soft_fp8(q.device)
    heads_n = decode_heads_n(_arch(q.device), soft)
    tiles = decode_tiles(heads_n, cfg)
    nt = decode_token_group(next_n, hp, cfg)
    decode_keys_kernel[(batch, triton.cdiv(width, bn * tiles), triton.cdiv(next_n, nt))](
        _bytes(q), q.stride(0), q.stride(1), weights, weights.stride(0), cache, s0, s1,
        k_cache.shape[0], block_table, block_table.stride(0), block_table.shape[1], seq_lens,
        keys, keys.stride(0), lim, q.shape[1], width, ratio, block_size, NEXT_N=next_n,
        NT=nt, HP=hp, BN=bn, TILES=tiles, HEADS_N=heads_n,
        QFP8=q.dtype == torch.float8_e4m3fn,
        KFP8=kfp8, SOFT=soft, DOT_F32=triton_interpreting(),
        num_warps=cfg["decode_warps"], **_LAUNCH)
    return keys, lim


def topk_decode(q, weights, k_cache, seq_lens, block_table, ratio, next_n, out, block_size,
                max_candidates):
    width = fmt.decode_width(block_table, block_size, max_candidates)
    keys, lim = decode_keys(q, weights, k_cache, seq_lens, block_table, ratio, next_n,
                            block_size, width)
    select(keys, out, lim)
