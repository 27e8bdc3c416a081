"""Exact Triton helpers (software e4m3/bf16 rounding, power-of-two math) against torch, and the
launch-residency arithmetic."""
import contextlib

import pytest
import torch
import triton
import triton.language as tl

from sparse_mla.ops.common import quant
from sparse_mla.ops.common import triton_utils
from sparse_mla.ops.common.triton_utils import (RESERVED_SHARED_PER_CTA, SHARED_WITHOUT_OPT_IN,
                                                bf16_soft, ceil_log2, e4m3_bits, e4m3_bits_soft,
                                                e4m3_decode, e4m3_to_f32_soft,
                                                residency_shared_bytes)
from sparse_mla.tests.helpers import triton_params


@triton.jit
def _convert(x_ptr, e4_ptr, e4_hw_ptr, bf_ptr, lg_ptr, N: tl.constexpr, HW: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(x_ptr + o)
    sat = tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(e4_ptr + o, e4m3_bits_soft(sat))
    if HW:
        tl.store(e4_hw_ptr + o, e4m3_bits(sat, False))
    tl.store(bf_ptr + o, bf16_soft(x))
    tl.store(lg_ptr + o, ceil_log2(tl.abs(x) + 1e-30))


def _inputs(n):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)].sort().values
    mids = (codes[1:] + codes[:-1]) / 2                  # ties: round half to even
    g = torch.Generator().manual_seed(0)
    scales = torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    rand = torch.randn(n, generator=g) * scales
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 1e-30, float("nan"), 2.0 ** -9, 2.0 ** -10])
    x = torch.cat([codes, mids, special, rand])
    size = triton.next_power_of_2(x.numel())
    return torch.cat([x, torch.zeros(size - x.numel())])


@pytest.mark.parametrize("device", triton_params())
def test_soft_conversions_match_torch_bit_for_bit(device):
    x = _inputs(60000)
    n = x.numel()
    e4 = torch.empty(n, dtype=torch.uint8, device=device)
    e4_hw = torch.empty(n, dtype=torch.uint8, device=device)
    bf = torch.empty(n, dtype=torch.bfloat16, device=device)
    lg = torch.empty(n, dtype=torch.int32, device=device)
    hw = device != "cpu"
    # a raw launch runs on the current GPU: switch to the tensors' one (cuda:1)
    with torch.cuda.device(torch.device(device)) if hw else contextlib.nullcontext():
        _convert[(1,)](x.to(device), e4, e4_hw, bf, lg, n, HW=hw)
    fin = ~x.isnan()
    assert torch.equal(e4.cpu()[fin], quant.e4m3(x)[fin])
    assert (e4.cpu()[~fin] & 0x7F).eq(0x7F).all()
    if hw:                                                # the hardware path agrees as well
        assert torch.equal(e4_hw.cpu()[fin], e4.cpu()[fin])
    assert torch.equal(bf.cpu()[fin].view(torch.int16), x[fin].to(torch.bfloat16).view(torch.int16))
    assert bf.cpu()[~fin].isnan().all()
    assert torch.equal(lg.cpu()[fin], quant.ceil_log2(x.abs() + 1e-30)[fin])


@triton.jit
def _decode(b_ptr, soft_ptr, hw_ptr, N: tl.constexpr, HW: tl.constexpr):
    o = tl.arange(0, N)
    b = tl.load(b_ptr + o)
    tl.store(soft_ptr + o, e4m3_to_f32_soft(b))
    tl.store(soft_ptr + N + o, e4m3_decode(b, True).to(tl.float32))
    if HW:
        tl.store(hw_ptr + o, e4m3_decode(b, False).to(tl.float32))


