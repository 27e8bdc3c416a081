"""Triton helpers shared by the op families: exact power-of-two scale math, e4m3 and bf16 rounding.

Everything here is bit-exact against the PyTorch reference. Two traps are handled on purpose:
* ``log2``/``exp2`` are approximate on GPUs, so power-of-two exponents come from the fp32 bits;
* GPUs below sm_89 (Ampere) have no e4m3 conversion at all: Triton refuses to compile
  ``tl.float8e4nv`` for them. Triton's CPU interpreter (TRITON_INTERPRET=1) has one, but rounds
  fp32→e4m3 wrongly when the mantissa carries into the exponent (125.6 → 64 instead of 128).
  Kernels therefore take a ``SOFT`` constexpr (``soft_fp8``): where set, e4m3 is encoded and
  decoded with integer arithmetic, bit-identical to the hardware conversion; elsewhere the
  hardware conversion runs (its code is untouched by the flag). The interpreter also truncates
  fp32→bf16 instead of rounding: ``to_bf16`` handles that the same way.
"""
import re

import torch
import triton
import triton.language as tl

from sparse_mla.ops.common.dispatch import SOFT_FP8_ENV  # noqa: F401  (callers name it here)
from sparse_mla.ops.common.dispatch import soft_fp8_forced, triton_interpreting


# The first capability whose Triton compiles e4m3 conversions (Ada)
HARDWARE_FP8_CAPABILITY = (8, 9)
# Triton 3.6 lowers e4m3 -> bf16 for sm_89 through a cvt.bf16.f16 that ptxas takes only from
# sm_90 on (the portable kernel over plain e4m3 rows did not compile: lab/tools/ptx_digest.py);
# 3.9 compiles it, 3.7 and 3.8 were not tried. Below this release sm_89 takes the software route.
SM89_HARDWARE_FP8_TRITON = (3, 7)


def _triton_release(version: str):
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def hardware_fp8(cap, version: str = triton.__version__) -> bool:
    """Whether kernels for GPU capability ``cap`` ((major, minor)) convert e4m3 in hardware
    when compiled by Triton ``version``."""
    if tuple(cap) == (8, 9):
        return _triton_release(version) >= SM89_HARDWARE_FP8_TRITON
    return tuple(cap) >= HARDWARE_FP8_CAPABILITY


def soft_fp8_reason(device=None):
    """Why kernels launched on ``device`` (a torch device; None: the current CUDA device where
    there is one) encode and decode e4m3 in software: "interpreter", "forced" (``SOFT_FP8_ENV``)
    or the GPU's arch ("sm_80"); None where the hardware conversion runs."""
    if triton_interpreting():
        return "interpreter"
    if soft_fp8_forced():
        return "forced"
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    if hardware_fp8(cap, triton.__version__):
        return None
    if cap >= HARDWARE_FP8_CAPABILITY:
        return f"sm_{cap[0]}{cap[1]}, Triton {triton.__version__}"
    return f"sm_{cap[0]}{cap[1]}"


def soft_fp8(device=None) -> bool:
    """Whether kernels launched on ``device`` take the software e4m3 route (``SOFT``):
    interpreted, forced by ``SPARSE_MLA_SOFT_FP8=1``, or a GPU without e4m3 conversions
    (below sm_89; sm_89 under Triton 3.6: ``hardware_fp8``)."""
    return soft_fp8_reason(device) is not None


