"""DeepSeek-V4's indexer q quantization (vLLM's ``fused_indexer_q_rope_quant``, FP8 path) in
plain PyTorch, for GPUs whose Triton cannot emit e4m3 (below sm_89).

vLLM 0.32.0 / 0.33.0 (models/deepseek_v4/common/ops/fused_indexer_q.py) compute, per (token,
head) of ``q [T, H, D]``: GPT-J (interleaved) RoPE on the last ``rope_dim`` dims (cos / sin
the two halves of the cache row at the token's position; ``even' = fma(even, cos, -(odd *
sin))``, ``odd' = fma(odd, cos, even * sin)``: what vLLM's CPU kernel computes (checked
byte for byte) and its ROCm path writes explicitly; its CUDA Triton kernel asks for fp
fusion, which contracts the same way — not checked on a GPU here), rounded to bf16; the first
``D - rope_dim`` dims pass through; ``scale`` = the smallest power of two >=
``max(amax, 1e-4) / 448``; ``q8 = e4m3(x / scale)``; and ``w_out = w * scale * softmax_scale *
head_scale`` (fp32, multiplied in that order). Every step here is exact in PyTorch on any
device: the fused multiply-add is emulated exactly in fp64 (``fma32``), division by a power
of two is exact, and PyTorch's e4m3 cast rounds to
nearest even in software, so no e4m3 hardware is needed. The power of two comes from
``frexp``, not from ``log2``, so it is the exact ceiling, never an approximation's.

``tests/integration/vllm/test_indexer_layer.py`` compares the bytes with vLLM's CPU kernel
``fused_indexer_q_rope_quant_cpu``.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def q_rope_quant(positions, q, cos_sin_cache, weights, softmax_scale, head_scale):
    """``(q8 [T, H, D] float8_e4m3fn, w_out [T, H] fp32)``, as vLLM's FP8 path."""
    if q.ndim != 3:
        raise ValueError(f"q: expected [T, H, D], got shape {tuple(q.shape)}")
    if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] % 2 or \
            cos_sin_cache.shape[1] > q.shape[2]:
        raise ValueError(f"cos_sin_cache: expected [positions, rope_dim] with an even rope_dim "
                         f"<= {q.shape[2]}, got {tuple(cos_sin_cache.shape)}")
    if positions.shape != q.shape[:1]:
        raise ValueError(f"positions: expected shape {tuple(q.shape[:1])}, got "
                         f"{tuple(positions.shape)}")
    if weights.shape != q.shape[:2]:
        raise ValueError(f"weights: expected shape {tuple(q.shape[:2])}, got "
                         f"{tuple(weights.shape)}")
    half = cos_sin_cache.shape[1] // 2
    nope = q.shape[2] - 2 * half
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x = q.float()
    even, odd = x[..., nope::2], x[..., nope + 1::2]
    r_even = fma32(even, cos, -(odd * sin)).bfloat16().float()
    r_odd = fma32(odd, cos, even * sin).bfloat16().float()
    rot = torch.stack((r_even, r_odd), dim=-1).flatten(-2)
    y = torch.cat((x[..., :nope], rot), dim=-1)
    scale = pow2_ceil(y.abs().amax(dim=-1).clamp_min(AMAX_FLOOR) / FP8_MAX)
    q8 = (y / scale[..., None]).to(torch.float8_e4m3fn)
    w = weights.float() * scale
    w = w * softmax_scale
    w = w * head_scale
    return q8, w


def fma32(a, b, c):
    """``a * b + c`` rounded once to fp32 (fp32 inputs): what a fused multiply-add gives.

    The product is exact in fp64; the fp64 sum is rounded to odd (its error from TwoSum,
    the last bit forced to 1 where inexact), which makes the final rounding to fp32 a
    correct single rounding (53 >= 24 + 2 bits), never a double rounding."""
    ab = a.double() * b.double()
    c = c.double().expand_as(ab)
    s = ab + c
    bv = s - ab
    err = (ab - (s - bv)) + (c - bv)
    even = (s.view(torch.int64) & 1) == 0
    s = torch.where((err != 0) & even, torch.nextafter(s, s + err), s)
    return s.float()


def pow2_ceil(s):
    """The smallest power of two >= ``s`` (positive fp32), exactly."""
    mant, exp = torch.frexp(s.float())    # s = mant * 2**exp, mant in [0.5, 1)
    e = exp - (mant == 0.5).to(exp.dtype)
    # 2**e as fp32 bits: exact (s >= 1e-4 / 448 keeps it a normal number)
    return ((e + 127).to(torch.int32) << 23).view(torch.float32)
