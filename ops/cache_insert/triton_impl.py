"""The cache-insert ops' Triton implementations: launchers of the kernels in triton_kernels.py
with the ops' signatures. ops.py validates the arguments before these run."""
from __future__ import annotations

import torch
import triton

from sparse_mla.ops.cache_insert.triton_kernels import (MODE_PLAIN_BF16, MODE_PLAIN_FP8,
                                                        MODE_V4, MODE_V41, MODE_V41_FP4,
                                                        compressed_insert_kernel,
                                                        fused_insert_kernel,
                                                        gather_dequant_kernel,
                                                        plain_insert_kernel, v4_insert_kernel,
                                                        v32_insert_kernel)
from sparse_mla.ops.common import checks, formats
from sparse_mla.ops.common.triton_utils import soft_fp8

# No fused multiply-add (triton_kernels.py's exactness rules): products round like PyTorch's.
_LAUNCH = dict(enable_fp_fusion=False)

# Launch shapes, swept with lab/tools/tune_insert.py (lab/perf-log.md, "First numbers: cache
# insert and index combine", "What the tuning showed"): the fused q path is fastest with 2 heads
# and 1 warp per program (more warps lose to the fp64 norm), the row inserts with 4 tokens on
# 1 warp, the gather with 4 tokens per program.
CONFIG = {"heads_per_program": 2, "num_warps": 1, "insert_warps": 1, "tokens_per_program": 4,
          "gather_tokens": 4}


def _bytes(cache):
    return cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache


def quantize_insert_v4(k, k_cache, slot_mapping, block_size):
    n = slot_mapping.shape[0]
    if n == 0:
        return
    stride0 = checks.block_stride(k_cache, formats.V4, block_size)
    tpp = CONFIG["tokens_per_program"]
    v4_insert_kernel[(triton.cdiv(n, tpp),)](
        k, k.stride(0), _bytes(k_cache), stride0, slot_mapping, n, k_cache.shape[0] * block_size,
        block_size, TPP=tpp, SOFT=soft_fp8(k.device), num_warps=CONFIG["insert_warps"], **_LAUNCH)


def insert_plain(k, k_cache, slot_mapping, kv_scale):
    n = slot_mapping.shape[0]
    if n == 0:
        return
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    tpp = CONFIG["tokens_per_program"]
    plain_insert_kernel[(triton.cdiv(n, tpp),)](
        k, k.stride(0), k_cache.view(torch.uint8) if fp8 else k_cache, k_cache.stride(0),
        k_cache.stride(1), slot_mapping, n, nb * bs, bs, kv_scale if fp8 else slot_mapping,
        FP8=fp8, TPP=tpp, SOFT=soft_fp8(k.device), num_warps=CONFIG["insert_warps"], **_LAUNCH)


def quantize_insert_v32(kv_c, k_pe, kv_cache, slot_mapping, block_size, scale_format):
    n = slot_mapping.shape[0]
    if n == 0:
        return
    stride0 = checks.block_stride(kv_cache, formats.V32, block_size)
    tpp = CONFIG["tokens_per_program"]
    v32_insert_kernel[(triton.cdiv(n, tpp),)](
        kv_c, kv_c.stride(0), k_pe, k_pe.stride(0), _bytes(kv_cache), stride0, slot_mapping, n,
        kv_cache.shape[0] * block_size, block_size, TPP=tpp, POW2=scale_format == "pow2",
        SOFT=soft_fp8(kv_c.device), num_warps=CONFIG["insert_warps"], **_LAUNCH)


def quantize_insert_v32_nope(kv_c, kv_cache, slot_mapping, block_size, scale_format):
    n = slot_mapping.shape[0]
    if n == 0:
        return
    stride0 = checks.block_stride(kv_cache, formats.V32, block_size)
    tpp = CONFIG["tokens_per_program"]
    v32_insert_kernel[(triton.cdiv(n, tpp),)](
        kv_c, kv_c.stride(0), kv_c, 0, _bytes(kv_cache), stride0, slot_mapping, n,
        kv_cache.shape[0] * block_size, block_size, TPP=tpp, POW2=scale_format == "pow2",
        SOFT=soft_fp8(kv_c.device), NOPE=True, num_warps=CONFIG["insert_warps"], **_LAUNCH)


def _head_block(hp):
    return min(triton.next_power_of_2(max(hp, 1)), CONFIG["heads_per_program"])


