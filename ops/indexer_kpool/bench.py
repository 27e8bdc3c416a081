"""Benchmark / stride-fuzz cases of the kpool indexer family (``cases(device, small)``): a
GPU tool, in no wheel."""
from __future__ import annotations

import torch

from sparse_mla.ops.common.benchcase import BenchCase
from sparse_mla.ops.indexer_kpool import format as fmt
from sparse_mla.ops.indexer_kpool import ops, reference

KPOOL = 4
BLOCK = 64


def _diff(a, b):
    return float(sum((x.cpu() != y.cpu()).sum() for x, y in zip(a, b)))


def insert_inputs(device, reqs, length, num_spec=0, seed=0):
    """``reqs`` whole prefills of ``length`` tokens, rows request-major."""
    g = torch.Generator().manual_seed(seed)
    ring = fmt.ring_size(KPOOL, num_spec)
    n = reqs * length
    pos = torch.arange(length).repeat(reqs)
    req = torch.arange(reqs).repeat_interleave(length)
    pools = -(-length // KPOOL)
    per = -(-pools // BLOCK)
    slot = torch.where(pos % KPOOL == KPOOL - 1, req * per * BLOCK + pos // KPOOL, -1)
    return dict(
        k=torch.randn(n, fmt.DIM, generator=g).to(torch.bfloat16).to(device),
        gate=torch.randn(n, fmt.DIM, generator=g).to(torch.bfloat16).to(device),
        ape=torch.randn(KPOOL, fmt.DIM, generator=g).to(device),
        positions=pos.to(device), slot_mapping=slot.to(device),
        tail_slot_mapping=(req * ring + pos % ring).to(device),
        k_cache=fmt.alloc_cache(reqs * per, BLOCK, device=device, fill=0),
        tail_cache=fmt.alloc_tail_cache(reqs, ring, device=device, fill=0))


def decode_inputs(device, batch, next_n, pools, heads, seed=1):
    g = torch.Generator().manual_seed(seed)
    per = -(-pools // BLOCK)
    cache = fmt.alloc_cache(batch * per, BLOCK, device="cpu", fill=0xFF)
    vals, scales = reference.quantize_rotated(
        torch.randn(batch * per * BLOCK, fmt.DIM, generator=g).to(torch.bfloat16).float())
    page = cache.view(cache.shape[0], -1)
    page[:, :BLOCK * fmt.DIM] = vals.view(-1, BLOCK * fmt.DIM)
    page[:, BLOCK * fmt.DIM:BLOCK * (fmt.DIM + 4)] = (
        reference.scale_bytes(scales, "fp32").view(-1, BLOCK * 4))
    t = batch * next_n
    return dict(
        q=torch.randn(t, heads, fmt.DIM, generator=g).to(torch.bfloat16).to(device),
        weights=torch.randn(t, heads, generator=g).to(device),
        k_cache=cache.to(device),
        seq_lens=torch.randint(next_n, pools * KPOOL + KPOOL, (batch,), generator=g).to(device),
        block_table=torch.randperm(batch * per, generator=g).view(batch, per).int().to(device),
        next_n=next_n)


def cases(device: str, small: bool) -> list:
    out = []
    reqs, length = (2, 11) if small else (16, 4096)

    def make_insert():
        return insert_inputs(device, reqs, length)

    def run_insert(x, impl):
        ops.kpool_k_insert(x["k"], x["gate"], x["ape"], x["positions"], x["slot_mapping"],
                           x["tail_slot_mapping"], x["k_cache"], x["tail_cache"], KPOOL,
                           impl=impl)
        return (x["k_cache"], x["tail_cache"])

    n = reqs * length
    out.append(BenchCase("kpool_k_insert", f"N={n} kpool={KPOOL}", make_insert, run_insert,
                         bytes=n * fmt.DIM * 4 + n // KPOOL * fmt.FP8.bytes_per_token,
                         compare=_diff, error_unit="elements differ"))

    batch, pools, heads, topk = (2, 20, 4, 16) if small else (64, 4096, 32, 2048)
    for next_n in (1, 2):
        def make_decode(next_n=next_n):
            x = decode_inputs(device, batch, next_n, pools, heads)
            x["out"] = torch.empty(batch * next_n, topk + KPOOL - 1, dtype=torch.int32,
                                   device=device)
            return x

        def run_decode(x, impl):
            ops.kpool_topk_decode(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                  x["block_table"], x["out"], KPOOL, x["next_n"], impl=impl)
            return (x["out"],)
        t = batch * next_n
        out.append(BenchCase(
            "kpool_topk_decode", f"B={batch} s_q={next_n} P={pools} H={heads}", make_decode,
            run_decode, bytes=batch * pools * fmt.FP8.bytes_per_token,
            flops=t * pools * heads * fmt.DIM * 2, compare=_diff, error_unit="ids differ"))

    tokens = 12 if small else 8192

    def make_prefill():
        g = torch.Generator().manual_seed(2)
        c = tokens // KPOOL
        vals, scales = reference.quantize_rotated(
            torch.randn(c, fmt.DIM, generator=g).to(torch.bfloat16).float())
        return dict(
            q=torch.randn(tokens, heads, fmt.DIM, generator=g).to(torch.bfloat16).to(device),
            weights=torch.randn(tokens, heads, generator=g).to(device),
            k=vals.to(device), k_scale=scales.to(device),
            cu_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
            cu_k=torch.tensor([0, c], dtype=torch.int32, device=device),
            positions=torch.arange(tokens, device=device),
            out=torch.empty(tokens, topk + KPOOL - 1, dtype=torch.int32, device=device))

    def run_prefill(x, impl):
        ops.kpool_topk_prefill(x["q"], x["weights"], x["k"], x["k_scale"], x["cu_q"],
                               x["cu_k"], x["positions"], x["out"], KPOOL, impl=impl)
        return (x["out"],)
    out.append(BenchCase("kpool_topk_prefill", f"T={tokens} H={heads}", make_prefill,
                         run_prefill, bytes=tokens * heads * fmt.DIM,
                         flops=tokens * tokens // KPOOL * heads * fmt.DIM * 2, compare=_diff,
                         error_unit="ids differ"))
    return out