@triton.jit
def ceil_log2(t):
    """Exact ``ceil(log2(t))`` (int32) for positive normal fp32 ``t``."""
    bits = t.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    return exp + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def exp2_int(e):
    """Exact fp32 ``2**e`` for int32 ``e`` in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_scale(sb):
    """The fp32 factor 2^(sb - 127) of UE8M0 scale bytes ``sb`` (int32 in [0, 255]), exactly:
    byte 0 is the subnormal 2^-127 (``exp2_int`` would give 0), 255 is inf."""
    return tl.where(sb == 0, 0x400000, sb << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits_soft(x):
    """Round-to-nearest-even fp32 → e4m3fn byte for |x| <= 448 (callers clamp); NaN → 0x7F."""
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80)
    a = tl.abs(x)
    # Subnormals (|x| < 2^-6) are multiples of 2^-9: round a * 2^9 to an integer, ties to even,
    # with the 2^23 trick (exact for 0 <= y < 2^23). Mantissa 8 encodes the smallest normal.
    y = a * 512.0
    sub = ((y + 8388608.0) - 8388608.0).to(tl.int32)
    abits = a.to(tl.int32, bitcast=True)
    exp = ((abits >> 23) & 0xFF) - 127 + 7
    man = abits & 0x7FFFFF
    keep = man >> 20
    rest = man & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))
    normal = ((exp << 3) | keep) + up.to(tl.int32)
    mag = tl.where(a < 0.015625, sub, normal)
    mag = tl.where(x != x, 0x7F, mag)
    return (mag | sign).to(tl.uint8)


@triton.jit
def e4m3_to_f32_soft(b):
    """e4m3fn bytes ``b`` (any integer type; the low 8 bits count) → fp32 with integer
    arithmetic, exactly as the hardware decodes them: subnormals, ±0, NaN for 0x7F / 0xFF."""
    b = b.to(tl.int32) & 0xFF
    sign = (b & 0x80) << 24
    exp = (b >> 3) & 0xF
    man = b & 0x7
    # a normal byte's value (1 + man/8) * 2^(exp - 7) as fp32 bits: rebias the exponent by 120
    normal = sign | ((exp + 120) << 23) | (man << 20)
    # a subnormal's is man * 2^-9 (exact in fp32); the sign goes on by bits so -0 stays -0
    sub = (man.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | sign
    bits = tl.where(exp == 0, sub, normal)
    bits = tl.where((b & 0x7F) == 0x7F, 0x7FC00000 | sign, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_to_f16_soft(b):
    """e4m3fn bytes ``b`` (any integer type; the low 8 bits count) → fp16, exactly as the
    hardware decodes them, in fewer operations than ``e4m3_to_f32_soft``: the byte's exponent
    and mantissa placed in fp16's fields read as 2^-8 times the value — subnormals included,
    since fp16 keeps its own subnormals — so one fp16 multiply by 2^8 finishes it (the
    conversion Ampere inference kernels use for fp8 weights). 0x7F / 0xFF, which that would
    read as ±480, are NaN."""
    b = b.to(tl.int16) & 0xFF
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    y = bits.to(tl.float16, bitcast=True) * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), y).to(tl.float16)


@triton.jit
def e4m3_decode(b, SOFT: tl.constexpr):
    """e4m3fn bytes ``b`` (uint8) decoded: fp16 in software where ``SOFT`` (exact), else the
    hardware's fp8 values (the caller converts them on, as the kernels always did)."""
    if SOFT:
        y = e4m3_to_f16_soft(b)
    else:
        y = b.to(tl.float8e4nv, bitcast=True)
    return y