def _launch_fused(q, kv, cache, c_s0, c_s1, bs, capacity, slot_mapping, positions, cos_sin_cache,
                  q_out, kv_scale, q_scale_inv, eps, apply_q_norm, mode, inline=False):
    n = q.shape[0]
    if n == 0:
        return
    hp = q_out.shape[1]
    hb = _head_block(hp)
    dummy = cos_sin_cache
    fused_insert_kernel[(n, triton.cdiv(hp, hb) + 1)](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), cache, c_s0, c_s1, slot_mapping,
        slot_mapping.shape[0], capacity, positions, cos_sin_cache, cos_sin_cache.stride(0),
        cos_sin_cache.shape[0], q_out.view(torch.uint8) if mode == MODE_PLAIN_FP8 else q_out,
        q_out.stride(0), q_out.stride(1),
        dummy if kv_scale is None else kv_scale, dummy if q_scale_inv is None else q_scale_inv,
        float(eps), q.shape[1], hp, bs,
        HB=hb, MODE=mode, APPLY_NORM=bool(apply_q_norm), SOFT=soft_fp8(q.device),
        INLINE=inline, num_warps=CONFIG["num_warps"],
        **_LAUNCH)


def fused_insert_v4(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out, eps,
                    block_size, apply_q_norm):
    stride0 = checks.block_stride(k_cache, formats.V4, block_size)
    _launch_fused(q, kv, _bytes(k_cache), stride0, 0, block_size,
                  k_cache.shape[0] * block_size, slot_mapping, positions, cos_sin_cache, q_out,
                  None, None, eps, apply_q_norm, MODE_V4)


def fused_insert_plain(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                       kv_scale, q_scale_inv, eps, apply_q_norm):
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    cache = k_cache.view(torch.uint8) if fp8 else k_cache
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    _launch_fused(q, kv, cache, k_cache.stride(0), k_cache.stride(1), bs, nb * bs,
                  slot_mapping, positions, cos_sin_cache, q_out, kv_scale, q_scale_inv, eps,
                  apply_q_norm, MODE_PLAIN_FP8 if fp8 else MODE_PLAIN_BF16)


# each cache format's kernel mode (triton_kernels.MODE_*): both layouts of a V4.1 record share
# its mode, the kernels' INLINE flag tells them apart (_inline)
MODES = {"v4": MODE_V4, "v41": MODE_V41, "v41_fp4": MODE_V41_FP4, "v41_inline": MODE_V41,
         "v41_fp4_inline": MODE_V41_FP4, "plain_bf16": MODE_PLAIN_BF16,
         "plain_fp8": MODE_PLAIN_FP8}


def _inline(fmt_name) -> bool:
    """A V4.1 record stored token-inline (vLLM 0.33) rather than page-footer (vLLM 0.32)."""
    fmt = formats.get_format(fmt_name)
    return fmt_name in formats.V41_RECORD_OF and not fmt.scale_in_tail


def fused_insert_v41(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out, block_size,
                     fmt_name):
    fmt = formats.get_format(fmt_name)
    stride0 = checks.block_stride(k_cache, fmt, block_size)
    _launch_fused(q, kv, _bytes(k_cache), stride0, 0, block_size,
                  k_cache.shape[0] * block_size, slot_mapping, positions, cos_sin_cache, q_out,
                  None, None, 0.0, False, MODES[fmt_name], _inline(fmt_name))


def compressed_insert_v41(k, k_cache, slot_mapping, positions, cos_sin_cache, ratio, block_size,
                          fmt_name, kv_scale):
    n = slot_mapping.shape[0]
    if n == 0:
        return
    fmt = formats.get_format(fmt_name)
    if isinstance(fmt, formats.PagedFormat):
        cache, s0, s1 = _bytes(k_cache), checks.block_stride(k_cache, fmt, block_size), 0
        bs = block_size
    else:
        cache = k_cache.view(torch.uint8) if fmt_name == "plain_fp8" else k_cache
        s0, s1, bs = k_cache.stride(0), k_cache.stride(1), k_cache.shape[1]
    tpp = CONFIG["tokens_per_program"]
    compressed_insert_kernel[(triton.cdiv(n, tpp),)](
        k, k.stride(0), cache, s0, s1, slot_mapping, n, k_cache.shape[0] * bs, bs, positions,
        cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0], ratio,
        slot_mapping if kv_scale is None else kv_scale, MODE=MODES[fmt_name], TPP=tpp,
        SOFT=soft_fp8(k.device), INLINE=_inline(fmt_name), num_warps=CONFIG["insert_warps"],
        **_LAUNCH)


def gather_dequant(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                   fmt_name):
    fmt = formats.get_format(fmt_name)
    r, max_tokens = out.shape[0], out.shape[1]
    span = max_tokens - offset
    if r == 0 or span <= 0:
        return
    tb = CONFIG["gather_tokens"]
    gather_dequant_kernel[(r, triton.cdiv(span, tb))](
        out, out.stride(0), out.stride(1), _bytes(k_cache),
        checks.block_stride(k_cache, fmt, block_size), k_cache.shape[0], seq_lens,
        seq_lens if gather_lens is None else gather_lens, block_table, block_table.stride(0),
        block_table.shape[1], block_size, offset, max_tokens,
        MODE=MODES.get(fmt_name, -1), HAS_GLEN=gather_lens is not None, TB=tb,
        SOFT=soft_fp8(out.device), INLINE=_inline(fmt_name), num_warps=4, **_LAUNCH)
