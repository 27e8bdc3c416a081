"""Reference quantizers and dequantizers for the paged formats (docs/semantics.md §2), as
plain PyTorch.

These are the oracle every Triton kernel is compared with byte for byte; they are written to
read like docs/semantics.md §2, one step a line.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common import formats

FP8 = torch.float8_e4m3fn


def ceil_log2(t: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(t))`` for positive finite fp32 ``t`` (int32), via frexp, not log2."""
    mantissa, exponent = torch.frexp(t)          # t = mantissa * 2**exponent, mantissa in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**e`` for integer ``e`` in [-127, 128] built from the float's bits
    (``exp2`` is not exact on every device); -127 gives the subnormal, 128 gives inf."""
    e = e.to(torch.int32)
    bits = ((e + 127).clamp(0, 255) << 23).view(torch.float32)
    return torch.where(e == -127, torch.full_like(bits, 2.0 ** -127), bits)


def div(a: torch.Tensor, b: float) -> torch.Tensor:
    """Correctly rounded ``a / b``. PyTorch's CUDA kernel turns division by a Python scalar
    into multiplication by its reciprocal (one rounding more); a tensor divisor does not."""
    return a / torch.full_like(a, b)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even e4m3fn bytes of fp32 ``x``."""
    return x.clamp(-formats.E4M3_MAX, formats.E4M3_MAX).to(FP8).view(torch.uint8)


def quantize_v4(x: torch.Tensor):
    """docs/semantics.md §2.2 writer for rows ``x`` [N, 512] (any float dtype; already RoPE'd).

    Returns ``(data [N, 576] uint8, scales [N, 8] uint8)``: data = 448 e4m3 NoPE bytes then the
    64 RoPE dims as little-endian bf16; scales = 7 UE8M0 bytes then a zero pad byte.
    """
    n = x.shape[0]
    x = x.to(torch.bfloat16).float()                      # every vLLM writer rounds to bf16 first
    nope = x[:, :formats.NOPE_DIM].reshape(n, 7, 64)
    amax = nope.abs().amax(dim=-1).clamp_min(1e-4)
    e = ceil_log2(div(amax, formats.E4M3_MAX))            # power-of-two scale, rounded up
    q = e4m3(nope * pow2(-e).unsqueeze(-1)).reshape(n, formats.NOPE_DIM)
    rope = x[:, formats.NOPE_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(n, 8, dtype=torch.uint8, device=x.device)
    scales[:, :7] = (e + 127).clamp(0, 255).to(torch.uint8)
    return torch.cat([q, rope], dim=1), scales


def quantize_v32(kv_c: torch.Tensor, k_pe: torch.Tensor, scale_format: str) -> torch.Tensor:
    """docs/semantics.md §2.1 writer: ``kv_c`` [N, 512], ``k_pe`` [N, 64] → records [N, 656] uint8.

    ``scale_format="fp32"``: vLLM's raw ``max(amax/448, FLT_MIN)`` scale, ``q = x / scale``.
    ``scale_format="pow2"``: FlashMLA's test quantizer, ``2**ceil(log2(max(amax/448, 1e-4)))``.
    """
    n = kv_c.shape[0]
    x = kv_c.to(torch.bfloat16).float().reshape(n, 4, 128)
    amax = x.abs().amax(dim=-1)
    if scale_format == "fp32":
        scale = div(amax, formats.E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    elif scale_format == "pow2":
        scale = pow2(ceil_log2(div(amax, formats.E4M3_MAX).clamp_min(1e-4)))
    else:
        raise ValueError(f"scale_format must be 'fp32' or 'pow2', got {scale_format!r}")
    q = e4m3(x / scale.unsqueeze(-1)).reshape(n, 512)
    scale_bytes = scale.contiguous().view(torch.uint8).reshape(n, 16)
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 128)
    return torch.cat([q, scale_bytes, rope], dim=1)


def dequantize_v4(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``data`` [N, 576], ``scales`` [N, 8] uint8 → bf16 rows [N, 512]."""
    n = data.shape[0]
    q = data[:, :formats.NOPE_DIM].contiguous().view(FP8).float().reshape(n, 7, 64)
    scale = pow2(scales[:, :7].to(torch.int32) - 127).unsqueeze(-1)
    nope = (q * scale).reshape(n, formats.NOPE_DIM).to(torch.bfloat16)
    rope = data[:, formats.NOPE_DIM:].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=1)


def dequantize_v32(rec: torch.Tensor) -> torch.Tensor:
    """Records [N, 656] uint8 → bf16 rows [N, 576] (512 dequantized latent + 64 RoPE)."""
    n, f = rec.shape[0], formats.V32
    q = rec[:, :f.data_bytes].contiguous().view(FP8).float().reshape(n, f.num_scales, f.tile)
    scale = rec[:, f.scale_offset:f.rope_offset].contiguous().view(torch.float32)
    nope = (q * scale.reshape(n, f.num_scales, 1)).reshape(n, f.data_bytes).to(torch.bfloat16)
    rope = rec[:, f.rope_offset:f.bytes_per_token].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=1)


def rms_norm_no_weight(q: torch.Tensor, eps: float) -> torch.Tensor:
    """``q * rsqrt(mean(q²) + eps)`` over the last dim, fp32 result.

    The mean is accumulated in fp64 so that it does not depend on summation order: the Triton
    kernel then matches this bit for bit (an fp32 sum would differ in the last bit between
    reduction trees and flip bf16 roundings).
    """
    qf = q.float()
    eps32 = float(torch.tensor(eps, dtype=torch.float32))   # kernels take eps as fp32, as vLLM's
    ms = qf.double().square().mean(dim=-1, keepdim=True) + eps32
    return qf * inv_sqrt(ms).float()


def inv_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(x)`` as the kernels compute it: IEEE square root, then IEEE division.

    torch's CPU ``sqrt`` goes through MKL's vector math, which is not correctly rounded (about
    1 % of random doubles and floats come back 1 ulp off, measured against numpy). torch's CPU
    ``rsqrt`` is the vectorized square root followed by a division, exact in both steps. On
    CUDA it is the other way round: ``rsqrt`` is the approximate intrinsic, ``sqrt`` and the
    division are IEEE.
    """
    if x.device.type == "cpu":
        return torch.rsqrt(x)
    return torch.reciprocal(torch.sqrt(x))


def rope_gptj(x: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """GPT-J (interleaved) RoPE on the last 64 dims of fp32 ``x`` [..., 512].

    ``cos_sin`` [..., 64] fp32 = cos[0:32] || sin[0:32], broadcast against x's leading dims.
    """
    x = x.clone()
    ev = x[..., formats.NOPE_DIM::2]
    od = x[..., formats.NOPE_DIM + 1::2]
    c, s = cos_sin[..., :32], cos_sin[..., 32:]
    if inverse:
        s = -s
    new_ev = ev * c - od * s
    new_od = ev * s + od * c
    x[..., formats.NOPE_DIM::2] = new_ev
    x[..., formats.NOPE_DIM + 1::2] = new_od
    return x
