"""Benchmark cases of the V4.1 indexer family (ops/common/benchcase.py contract).

Shapes (small=False): V4.1-Flash's indexer, 32 heads of 128, top-512, ratio 2, 2048 candidate
blocks of 8, fp8 cache in 64-entry blocks. Decode: batch 64, s_q 1 and 2, 65,536 entries each
(a 128k context); prefill: 2,048 tokens at the end of a 65,536-entry request. Level 2 takes the
candidates the reference's level 1 chose on the same inputs. ``bytes``: the cache / key bytes a
perfect kernel reads (every entry at level 1, the 16,384 candidate positions at level 2) plus
q, weights and what is written; ``flops``: 2 * 128 * heads per (token, scored position).
Inputs come from ops/indexer/bench.py's builders.
"""
from __future__ import annotations

import torch

from sparse_mla.ops.common.benchcase import BenchCase
from sparse_mla.ops.common.errors import ImplementationUnavailable
from sparse_mla.ops.indexer import bench as v4_bench
from sparse_mla.ops.indexer import format as fmt
from sparse_mla.ops.indexer_v41 import ops

HEADS, TOPK, BLOCKS, CB, RATIO = 32, 512, 2048, 8, 2


def _sizes(small):
    if small:      # the stride fuzz interprets these: a few blocks, a short top-k
        return dict(batch=2, cand=40, tokens=6, heads=4, topk=16, blocks=4)
    return dict(batch=64, cand=65536, tokens=2048, heads=HEADS, topk=TOPK, blocks=BLOCKS)


def _decode(device, z, next_n):
    x = v4_bench.decode_inputs(device, z["batch"], next_n, z["cand"], heads=z["heads"])
    # every token's last position sees all ``cand`` entries at ratio 2
    x["seq_lens"] = torch.full_like(x["seq_lens"], z["cand"] * RATIO + next_n - 1)
    t = x["q"].shape[0]
    x["out"] = torch.empty(t, z["topk"], dtype=torch.int32, device=device)
    x["candidates"] = torch.empty(t, z["blocks"], dtype=torch.int32, device=device)
    return x


def _prefill(device, z):
    x = v4_bench.prefill_inputs(device, z["tokens"], z["cand"], heads=z["heads"])
    end = z["cand"] * RATIO                 # the request's last token sees every entry
    x["positions"] = torch.arange(end - z["tokens"], end, device=device)
    x["out"] = torch.empty(z["tokens"], z["topk"], dtype=torch.int32, device=device)
    x["candidates"] = torch.empty(z["tokens"], z["blocks"], dtype=torch.int32, device=device)
    return x


def _run_cand_decode(x, impl):
    ops.indexer_v41_candidates_decode(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                      x["block_table"], x["out"], x["candidates"], RATIO,
                                      x["next_n"], candidate_block=CB, impl=impl)
    return (x["out"], x["candidates"])


def _run_topk_decode(x, impl):
    ops.indexer_v41_topk_in_candidates_decode(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                              x["block_table"], x["candidates"], x["out"],
                                              RATIO, x["next_n"], candidate_block=CB,
                                              impl=impl)
    return (x["out"],)


def _run_cand_prefill(x, impl):
    ops.indexer_v41_candidates_prefill(x["q"], x["weights"], x["k"], x["k_scale"],
                                       x["cu_seqlens_q"], x["cu_seqlens_k"], x["positions"],
                                       x["out"], x["candidates"], RATIO, CB,
                                       max_seqlen_k=x["max_seqlen_k"], impl=impl)
    return (x["out"], x["candidates"])


def _run_topk_prefill(x, impl):
    ops.indexer_v41_topk_in_candidates_prefill(x["q"], x["weights"], x["k"], x["k_scale"],
                                               x["cu_seqlens_q"], x["cu_seqlens_k"],
                                               x["positions"], x["candidates"], x["out"],
                                               RATIO, CB, impl=impl)
    return (x["out"],)


def _with_candidates(make, run_level1):
    """Inputs of a level-2 case: ``make``'s, with the candidates level 1 chose on them (the
    reference, or Triton at sizes the reference would take hours over)."""
    def made(impl="reference"):
        x = make()
        run_level1(x, impl)
        return x
    return made


def _mismatch(ref, out):
    return sum(v4_bench._mismatch_fraction((a,), (b,)) for a, b in zip(ref, out))


def cases(device: str, small: bool) -> list:
    z = _sizes(small)
    t_pos = z["blocks"] * CB
    out = []
    for next_n in (1, 2):
        t = z["batch"] * next_n
        probe = dict(q=torch.empty(t, z["heads"], fmt.DIM), weights=torch.empty(t, z["heads"]),
                     out=torch.empty(t, z["topk"] + z["blocks"]), next_n=next_n)
        shape = f"B={z['batch']} s_q={next_n} C={z['cand']} H={z['heads']} fp8 ratio 2"

        def make(next_n=next_n):
            return _decode(device, z, next_n)
        out.append(BenchCase(
            "indexer_v41_candidates_decode", shape, make, _run_cand_decode,
            bytes=v4_bench.decode_bytes(probe, z["cand"]),
            flops=t * z["cand"] * z["heads"] * fmt.DIM * 2, compare=_mismatch,
            error_unit="ids off the reference's (fraction, top-k + blocks)", tolerance=0.02,
            reference=small))
        probe = {**probe, "out": torch.empty(t, z["topk"])}
        out.append(BenchCase(
            "indexer_v41_topk_in_candidates_decode", shape + f" NB={z['blocks']}",
            _with_candidates(make, _run_cand_decode) if small else
            lambda make=make: _with_candidates(make, _run_cand_decode)("triton"),
            _run_topk_decode, bytes=v4_bench.decode_bytes(probe, min(z["cand"], t_pos)),
            flops=t * min(z["cand"], t_pos) * z["heads"] * fmt.DIM * 2, compare=_mismatch,
            error_unit="ids off the reference's top-k (fraction)", tolerance=0.01,
            reference=small))

    def make_prefill():
        return _prefill(device, z)

    def run_cand_prefill(x, impl):
        if impl == "reference" and not small:
            raise ImplementationUnavailable("the float64 reference",
                                            "the float64 reference takes hours at this size")
        return _run_cand_prefill(x, impl)
    shape = f"T={z['tokens']} C={z['cand']} H={z['heads']} fp8 ratio 2"
    tok_bytes = z["tokens"] * (z["heads"] * (fmt.DIM * 2 + 4) + z["topk"] * 4)
    out.append(BenchCase(
        "indexer_v41_candidates_prefill", shape, make_prefill, run_cand_prefill,
        bytes=tok_bytes + z["cand"] * fmt.FP8.bytes_per_token + z["tokens"] * z["blocks"] * 4,
        flops=z["tokens"] * z["cand"] * z["heads"] * fmt.DIM * 2, compare=_mismatch,
        error_unit="ids off the reference's (fraction, top-k + blocks)", tolerance=0.02,
        reference=small))
    out.append(BenchCase(
        "indexer_v41_topk_in_candidates_prefill", shape + f" NB={z['blocks']}",
        _with_candidates(make_prefill, _run_cand_prefill) if small else
        lambda: _with_candidates(make_prefill, _run_cand_prefill)("triton"),
        _run_topk_prefill,
        bytes=tok_bytes + z["tokens"] * min(z["cand"], t_pos) * fmt.FP8.bytes_per_token,
        flops=z["tokens"] * min(z["cand"], t_pos) * z["heads"] * fmt.DIM * 2,
        compare=_mismatch, error_unit="ids off the reference's top-k (fraction)",
        tolerance=0.01, reference=small))
    return out