@triton.jit
def e4m3_bits(x, SOFT: tl.constexpr):
    """fp32 (already clamped to ±448) → e4m3fn byte, round to nearest even."""
    if SOFT:
        return e4m3_bits_soft(x)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def e2m1_value(code):
    """fp32 values of e2m1 codes (int32, low 4 bits; bit 3 the sign): magnitude codes 0-3 are
    code / 2, codes 4-7 are 2, 3, 4, 6 (the 288 B NVFP4 record, docs/semantics.md §12)."""
    m = code & 7
    big = (4 + 2 * (m & 1)).to(tl.float32) * tl.where(m >= 6, 1.0, 0.5)
    v = tl.where(m < 4, m.to(tl.float32) * 0.5, big)
    # the sign goes on by bits: compiled, a negation of +0.0 gave +0.0 (code 8 is -0; found on
    # an H200, where the interpreter had kept it)
    sign = (code & 8).to(tl.int32) << 28
    return (v.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def bf16_soft(x):
    """Round-to-nearest-even fp32 → bf16 with integer arithmetic (NaN stays NaN)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    hi = tl.where(x != x, 0x7FC0, (rounded >> 16) & 0xFFFF)
    return hi.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_bf16(x, SOFT: tl.constexpr):
    """fp32 → bf16, round to nearest even (the interpreter's own cast truncates)."""
    if SOFT:
        return bf16_soft(x)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def e4m3_sat(x, SOFT: tl.constexpr):
    """Saturating fp32 → e4m3fn byte (clamp to ±448, NaN stays NaN), like torch's reference."""
    return e4m3_bits(tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL), SOFT)


# Programmatic dependent launch (sm_90+): a kernel launched with ``launch_pdl=True`` may start
# while the kernel before it finishes, and waits in ``grid_wait`` until that kernel's writes
# are visible; the earlier kernel lets it start with ``grid_launch_dependents``. Written as
# inline PTX (what ``triton.language.extra.cuda.gdc_*`` emit) so the Gluon kernel can use them
# too; both are no-ops when the launch did not ask for PDL.
@triton.jit
def grid_wait():
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def grid_launch_dependents():
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


def pdl_supported(device) -> bool:
    """Whether launches on ``device`` may use PDL: CUDA sm_90 or newer, not interpreted."""
    return (device.type == "cuda" and not triton_interpreting()
            and torch.cuda.get_device_capability(device) >= (9, 0))


# What an sm_80 / sm_90 SM reserves of its shared memory per resident CTA, and the most dynamic
# shared memory a launch may ask for without opting the kernel in
RESERVED_SHARED_PER_CTA = 1024
SHARED_WITHOUT_OPT_IN = 48 * 1024


def residency_shared_bytes(ctas_per_sm, shared_per_sm, own):
    """Dynamic shared memory per CTA that lets at most ``ctas_per_sm`` CTAs of a kernel reside
    on an SM of ``shared_per_sm`` bytes (``own``: what the kernel uses itself; the SM
    allocates in 128-byte units plus ``RESERVED_SHARED_PER_CTA`` each), or None where the cap
    would take more than ``SHARED_WITHOUT_OPT_IN`` or does not bind (no more than ``own``)."""
    want = shared_per_sm // (ctas_per_sm + 1) - RESERVED_SHARED_PER_CTA + 128
    if want > SHARED_WITHOUT_OPT_IN or want <= own:
        return None
    return want


def launch_compiled(kernel, fn, grid, args, kwargs):
    """Launch ``kernel`` (``fn`` compiled by ``fn.warmup(*args, **kwargs)``) over ``grid``
    without a second pass through Triton's argument binding: every parameter in signature
    order, constexprs included, as the compiled launcher takes them."""
    params = list(args) + [kwargs[name] for name in fn.arg_names[len(args):]]
    kernel[tuple(grid) + (1, ) * (3 - len(grid))](*params)


def launch_capped(fn, grid, args, kwargs, ctas_per_sm):
    """Launch the Triton kernel ``fn`` over ``grid`` with at most ``ctas_per_sm`` of its CTAs on
    any SM, by asking for more dynamic shared memory than it uses (``residency_shared_bytes``;
    an ordinary launch where that is not possible). ``warmup`` finds or compiles the kernel,
    whose launch metadata's shared-memory size is set for this launch only (the compiled
    kernel is shared by every launch of its specialization)."""
    per_sm = getattr(torch.cuda.get_device_properties(args[0].device),
                     "shared_memory_per_multiprocessor", None)
    if not per_sm or residency_shared_bytes(ctas_per_sm, per_sm, 0) is None:
        fn[grid](*args, **kwargs)
        return
    kernel = fn.warmup(*args, grid=grid, **kwargs)
    packed = getattr(kernel, "packed_metadata", None)
    # Triton 3.6's NVIDIA launch metadata: (warps, CTAs per cluster, shared bytes)
    want = None
    if isinstance(packed, tuple) and len(packed) == 3:
        want = residency_shared_bytes(ctas_per_sm, per_sm, packed[2])
    if want is None:
        launch_compiled(kernel, fn, grid, args, kwargs)
        return
    kernel.packed_metadata = (packed[0], packed[1], want)
    try:
        launch_compiled(kernel, fn, grid, args, kwargs)
    finally:
        kernel.packed_metadata = packed


@triton.jit
def v41_record_addrs(base, off, BS, DATA: tl.constexpr, SCALES: tl.constexpr,
                     INLINE: tl.constexpr):
    """(data, scales) byte pointers of token(s) ``off`` of a V4.1 block at ``base``: a page
    footer (BS data rows, then BS scale rows: vLLM 0.32's "v41" / "v41_fp4") or token-inline
    ([data | scales] per token: vLLM 0.33's "v41_inline" / "v41_fp4_inline"). The inserts,
    the gather and the attention kernels all address the records through it."""
    if INLINE:
        rec = base + off * (DATA + SCALES)
        return rec, rec + DATA
    else:
        return base + off * DATA, base + BS * DATA + off * SCALES
