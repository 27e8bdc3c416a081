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


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4.1 records (docs/semantics.md §12), written from the layout; inputs are the fp32
# rows the writers quantize (already rotated, not rounded to bf16 first).

# e2m1 magnitudes by code (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# vLLM's NVFP4 writer clamps amax / 6 to [2^-9 (the smallest e4m3 subnormal), 448]
NVFP4_SCALE_MIN = 2.0 ** -9
MXFP8_AMAX_FLOOR = 1e-4


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    """The fp32 constant ``v`` (rounded once, as a kernel's literal is) on ``like``'s device."""
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def quantize_v41(x: torch.Tensor):
    """528 B MXFP8 writer for fp32 rows ``x`` [N, 512]: returns ``(data [N, 512] uint8,
    scales [N, 16] uint8)``. Per 32 dims: amax = max(max|x|, 1e-4), e = ceil(log2(amax / 448))
    exactly, byte = e4m3_rn(clamp(x * 2^-e, ±448)), scale byte = clamp(e + 127, 0, 255)."""
    n = x.shape[0]
    t = x.float().reshape(n, 16, 32)
    amax = t.abs().amax(dim=-1).clamp_min(_f32(MXFP8_AMAX_FLOOR, t))
    e = ceil_log2(div(amax, formats.E4M3_MAX))
    q = e4m3(t * pow2(-e).unsqueeze(-1)).reshape(n, 512)
    return q, (e + 127).clamp(0, 255).to(torch.uint8)


def dequantize_v41(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``data`` [N, 512], ``scales`` [N, 16] uint8 → bf16 rows [N, 512]: e4m3 · 2^(s - 127)."""
    n = data.shape[0]
    q = data.contiguous().view(FP8).float().reshape(n, 16, 32)
    return (q * pow2(scales.to(torch.int32) - 127).unsqueeze(-1)).reshape(n, 512).to(
        torch.bfloat16)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even, saturating fp32 → e2m1 codes (uint8 0..15; bit 3 the sign, kept
    for values that round to zero). Ties go to the even code: the one whose mantissa bit is 0."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=x.device)
    a = x.abs().clamp(max=E2M1_MAX)
    hi = torch.bucketize(a, grid).clamp(max=7)              # first code with value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    code = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return (code | (torch.signbit(x).to(torch.int64) << 3)).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 ``codes`` (the low 4 bits)."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64) & 0xF
    v = grid[c & 7]
    return torch.where(c >= 8, -v, v)


def quantize_v41_fp4(x: torch.Tensor):
    """288 B NVFP4 writer for fp32 rows ``x`` [N, 512]: returns ``(data [N, 256] uint8,
    scales [N, 32] uint8)``. Per 16 dims: s = e4m3_rn(clamp(amax · fl(1/6), 2^-9, 448)) (vLLM
    multiplies by the fp32 reciprocal), code = e2m1(x / s) with a correctly rounded division;
    byte i = code(2i) | code(2i + 1) << 4."""
    n = x.shape[0]
    t = x.float().reshape(n, 32, 16)
    amax = t.abs().amax(dim=-1)
    s_bytes = e4m3((amax * _f32(1.0 / E2M1_MAX, t)).clamp(NVFP4_SCALE_MIN, formats.E4M3_MAX))
    s = s_bytes.view(FP8).float().unsqueeze(-1)
    codes = e2m1_codes(t / s.expand_as(t)).reshape(n, 256, 2)
    return codes[..., 0] | (codes[..., 1] << 4), s_bytes


def dequantize_v41_fp4(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``data`` [N, 256], ``scales`` [N, 32] uint8 → bf16 rows [N, 512]: e2m1 · e4m3 scale."""
    n = data.shape[0]
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(n, 32, 16)
    s = scales.contiguous().view(FP8).float().unsqueeze(-1)
    return (e2m1_values(codes) * s).reshape(n, 512).to(torch.bfloat16)


def quantize_record(x: torch.Tensor, fmt_name: str):
    """Rows ``x`` [N, 512] (fp32, rotated) as ``(data, scales)`` of a V4 / V4.1 record
    (``fmt_name`` a layout: both layouts of a record share its encoding)."""
    fmt_name = _codec(fmt_name)
    if fmt_name == "v41":
        return quantize_v41(x)
    if fmt_name == "v41_fp4":
        return quantize_v41_fp4(x)
    if fmt_name == "v4":
        return quantize_v4(x)
    raise ValueError(f"no tail-scaled record {fmt_name!r}; expected 'v4', 'v41' or 'v41_fp4'")


def dequantize_record(data: torch.Tensor, scales: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """bf16 rows [N, 512] of a V4 / V4.1 record's ``data`` and ``scales`` bytes."""
    return {"v4": dequantize_v4, "v41": dequantize_v41,
            "v41_fp4": dequantize_v41_fp4}[_codec(fmt_name)](data, scales)


def _codec(fmt_name: str) -> str:
    fmt = formats.PAGED_FORMATS.get(fmt_name)
    return fmt.codec if fmt is not None else fmt_name
