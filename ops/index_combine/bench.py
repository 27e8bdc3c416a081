"""Benchmark cases for the index-combine family (ops/common/benchcase.py contract).

small=True: tiny CPU-sized inputs. small=False: decode batch 1, 64, 256 with s_q 1 and 2 and an
8192-token prefill chunk (4 requests of 2048 tokens after 6144 tokens of context). W = 128,
C4A top-k 512 (ratio 4, compressed block 64), C128A (ratio 128, block 2), SWA block 64.
``bytes`` counts int32 outputs written plus the inputs a perfect kernel reads (index rows,
the per-request metadata and the block-table entries it must look up).
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common.benchcase import BenchCase
from sparse_mla.ops.index_combine import ops

I32 = torch.int32
W = 128


def _mismatches(a, b):
    if isinstance(a, (tuple, list)):
        return float(sum(_mismatches(x, y) for x, y in zip(a, b)))
    return float((a.cpu() != b.cpu()).sum())


def _batch(device, n_reqs, q_len, ctx, topk, ratio, swa_bs=64, c_bs=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.full((n_reqs,), ctx + q_len, dtype=I32)
    qsl = torch.arange(n_reqs + 1, dtype=I32) * q_len
    T = n_reqs * q_len
    t2r = torch.arange(n_reqs, dtype=I32).repeat_interleave(q_len)
    pos = (ctx + torch.arange(T) % q_len).to(I32)
    nb_swa = -(-(ctx + q_len) // swa_bs)
    nb_c = -(-((ctx + q_len) // ratio) // c_bs) + 1
    swa_bt = torch.randperm(n_reqs * nb_swa, generator=g).to(I32).view(n_reqs, nb_swa)
    c_bt = torch.randperm(n_reqs * nb_c, generator=g).to(I32).view(n_reqs, nb_c)
    n = torch.clamp((pos.long() + 1) // ratio, max=topk)
    tk = torch.full((T, topk), -1, dtype=I32)
    cand = torch.rand(T, topk, generator=g)
    ids = (cand * ((pos.long() + 1) // ratio).clamp(min=1).unsqueeze(1)).to(I32)
    tk = torch.where(torch.arange(topk) < n.unsqueeze(1), ids, tk)
    valid = torch.ones(T, dtype=torch.bool)
    x = dict(seq=seq, qsl=qsl, t2r=t2r, pos=pos, swa_bt=swa_bt, c_bt=c_bt, topk=tk,
             valid=valid, slot=pos.clone())
    return {k: v.to(device) for k, v in x.items()}, T


def cases(device: str, small: bool) -> list:
    out = []
    if small:
        decode = [(2, 1, 300), (2, 2, 300)]
        prefill = [(2, 16, 40)]
        topk = 64
    else:
        decode = [(b, s, 8192) for b in (1, 64, 256) for s in (1, 2)]
        prefill = [(4, 2048, 6144)]
        topk = 512

    for n_reqs, q, ctx in decode:
        shape = f"decode B={n_reqs} s_q={q} ctx={ctx}"

        def make_swa(n_reqs=n_reqs, q=q, ctx=ctx):
            x, T = _batch(device, n_reqs, q, ctx, topk, 4)
            x["out"] = torch.empty(T, W, dtype=I32, device=device)
            x["lens"] = torch.empty(T, dtype=I32, device=device)
            return x

        def run_swa(x, impl):
            ops.swa_indices_and_lens(x["qsl"], x["seq"], x["t2r"], x["valid"], x["swa_bt"],
                                     x["out"], x["lens"], 64, W, 0, impl)
            return x["out"], x["lens"]     # the CLI copies what it keeps: no copy timed
        T = n_reqs * q
        out.append(BenchCase("swa_indices_and_lens", shape, make_swa, run_swa,
                             bytes=T * (W + 1) * 4 * 2 + T * 16, compare=_mismatches,
                             error_unit="mismatches"))

        def make_topk(n_reqs=n_reqs, q=q, ctx=ctx):
            x, T = _batch(device, n_reqs, q, ctx, topk, 4)
            x["out"] = torch.empty(T, topk, dtype=I32, device=device)
            x["lens"] = torch.empty(T, dtype=I32, device=device)
            return x

        def run_topk(x, impl):
            ops.global_topk_indices_and_lens(x["topk"], x["t2r"], x["c_bt"], x["valid"],
                                             x["out"], x["lens"], 64, impl)
            return x["out"], x["lens"]     # the CLI copies what it keeps: no copy timed
        out.append(BenchCase("global_topk_indices_and_lens", shape, make_topk, run_topk,
                             bytes=T * topk * 4 * 3 + T * 16, compare=_mismatches,
                             error_unit="mismatches"))

        width = ops.c128a_width(ctx + q, 128)

        def make_c128a(n_reqs=n_reqs, q=q, ctx=ctx, width=width):
            x, T = _batch(device, n_reqs, q, ctx, topk, 128, c_bs=2)
            x["out"] = torch.empty(T, width, dtype=I32, device=device)
            x["lens"] = torch.empty(T, dtype=I32, device=device)
            x["pre"] = torch.empty(0, width, dtype=I32, device=device)
            return x

        def run_c128a(x, impl):
            ops.c128a_indices_and_lens(x["pos"], x["slot"], x["t2r"], x["c_bt"], x["out"],
                                       x["lens"], x["pre"], 2, 128, impl)
            return x["out"], x["lens"]     # the CLI copies what it keeps: no copy timed
        n_c = min((ctx + q) // 128, width)
        out.append(BenchCase("c128a_indices_and_lens", shape, make_c128a, run_c128a,
                             bytes=T * width * 4 + T * 16 + T * (n_c // 2 + 1) * 4,
                             compare=_mismatches, error_unit="mismatches"))

        def make_mixed(n_reqs=n_reqs, q=q, ctx=ctx):
            x, T = _batch(device, n_reqs, q, ctx, topk, 4)
            x["dswa"] = torch.randint(0, 10 ** 6, (T, W), dtype=I32,
                                      generator=torch.Generator().manual_seed(1)).to(device)
            x["out"] = torch.empty(T, ops.mixed_width(W, topk, topk), dtype=I32, device=device)
            x["lens"] = torch.empty(T, dtype=I32, device=device)
            x["nopre"] = torch.empty(0, topk, dtype=I32, device=device)
            return x

        def run_mixed(x, impl):
            ops.flashinfer_mixed_sparse_indices(
                x["dswa"], x["topk"], None, x["nopre"], x["qsl"], x["seq"], x["t2r"],
                x["swa_bt"], x["c_bt"], x["valid"], x["out"], x["lens"], 64, 64, W, 4, topk,
                True, None, None, impl)
            return x["out"], x["lens"]     # the CLI copies what it keeps: no copy timed
        out.append(BenchCase("flashinfer_mixed_sparse_indices", shape, make_mixed, run_mixed,
                             bytes=T * (W + topk) * 4 * 2 + T * topk * 4 + T * 16,
                             compare=_mismatches, error_unit="mismatches"))

    for n_reqs, q, ctx in prefill:
        T = n_reqs * q
        shape = f"prefill {n_reqs}x{q} tokens ctx={ctx}"
        CT = ops.combined_width(topk, W)

        def make_combine(n_reqs=n_reqs, q=q, ctx=ctx, CT=CT):
            x, T = _batch(device, n_reqs, q, ctx, topk, 4)
            x["gl"] = torch.full((n_reqs,), q + min(ctx, W - 1), dtype=I32, device=device)
            x["N"] = (ctx + q) // 4
            x["M"] = x["N"] + q + W
            x["out"] = torch.empty(T, CT, dtype=I32, device=device)
            x["lens"] = torch.empty(T, dtype=I32, device=device)
            return x

        def run_combine(x, impl):
            ops.combine_topk_swa_indices(x["topk"], x["qsl"], x["seq"], x["gl"], x["out"],
                                         x["lens"], W, 4, topk, x["M"], x["N"], impl)
            return x["out"], x["lens"]     # the CLI copies what it keeps: no copy timed
        out.append(BenchCase("combine_topk_swa_indices", shape, make_combine, run_combine,
                             bytes=T * (CT + 1) * 4 + T * topk * 4, compare=_mismatches,
                             error_unit="mismatches"))

        def make_pswa(n_reqs=n_reqs, q=q, ctx=ctx):
            x, T = _batch(device, n_reqs, q, ctx, topk, 4)
            x["out"] = torch.empty(T, W, dtype=I32, device=device)
            x["lens"] = torch.empty(T, dtype=I32, device=device)
            return x
        out.append(BenchCase("swa_indices_and_lens", shape, make_pswa, run_swa,
                             bytes=T * (W + 1) * 4 * 2 + T * 16, compare=_mismatches,
                             error_unit="mismatches"))
    return out