@pytest.mark.parametrize("device", triton_params())
def test_soft_e4m3_decode_matches_torch_for_every_byte(device):
    """The software decode (what sm_80 / sm_86 run) gives torch's float8_e4m3fn value of every
    byte bit for bit: ±0 with their signs, subnormals, 448, and NaN for 0x7F / 0xFF; on a GPU
    the hardware conversion agrees too."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    hw = device != "cpu"
    soft = torch.empty(512, dtype=torch.float32, device=device)
    hard = torch.empty(256, dtype=torch.float32, device=device)
    with torch.cuda.device(torch.device(device)) if hw else contextlib.nullcontext():
        _decode[(1,)](codes.to(device), soft, hard, 256, HW=hw)
    nan = want.isnan()
    assert nan.sum() == 2 and set(codes[nan].tolist()) == {0x7F, 0xFF}
    for got in (soft.cpu()[:256], soft.cpu()[256:]) + ((hard.cpu(),) if hw else ()):
        assert got[nan].isnan().all()
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@triton.jit
def _e2m1(c_ptr, out_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(out_ptr + o, triton_utils.e2m1_value(tl.load(c_ptr + o)))


@pytest.mark.parametrize("device", triton_params())
def test_e2m1_value_of_every_code_bit_for_bit(device):
    """The NVFP4 nibble decode gives every code's value, -0 for code 8 included (compiled, a
    negated +0.0 came out +0.0 and the 288 B gather wrote +0 where the reference wrote -0)."""
    codes = torch.arange(16, dtype=torch.int32)
    want = quant.e2m1_values(codes)
    got = torch.empty(16, dtype=torch.float32, device=device)
    with torch.cuda.device(torch.device(device)) if device != "cpu" else contextlib.nullcontext():
        _e2m1[(1,)](codes.to(device), got, 16)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
    assert torch.signbit(got.cpu()[8])


def test_soft_fp8_switch(monkeypatch):
    """The software route: interpreted, forced by SPARSE_MLA_SOFT_FP8=1, or a GPU below sm_89
    (named by its arch); the hardware conversion from sm_89 on and for CPU tensors."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(triton_utils.SOFT_FP8_ENV, raising=False)
    cpu = torch.device("cpu")
    assert triton_utils.soft_fp8_reason(cpu) is None and not triton_utils.soft_fp8(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_utils.soft_fp8_reason(cpu) == "interpreter"
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv(triton_utils.SOFT_FP8_ENV, "1")
    assert triton_utils.soft_fp8_reason(cpu) == "forced" and triton_utils.soft_fp8(cpu)
    monkeypatch.setenv(triton_utils.SOFT_FP8_ENV, "0")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    for cap, why in (((8, 0), "sm_80"), ((8, 6), "sm_86"), ((8, 9), None), ((9, 0), None),
                     ((12, 0), None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, cap=cap: cap)
        assert triton_utils.soft_fp8_reason(cuda) == why
    # Triton 3.6 cannot compile sm_89's e4m3 -> bf16 conversion
    assert triton_utils.hardware_fp8((8, 9), "3.7.0") and triton_utils.hardware_fp8((9, 0))
    assert not triton_utils.hardware_fp8((8, 9), "3.6.0")
    assert not triton_utils.hardware_fp8((8, 6), "3.9.0")


@pytest.mark.parametrize("shared_per_sm", [233472, 167936, 102400])  # H100/H200, A100, sm_89
@pytest.mark.parametrize("cap", range(1, 17))
@pytest.mark.parametrize("own", [0, 16384])
def test_residency_shared_bytes_fits_exactly_cap_ctas(shared_per_sm, cap, own):
    """The request lets ``cap`` CTAs share an SM and not one more (each CTA taking its request
    plus the 1 KB reserve, in 128-byte units), stays within the 48 KB a launch may ask for
    without opting in, and is never less than what the kernel uses itself."""
    want = residency_shared_bytes(cap, shared_per_sm, own)
    if want is None:
        smallest = shared_per_sm // (cap + 1) - RESERVED_SHARED_PER_CTA + 128
        assert smallest > SHARED_WITHOUT_OPT_IN or smallest <= own
        return
    alloc = -(-(want + RESERVED_SHARED_PER_CTA) // 128) * 128
    assert cap * alloc <= shared_per_sm < (cap + 1) * alloc
    assert own < want <= SHARED_WITHOUT_OPT_IN


def test_residency_caps_on_hopper():
    """On an H100 / H200 SM (228 KB) caps of 4 to 16 CTAs are expressible; 1-3 are not."""
    got = {cap: residency_shared_bytes(cap, 233472, 0) for cap in range(1, 17)}
    assert [cap for cap, want in got.items() if want is None] == [1, 2, 3]
