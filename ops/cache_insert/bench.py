"""Benchmark / CLI cases for the cache-insert family (see ops/common/benchcase.py)."""
from __future__ import annotations

import torch

from sparse_mla.ops.cache_insert import ops
from sparse_mla.ops.common import formats
from sparse_mla.ops.common.benchcase import BenchCase

SWA_BLOCK = 64


def _mismatches(a, b):
    return sum(int((x.view(torch.uint8) != y.view(torch.uint8)).sum()) for x, y in zip(a, b))


def _storage(t):
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(t.untyped_storage())


def _cos_sin(device, max_pos=8192):
    """A RoPE table of random unit vectors, (1 - t², 2t) / (1 + t²) with a random sign on the
    first half: products, sums and divisions only, which round the same on every run. torch's
    CPU cos, sin and sqrt go through MKL's vector math: with sqrt, a process's first table
    differed from its later ones (same seed) in about half its elements, one thread's share,
    in 7 of 103 CLI runs on a busy 2-core machine, and the main job's reference-against-
    reference check failed (with cos / sin before, about one run in eight)."""
    t = torch.rand(max_pos, 32, device=device) * 2 - 1
    sign = torch.where(torch.rand(max_pos, 32, device=device) < 0.5, -1.0, 1.0)
    one_plus = 1 + t * t
    return torch.cat([(1 - t * t) / one_plus * sign, 2 * t / one_plus], dim=1)


def _v4_insert_case(n, device):
    nb = n // SWA_BLOCK + 1

    def make():
        return dict(k=torch.randn(n, 512, device=device).to(torch.bfloat16),
                    cache=formats.alloc_paged_cache("v4", nb, SWA_BLOCK, device=device, fill=0),
                    slots=torch.randperm(nb * SWA_BLOCK, device=device)[:n])

    def run(a, impl):
        ops.quantize_insert_v4(a["k"], a["cache"], a["slots"], impl=impl)
        return (_storage(a["cache"]),)

    return BenchCase("quantize_insert_v4", f"N={n}", make, run,
                     bytes=n * (1024 + 584 + 8), compare=_mismatches, error_unit="bytes differ")


def _fused_v4_case(n, heads, device, check):
    nb = n // SWA_BLOCK + 1

    def make():
        return dict(q=torch.randn(n, heads, 512, device=device).to(torch.bfloat16),
                    kv=torch.randn(n, 512, device=device).to(torch.bfloat16),
                    cache=formats.alloc_paged_cache("v4", nb, SWA_BLOCK, device=device, fill=0),
                    slots=torch.randperm(nb * SWA_BLOCK, device=device)[:n],
                    pos=torch.randint(0, 8192, (n,), device=device),
                    cs=_cos_sin(device),
                    q_out=torch.empty(n, heads, 512, dtype=torch.bfloat16, device=device))

    def run(a, impl):
        ops.fused_qnorm_rope_insert_v4(a["q"], a["kv"], a["cache"], a["slots"], a["pos"], a["cs"],
                                       a["q_out"], impl=impl)
        return a["q_out"], _storage(a["cache"])

    return BenchCase("fused_qnorm_rope_insert_v4", f"N={n} H={heads}", make, run,
                     bytes=n * (heads * 1024 * 2 + 1024 + 584 + 16), compare=_mismatches,
                     error_unit="bytes differ", reference=check)


def _v32_insert_case(n, device):
    nb = n // SWA_BLOCK + 1

    def make():
        return dict(kv_c=torch.randn(n, 512, device=device).to(torch.bfloat16),
                    k_pe=torch.randn(n, 64, device=device).to(torch.bfloat16),
                    cache=formats.alloc_paged_cache("v32", nb, SWA_BLOCK, device=device, fill=0),
                    slots=torch.randperm(nb * SWA_BLOCK, device=device)[:n])

    def run(a, impl):
        ops.quantize_insert_v32(a["kv_c"], a["k_pe"], a["cache"], a["slots"], impl=impl)
        return (_storage(a["cache"]),)

    return BenchCase("quantize_insert_v32", f"N={n}", make, run, bytes=n * (1152 + 656 + 8),
                     compare=_mismatches, error_unit="bytes differ")


def _plain_case(n, heads, fp8, device, check):
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    nb = n // SWA_BLOCK + 1

    def make():
        a = dict(q=torch.randn(n, heads, 512, device=device).to(torch.bfloat16),
                 kv=torch.randn(n, 512, device=device).to(torch.bfloat16),
                 cache=torch.zeros(nb, SWA_BLOCK, 512, device=device).to(dt),
                 slots=torch.randperm(nb * SWA_BLOCK, device=device)[:n],
                 pos=torch.randint(0, 8192, (n,), device=device), cs=_cos_sin(device),
                 q_out=torch.empty(n, heads, 512, dtype=dt, device=device))
        if fp8:
            a["scales"] = (torch.tensor([0.02], device=device), torch.tensor([2.0], device=device))
        return a

    def run(a, impl):
        ops.fused_qnorm_rope_insert_plain(a["q"], a["kv"], a["cache"], a["slots"], a["pos"],
                                          a["cs"], a["q_out"], *a.get("scales", ()), impl=impl)
        return a["q_out"], a["cache"]

    esz = 1 if fp8 else 2
    return BenchCase("fused_qnorm_rope_insert_plain", f"N={n} H={heads} {dt}".replace(
        "torch.", ""), make, run, bytes=n * (heads * 512 * (2 + esz) + 1024 + 512 * esz + 16),
        compare=_mismatches, error_unit="bytes differ", reference=check)


def _gather_case(reqs, seq_len, fmt, device):
    f = formats.get_format(fmt)
    blocks_per_req = seq_len // SWA_BLOCK + 1
    nb = reqs * blocks_per_req

    def make():
        cache = formats.alloc_paged_cache(fmt, nb, SWA_BLOCK, device=device, fill=0)
        raw = torch.empty(0, dtype=torch.uint8, device=device).set_(cache.untyped_storage())
        raw.copy_(torch.randint(0, 0x70, raw.shape, dtype=torch.uint8, device=device))
        return dict(cache=cache,
                    out=torch.empty(reqs, seq_len, f.out_dim, dtype=torch.bfloat16, device=device),
                    seq_lens=torch.full((reqs,), seq_len, dtype=torch.int32, device=device),
                    bt=torch.randperm(nb, device=device).to(torch.int32).view(reqs, -1))

    def run(a, impl):
        ops.gather_dequant(a["out"], a["cache"], a["seq_lens"], None, a["bt"], cache_format=fmt,
                           impl=impl)
        return (a["out"],)

    return BenchCase("gather_dequant", f"{fmt} R={reqs} T={seq_len}", make, run,
                     bytes=reqs * seq_len * (f.bytes_per_token + 2 * f.out_dim),
                     compare=_mismatches, error_unit="bytes differ")


def cases(device: str, small: bool):
    if small:
        return [_v4_insert_case(64, device), _fused_v4_case(16, 8, device, True),
                _v32_insert_case(64, device), _plain_case(16, 8, True, device, True),
                _gather_case(2, 100, "v4", device)]
    out = [_v4_insert_case(n, device) for n in (1, 64, 4096, 65536)]
    out += [_fused_v4_case(n, 64, device, n <= 4096) for n in (1, 64, 4096, 65536)]
    out += [_fused_v4_case(4096, 128, device, True)]
    out += [_v32_insert_case(n, device) for n in (64, 4096, 65536)]
    out += [_plain_case(4096, 64, fp8, device, True) for fp8 in (False, True)]
    out += [_gather_case(4, 8192, fmt, device) for fmt in ("v4", "v32")]
    return out
