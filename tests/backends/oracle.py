"""The step oracle: a layer's attention computed densely, in float64, from the step's raw
inputs and the history of rows each request has written — never from the caches the backend
wrote, so a wrong slot, index or block table shows up as a wrong answer.

Per token at position p: keys = its window, positions ``[max(p - W + 1, 0), p]``, plus its
compressed set (C4A: the indexer's ids; C128A: entries ``0 .. (p+1)//128 - 1``), each key the
row exactly as the cache holds it (584 B: bf16, then the UE8M0 tile quantizer; plain: bf16, or
e4m3 of ``row / kv_scale`` times ``kv_scale``). Softmax with the head's sink, scale 512^-0.5.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common import quant

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


class Storage:
    """How a cache format holds a row (``fmt``: "v4", "plain_bf16", "plain_fp8")."""

    def __init__(self, fmt: str, kv_scale: float = 1.0, q_scale: float = 1.0):
        self.fmt, self.kv_scale, self.q_scale = fmt, kv_scale, q_scale

    def key(self, row: torch.Tensor) -> torch.Tensor:
        """[n, 512] float → the float64 values the attention reads back."""
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
