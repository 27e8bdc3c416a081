"""The step oracle: a layer's attention computed densely, in float64, from the step's raw
inputs and the history of rows each request has written — never from the caches the backend
wrote, so a wrong slot, index or block table shows up as a wrong answer.

Per token at position p: keys = its window, positions ``[max(p - W + 1, 0), p]``, plus its
compressed set (C4A: the indexer's ids; C128A: entries ``0 .. (p+1)//128 - 1``), each key the
row exactly as the cache holds it (584 B: bf16, then the UE8M0 tile quantizer; plain: bf16, or
e4m3 of ``row / kv_scale`` times ``kv_scale``; DeepSeek-V4.1's 528 B / 288 B records from the
fp32 row, written here from docs/semantics.md §12 with torch's own e4m3 cast and an e2m1
table, not the project's encoders). Softmax with the head's sink, scale 512^-0.5.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common import formats, quant

NOPE = 448


def rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved) RoPE on the last 64 dims in float32, as docs/semantics.md §3.1 has
    the writers compute it (each product rounded, then the sum): the rows then round to the
    same bf16 as the kernels' rows, instead of differing in a last bit (and so in a tile's
    scale)."""
    x = x.float().clone()
    ev, od = x[..., NOPE::2].clone(), x[..., NOPE + 1::2].clone()
    c, s = cos_sin[..., :32].float(), cos_sin[..., 32:].float()
    x[..., NOPE::2] = ev * c - od * s
    x[..., NOPE + 1::2] = ev * s + od * c
    return x


def rms_norm(q: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm in float32 (docs/semantics.md §3.1); the mean of squares summed in
    float64 so it does not depend on the reduction order."""
    q = q.float()
    eps32 = float(torch.tensor(eps, dtype=torch.float32))     # kernels take eps as fp32
    ms = q.double().square().mean(-1, keepdim=True) + eps32
    return q * (1.0 / torch.sqrt(ms)).float()


# e2m1 magnitudes by code (0..7) and the midpoints between neighbours: a midpoint rounds to
# the even code (0, 1.0, 2.0, 4.0).
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E2M1_MIDS = (E2M1[1:] + E2M1[:-1]) / 2


def e4m3_rn(x: torch.Tensor) -> torch.Tensor:
    """float32 values within ±448 → the nearest e4m3fn value, ties to even (torch's cast),
    as float64."""
    return x.float().to(torch.float8_e4m3fn).double()


def mxfp8_key(x: torch.Tensor) -> torch.Tensor:
    """The 528 B record of fp32 rows [n, 512]: per 32 dims the power of two 2^e with
    e = ceil(log2(max(amax, 1e-4) / 448)), each value e4m3_rn(x · 2^-e) · 2^e."""
    t = x.float().reshape(*x.shape[:-1], 16, 32)
    amax = t.abs().amax(-1, keepdim=True).double().clamp_min(float(torch.tensor(1e-4)))
    m, k = torch.frexp(amax / 448)           # amax / 448 = m · 2^k, m in [0.5, 1)
    e = torch.where(m == 0.5, k - 1, k).double()
    scaled = (t.double() * torch.exp2(-e)).clamp(-448, 448)
    return (e4m3_rn(scaled) * torch.exp2(e)).reshape(x.shape)


def nvfp4_key(x: torch.Tensor) -> torch.Tensor:
    """The 288 B record of fp32 rows [n, 512]: per 16 dims s = e4m3_rn(clamp(amax · fl(1/6),
    2^-9, 448)), each value e2m1_rn(fl(x / s)) · s, saturating at 6."""
    t = x.float().reshape(*x.shape[:-1], 32, 16)
    amax = t.abs().amax(-1, keepdim=True)
    s = e4m3_rn((amax * torch.tensor(1 / 6, dtype=torch.float32)).clamp(2.0 ** -9, 448.0))
    r = (t / s.float()).double()             # fp32 division, correctly rounded
    mag = r.abs()
    code = torch.searchsorted(E2M1_MIDS, mag, right=False)     # midpoints below |r|
    tie = (code < 7) & (mag == E2M1_MIDS[code.clamp_max(6)])
    code = torch.where(tie & (code % 2 == 1), code + 1, code)
    return (torch.sign(r) * E2M1[code] * s).reshape(x.shape)


class Storage:
    """How a cache format holds a row (``fmt``: "v4", "v41", "v41_fp4", "plain_bf16",
    "plain_fp8", or a V4.1 record's token-inline layout: the same values). ``swa``: the SWA
    writer's store, whose 528 B record quantizes the row rounded to bf16 (vLLM's CUDA writer;
    the compressed writers quantize the fp32 row)."""

    def __init__(self, fmt: str, kv_scale: float = 1.0, q_scale: float = 1.0,
                 swa: bool = False):
        self.fmt = formats.V41_RECORD_OF.get(fmt, fmt)
        self.kv_scale, self.q_scale, self.swa = kv_scale, q_scale, swa

    def key(self, row: torch.Tensor) -> torch.Tensor:
        """[n, 512] float → the float64 values the attention reads back."""
        if self.fmt == "v41":
            return mxfp8_key(row.to(torch.bfloat16).float() if self.swa else row.float())
        if self.fmt == "v41_fp4":
            return nvfp4_key(row.float())
        x = row.to(torch.bfloat16).float()
        if self.fmt == "v4":
            data, scales = quant.quantize_v4(x)
            nope = quant.dequantize_v4(data, scales).double()[..., :NOPE]
            return torch.cat([nope, x[..., NOPE:].double()], -1)
        if self.fmt == "plain_bf16":
            return x.double()
        q8 = quant.e4m3(row.float() * (1.0 / self.kv_scale)).view(torch.float8_e4m3fn)
        return q8.double() * self.kv_scale

    def query(self, q_rot: torch.Tensor) -> torch.Tensor:
        if self.fmt == "plain_fp8":
            q8 = quant.e4m3(q_rot.float() * (1.0 / self.q_scale)).view(torch.float8_e4m3fn)
            return q8.double() * self.q_scale
        return q_rot.to(torch.bfloat16).double()


def attend(q: torch.Tensor, keys: torch.Tensor, sink: torch.Tensor, scale: float):
    """q [H, 512], keys [n, 512] float64 → out [H, 512] float64 (zeros without keys)."""
    if keys.shape[0] == 0:
        return torch.zeros_like(q)
    s = scale * (q @ keys.T)
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ keys
    return o * torch.sigmoid(lse - sink.double()).unsqueeze(-1)
