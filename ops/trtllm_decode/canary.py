"""The canaries of FlashInfer's TRTLLM-gen routes (``dispatch.Canary``): one small decode per op
that FlashInfer's own input checks accept (heads 64, TOPK 192 = 128 SWA + 64 compressed
columns, lengths >= 128, page size 64), compared with the Triton answer at the tolerance the
op's tests use (docs/semantics.md §9: out ``atol 1e-2, rtol 2/128``)."""
from __future__ import annotations

import torch

from sparse_mla.ops.common.dispatch import Canary, allclose_reason
from sparse_mla.ops.trtllm_decode.reference import DSV4_DIM, SWA_COLS, V32_DIM, V_DIM

ATOL, RTOL = 1e-2, 2 / 128
HEADS, PAGE, TOKENS = 64, 64, 2     # 64 heads: a count both FlashInfer routes take as is
I32 = torch.int32


def _gen(device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(65)    # the same values on every build: vendor and Triton get one call
    return g


def _randn(shape, g, device, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device) * scale).to(torch.bfloat16)


def _rows(count, capacity, g, device) -> torch.Tensor:
    """``count`` distinct pool rows of ``[0, capacity)`` per token, [TOKENS, count] int32."""
    return torch.stack([torch.randperm(capacity, generator=g, device=device)[:count]
                        for _ in range(TOKENS)]).to(I32)


def dsv4_call(device) -> tuple:
    """The dispatcher arguments of one DSv4 decode: 2 requests of one token each."""
    device = torch.device(device)
    g = _gen(device)
    swa_pages, cmp_pages, cmp_cols = 4, 2, 64
    query = _randn((TOKENS, 1, HEADS, DSV4_DIM), g, device)
    swa = _randn((swa_pages, PAGE, DSV4_DIM), g, device)
    cmp = _randn((cmp_pages, PAGE, DSV4_DIM), g, device)
    indices = torch.cat([_rows(SWA_COLS, swa_pages * PAGE, g, device),
                         _rows(cmp_cols, cmp_pages * PAGE, g, device)], dim=1).contiguous()
    topk_lens = torch.tensor([SWA_COLS + cmp_cols // 2, SWA_COLS + cmp_cols], dtype=I32,
                             device=device)
    seq_lens = torch.tensor([200, 300], dtype=I32, device=device)
    out = torch.zeros(TOKENS, 1, HEADS, V_DIM, dtype=torch.bfloat16, device=device)
    sinks = torch.randn(HEADS, generator=g, device=device)
    args = (query, swa, indices, cmp, topk_lens, seq_lens, out, DSV4_DIM ** -0.5, None, 1.0,
            None, sinks, "HND", None, None, None)
    return args, {}


def v32_call(device) -> tuple:
    """The dispatcher arguments of one V3.2 decode: 2 tokens, 192 block-table columns."""
    device = torch.device(device)
    g = _gen(device)
    pages, cols = 4, 192
    query = _randn((TOKENS, HEADS, V32_DIM), g, device)
    cache = _randn((pages, PAGE, V32_DIM), g, device)
    tables = _rows(cols, pages * PAGE, g, device)
    seq_lens = torch.tensor([cols // 2 + 32, cols], dtype=I32, device=device)
    out = torch.zeros(TOKENS, HEADS, V_DIM, dtype=torch.bfloat16, device=device)
    args = (query, cache, tables, seq_lens, out, V32_DIM ** -0.5, None, 1.0, None, None, None,
            None, None)
    return args, {}


def _compare_out(position: int):
    def compare(vendor_call, triton_call):
        return allclose_reason("out", vendor_call[0][position], triton_call[0][position],
                               ATOL, RTOL)
    return compare


DSV4 = Canary(dsv4_call, _compare_out(6))
V32 = Canary(v32_call, _compare_out(4))
