"""Every Triton kernel of every op compiled for every CUDA arch the README claims (sm_80, 86,
89, 90, 100, 120) with the launch configuration the planner picks there, on the CPU (Triton
compiles for a target without a GPU): a kernel that cannot compile for an arch (e4m3 below
sm_89 without the software route) or that asks for more shared memory than one block of that
arch may use fails here, and so does one that spills more registers than its bound
(``SPILL_BOUND``). The sm_90 Gluon kernel has its own check
(tests/ops/attention/test_sm90_compile.py).

The planner's choices come from its own functions with the GPU's capability faked
(``planned``): the software e4m3 route below sm_89, PDL from sm_90, the shared-memory budget
(``plan.SHARED_PER_BLOCK``) and the launch shape it picks. Launch shapes that do not depend on
problem size are compiled once each, for the larger shared-memory need where the shape
allows two: plain caches with 576-wide rows (a superset of the 512-wide code), and integer
arguments never specialized as multiples of 16 (a cache whose block stride is not: its loads
are not vectorized and take more shared memory). Pointers are 16-byte aligned, as torch
allocates them. The variants compile in parallel, one process per core, once per test
process.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import inspect
import io
import multiprocessing
import os
import re
import types
from unittest import mock

import pytest
import torch
import triton

from sparse_mla.ops.attention import launch, plan, records
from sparse_mla.ops.common import formats, triton_utils

# Shared memory one block may use, by arch (the CUDA programming guide's opt-in maxima)
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024,
                100: 227 * 1024, 120: 99 * 1024}
ARCHS = tuple(SHARED_LIMIT)
# Register spills a variant may have on any arch: bytes of spill stores + loads in its code
# (ptxas -v; static, per thread), about 1.25x the most any arch had with Triton 3.9 when the
# bound was set (lab/perf-log.md, "Session 37: register spills by arch"), so a change that
# makes one spill more fails here. Every variant not named here must not spill at all. The
# portable attention kernel spills on every arch (its [64, 512] fp32 accumulator and q
# operands fill the register file); most on sm_80, whose ptxas schedules the same code
# differently from sm_86's.
SPILL_BOUND = {"split_plain_bf16_576": 3072, "split_plain_fp8_576": 11264,
               "split_plain_fp8_f16": 8192, "split_v32": 10240, "split_v4": 12288,
               "tiny_v4_fp8_q": 2048, "gather_dequant_v32": 64,
               "split_v41": 14000, "split_v41_v41fp4": 4300, "tiny_v41_v41fp4": 1700,
               # the indexer's scores kernels (prefill: 4 warps, the H200 sweep's fastest, spills
               # more than 8 did and ran 1.7x faster: lab/perf-log.md, "Session 37: the
               # indexer's launch shapes")
               "indexer_prefill_q8_k8": 8200, "indexer_prefill_qbf16_k8": 7500,
               "indexer_prefill_qbf16_kbf16": 8600, "indexer_decode_qbf16_kbf16": 160,
               # the decode scores kernel: four tiles a program at sm_90 (heads on N), one
               # elsewhere; s_q 2 puts both tokens' heads in one dot (its fastest on the H200,
               # Triton 3.6: lab/perf-log.md, "The indexer at the step's speed"); the select's
               # programs at K 2048 hold 8,192 keys
               "indexer_decode_q8_k8": 330, "indexer_decode_qbf16_k8": 380,
               "indexer_decode_q8_k8_sq2": 5700, "indexer_decode_qbf16_k8_sq2": 1500,
               "indexer_decode_qbf16_kbf16_sq2": 800, "indexer_select_final_k512": 16,
               # s_q 8 runs s_q 2's groups (decode_token_group): its bounds, within 5%
               # of its spills at sm_80 / 90 / 120
               "indexer_decode_q8_k8_sq8": 5700, "indexer_decode_qbf16_k8_sq8": 1500,
               "indexer_decode_qbf16_kbf16_sq8": 800,
               "indexer_select_final_k2048": 60, "indexer_select_partial_k2048": 80}
# The V4.1 indexer's keys kernel (8 warps: at 4 its paged variants spilled 1-20 KB) spills a
# little on its paged bf16-cache variants under Triton 3.9 (sm_86..120: 16-136 B)
SPILL_BOUND.update({"indexer_v41_blocks_paged_qbf16_kbf16": 170,
                    "indexer_v41_in_cand_paged_qbf16_kbf16": 140})

# Tritons before 3.9 allocate the indexer's decode scores kernel (4 warps) more tightly: at
# sm_80-120 it spills up to 1,112 B on 3.6 (torch 2.11's), 1,000 B on 3.7, 176 B on 3.8, where
# 3.9 spills 0-40 B; on the H200 this launch was still the fastest with 3.6 (heads on M, 88-176 B
# spilled: 150 µs against 168 at 8 warps, which spill none: lab/perf-log.md, "Session 37: the
# indexer's launch shapes"), so the launch stays and these bounds (about 1.25x those maxima)
# replace SPILL_BOUND's under them; the index convert kernel spills 8 B at sm_100 / 120 there.
# Two portable attention variants spill more on one release each (the most, by arch): the
# tiny V4.1 528 + 288 B launch 3,200 B at sm_120 on 3.7 (3.9: within 1,700), the plain e4m3
# 576-wide split 15,894 B at sm_80 on 3.8 (3.9: within 11,264). Measured on this repository's
# CPU compile with each release (Session 42). The s_q 2 e4m3 decode keeps SPILL_BOUND's 5,700
# there: its 3.6-only bound (3,400 B) failed on 3.8, which spills 4,664 B at sm_86 (the GPU tree,
# 2026-11-29).
SPILL_BOUND_BEFORE_TRITON39 = {"indexer_decode_q8_k8": 850, "indexer_decode_qbf16_k8": 820,
                               "indexer_decode_qbf16_kbf16": 1400, "index_convert_kernel": 16,
                               "tiny_v41_v41fp4": 4000, "split_plain_fp8_576": 19900,
                               "indexer_decode_qbf16_k8_sq2": 1100,
                               "indexer_decode_qbf16_kbf16_sq2": 340,
                               "indexer_select_final_k2048": 180,
                               "indexer_v41_in_cand_dense_q8_k8": 20,
                               "indexer_v41_blocks_paged_q8_k8": 60}
PORTABLE = "sparse_mla.ops.attention.portable"
INSERT = "sparse_mla.ops.cache_insert.triton_kernels"
INDEX = "sparse_mla.ops.index_combine.triton_kernels"
INDEXER = "sparse_mla.ops.indexer.triton_kernels"


def _cap(arch):
    return (arch // 10, arch % 10)


@contextlib.contextmanager
def _on_arch(arch):
    """The planner's view of a CUDA device of capability ``arch`` (nothing else touched)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", triton_utils.SOFT_FP8_ENV)}
    with mock.patch.dict(os.environ, env, clear=True), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda *a: _cap(arch)):
        yield torch.device("cuda", 0)


def planned(arch):
    """What the launchers pick on ``arch``: {"soft", "pdl", "general", "tiny", "hb", "hb_tiny"}
    (launch configs as ``plan.launch_config`` gives them, head blocks at 128 and 8 heads)."""
    with _on_arch(arch) as dev:
        q = types.SimpleNamespace(device=dev, dtype=torch.bfloat16)
        shared = plan.SHARED_PER_BLOCK[_cap(arch)]
        facts = plan.DeviceFacts(capability=_cap(arch), shared=shared)
        return dict(
            soft=triton_utils.soft_fp8(dev), soft_route=plan.soft_e4m3(q, "v4"),
            pdl=triton_utils.pdl_supported(dev), shared=shared,
            general=plan.launch_config(64, 2, 64, shared=shared),
            tiny=plan.launch_config(1, 1, 2, shared=shared),
            hb=plan.head_block(128, False, facts, "v4"),
            hb_tiny=plan.head_block(8, True, facts, "v4"))


def _attention_variants(arch):
    p = planned(arch)
    ptr = {"i0_ptr": "*i32", "i1_ptr": "*i32", "l0_ptr": "*i32", "l1_ptr": "*i32",
           "part_o": "*bf16", "part_ml": "*fp32", "scale_ptr": "*fp32"}
    out = {}

    def split(name, fmt, cfg, hb, q="*bf16", q_fp8=False, f16=False, d576=False, fmt1=None):
        g = cfg
        code = launch.FMT_CODES[fmt]
        if fmt == "plain_bf16" and g.tiled_bf16:
            code = launch.FMT_PLAIN_BF16_TILED
        cache = "*bf16" if fmt == "plain_bf16" else "*u8"
        cx = dict(FMT=code, HAS_L0=True, HAS_L1=True, HAS_SRC1=True, Q_FP8=q_fp8, HB=hb,
                  BN=g.block_n, D576=d576, TRACK_MAX=True, PREFETCH=True,
                  DV=g.dv, N_UNITS=2 * g.dv, SCALE64=fmt == "v4", SCALE_T=False,
                  DOT_F32=False, PDL=p["pdl"], F16=f16, ONE_TILE=g.tiny, SOFT=p["soft"],
                  FMT1=-1 if fmt1 is None else launch.FMT_CODES[fmt1])
        pointers = dict(ptr, q_ptr=q, c0_ptr=cache, c1_ptr=cache)
        out[name] = (PORTABLE, "_split_kernel", cx, pointers, {"scale2"},
                     dict(num_warps=g.num_warps // g.dv, num_stages=g.stages(fmt)))

    gen, tiny = p["general"], p["tiny"]
    split("split_v4", "v4", gen, p["hb"])
    split("split_v32", "v32", gen, p["hb"], d576=True)
    split("split_plain_bf16_576", "plain_bf16", gen, p["hb"], d576=True)
    split("split_plain_fp8_576", "plain_fp8", gen, p["hb"], d576=True)
    # e4m3 q over plain e4m3 rows: converted to fp16 by the launcher, fp16 dots
    split("split_plain_fp8_f16", "plain_fp8", gen, p["hb"], q="*fp16",
          f16=True)
    # V4.1 records (docs/semantics.md §12): 528 B rows, and 528 B main + 288 B extra rows
    split("split_v41", "v41", gen, p["hb"])
    split("split_v41_v41fp4", "v41", plan.record_config(gen, ("v41", "v41_fp4"), p["shared"]),
          p["hb"], fmt1="v41_fp4")
    split("tiny_v41_v41fp4", "v41", plan.record_config(tiny, ("v41", "v41_fp4"), p["shared"]),
          p["hb_tiny"], fmt1="v41_fp4")
    # tiny launches decode an e4m3 q in the kernel, but on the software e4m3 route (the
    # launcher converts it: decoded in integer arithmetic, a q block spilled tens of KB)
    if p["soft"]:
        split("tiny_v4_fp8_q", "v4", tiny, p["hb_tiny"])
    else:
        split("tiny_v4_fp8_q", "v4", tiny, p["hb_tiny"], q="*u8", q_fp8=True)
    for part, warps in (("*i16", 2), ("*fp32", 4)):
        out[f"combine_{part[1:]}"] = (
            PORTABLE, "_combine_kernel",
            dict(OUT_SCALE_T=False, HAS_SINK=True, HAS_LSE=True, HAS_MAX=True, SPLITS=32,
                 SOFT=False, PDL=p["pdl"]),
            {"part_o": part, "part_ml": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
             "lse_ptr": "*fp32", "mx_ptr": "*fp32", "out_scale_ptr": "*fp32"},
            {"out_scale"}, dict(num_warps=warps))
    return out


def _family_variants(arch):
    from sparse_mla.ops.cache_insert import triton_impl as insert
    from sparse_mla.ops.cache_insert import triton_kernels as ik
    from sparse_mla.ops.index_combine import triton_impl as index
    from sparse_mla.ops.trtllm_decode import triton_impl as trtllm
    p = planned(arch)
    soft, fuse = p["soft"], dict(enable_fp_fusion=False)
    tpp, iw = insert.CONFIG["tokens_per_program"], insert.CONFIG["insert_warps"]
    slots = {"slot_ptr": "*i64"}
    kpool = "sparse_mla.ops.indexer_kpool.triton_kernels"
    rows = dict(k_ptr="*bf16", g_ptr="*bf16", ring_ptr="*bf16")
    out = {
        "kpool_pool_insert": (kpool, "pool_insert_kernel",
                              dict(KPOOL=4, RING=8, UE8M0=False, SOFT=soft),
                              dict(rows, ape_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64",
                                   blk_ptr="*i64", mem_ptr="*i32", cache_ptr="*u8"), set(),
                              dict(fuse)),
        "kpool_ring_write": (kpool, "ring_write_kernel", dict(RING=8),
                             dict(rows, tslot_ptr="*i64", write_ptr="*i8"), set(), dict(fuse)),
        "v4_insert": (INSERT, "v4_insert_kernel", dict(TPP=tpp, SOFT=soft),
                      dict(slots, k_ptr="*bf16", cache_ptr="*u8"), set(),
                      dict(num_warps=iw, **fuse)),
        "v32_insert": (INSERT, "v32_insert_kernel", dict(TPP=tpp, POW2=True, SOFT=soft),
                       dict(slots, kvc_ptr="*bf16", pe_ptr="*bf16", cache_ptr="*u8"), set(),
                       dict(num_warps=iw, **fuse)),
    }
    for fp8 in (False, True):
        out[f"plain_insert_{'fp8' if fp8 else 'bf16'}"] = (
            INSERT, "plain_insert_kernel", dict(FP8=fp8, TPP=tpp, SOFT=soft),
            dict(slots, k_ptr="*bf16", cache_ptr="*u8" if fp8 else "*bf16",
                 kv_scale_ptr="*fp32" if fp8 else "*i64"), set(), dict(num_warps=iw, **fuse))
    for mode in (ik.MODE_V4, ik.MODE_PLAIN_BF16, ik.MODE_PLAIN_FP8):
        byte = mode != ik.MODE_PLAIN_BF16
        out[f"fused_insert_mode{mode}"] = (
            INSERT, "fused_insert_kernel",
            dict(HB=insert.CONFIG["heads_per_program"], MODE=mode, APPLY_NORM=True, SOFT=soft,
                 INLINE=False),
            dict(slots, q_ptr="*bf16", kv_ptr="*bf16", cache_ptr="*u8" if byte else "*bf16",
                 pos_ptr="*i64", cs_ptr="*fp32",
                 qo_ptr="*u8" if mode == ik.MODE_PLAIN_FP8 else "*bf16",
                 kv_scale_ptr="*fp32", q_scale_inv_ptr="*fp32"),
            {"eps"}, dict(num_warps=insert.CONFIG["num_warps"], **fuse))
    for fmt in ("v4", "v32", "v41", "v41_fp4", "v41_inline", "v41_fp4_inline"):
        out[f"gather_dequant_{fmt}"] = (
            INSERT, "gather_dequant_kernel",
            dict(MODE=insert.MODES.get(fmt, -1), HAS_GLEN=True,
                 TB=insert.CONFIG["gather_tokens"], SOFT=soft, INLINE=insert._inline(fmt)),
            {"out_ptr": "*bf16", "cache_ptr": "*u8"}, set(), dict(num_warps=4, **fuse))
    for fmt in formats.V41_SWA_FORMATS:
        out[f"fused_insert_{fmt}"] = (
            INSERT, "fused_insert_kernel",
            dict(HB=insert.CONFIG["heads_per_program"], MODE=insert.MODES[fmt], APPLY_NORM=False,
                 SOFT=soft, INLINE=insert._inline(fmt)),
            dict(slots, q_ptr="*bf16", kv_ptr="*bf16", cache_ptr="*u8", pos_ptr="*i64",
                 cs_ptr="*fp32", qo_ptr="*bf16", kv_scale_ptr="*fp32", q_scale_inv_ptr="*fp32"),
            {"eps"}, dict(num_warps=insert.CONFIG["num_warps"], **fuse))
    for fmt, mode in insert.MODES.items():
        out[f"compressed_insert_{fmt}"] = (
            INSERT, "compressed_insert_kernel",
            dict(MODE=mode, TPP=tpp, SOFT=soft, INLINE=insert._inline(fmt)),
            dict(slots, k_ptr="*bf16", cache_ptr="*bf16" if fmt == "plain_bf16" else "*u8",
                 pos_ptr="*i64", cs_ptr="*fp32",
                 kv_scale_ptr="*fp32" if fmt == "plain_fp8" else "*i64"),
            set(), dict(num_warps=iw, **fuse))
    block = index._block(2048)
    for name, cx in (("global_topk_kernel", dict(BLOCK=block)),
                     ("convert_kernel", dict(HAS_PREFILL=True, COUNT=True, BLOCK=block)),
                     ("swa_kernel", dict(BLOCK=index._block(128))),
                     ("c128a_kernel", dict(BLOCK=block)),
                     ("combine_kernel", dict(BLOCK=index.COMBINE_CONFIG["block"])),
                     ("mixed_kernel", dict(HAS_DCOMP=True, LOCAL=False, HAS_DLENS=True,
                                           SPACKED=True, CPACKED=True, WBLOCK=128,
                                           KBLOCK=block))):
        warps = index.COMBINE_CONFIG["num_warps"] if name == "combine_kernel" else 4
        out[f"index_{name}"] = (INDEX, name, cx, {}, set(), dict(num_warps=warps))
    out["trtllm_lengths"] = (
        "sparse_mla.ops.trtllm_decode.triton_kernels", "lengths_kernel",
        dict(HAS_CU=True, DSV4=True, SWA=128, BLOCK=trtllm.LENGTHS_BLOCK, CHUNK=64,
             PDL=p["pdl"]),
        {n: "*i32" for n in ("seq_lens", "cu", "topk_lens", "out_a", "out_b")}, set(),
        dict(num_warps=4))
    out.update(_indexer_variants(arch, soft))
    out.update(_indexer_v41_variants(soft))
    out["flashmla_usable_ids"] = (
        "sparse_mla.ops.flashmla_decode.vendor", "_usable_ids_kernel", dict(BLOCK=1024),
        {"src": "*i32", "dst": "*i32"}, set(), dict(num_warps=4))
    return out


def _indexer_variants(arch, soft):
    from sparse_mla.ops.indexer import triton_impl as ix
    from sparse_mla.ops.indexer import triton_select as sel
    cfg, fuse = ix.CONFIG, dict(enable_fp_fusion=False)
    out = {}
    for q8 in (False, True):
        for k8 in (False, True):
            if q8 and not k8:
                continue
            name = f"{'q8' if q8 else 'qbf16'}_{'k8' if k8 else 'kbf16'}"
            byte = lambda fp8: "*u8" if fp8 else "*bf16"  # noqa: E731
            out[f"indexer_prefill_{name}"] = (
                INDEXER, "prefill_keys_kernel",
                dict(BT=cfg["prefill_bt"], BN=cfg["prefill_bn"], QFP8=q8, KFP8=k8, SOFT=soft,
                     DOT_F32=False),
                {"q_ptr": byte(q8), "w_ptr": "*fp32", "k_ptr": byte(k8), "ks_ptr": "*fp32",
                 "cu_k_ptr": "*i64", "key_ptr": "*i64"}, set(),
                dict(num_warps=cfg["prefill_warps"], num_stages=cfg["prefill_stages"], **fuse))
            # s_q 2: every token's heads in one dot (N = 128); s_q 8: in groups of
            # decode_token_group tokens, as launched
            for next_n in (1, 2, 8):
                sq = "" if next_n == 1 else f"_sq{next_n}"
                out[f"indexer_decode_{name}{sq}"] = (
                    INDEXER, "decode_keys_kernel",
                    dict(NEXT_N=next_n, NT=ix.decode_token_group(next_n, 64), HP=64,
                         BN=cfg["decode_bn"],
                         TILES=ix.decode_tiles(ix.decode_heads_n(arch, soft)),
                         HEADS_N=ix.decode_heads_n(arch, soft),
                         QFP8=q8, KFP8=k8, SOFT=soft, DOT_F32=False),
                    {"q_ptr": byte(q8), "w_ptr": "*fp32", "cache_ptr": byte(k8),
                     "key_ptr": "*i64", "lim_ptr": "*i32"},
                    set(), dict(num_warps=cfg["decode_warps"], **fuse))
    # the top-k select's two kernels at the model's K (512) and the widest it takes
    for k in (512, sel.MAX_K):
        ch = sel.chunk_size(k, torch.device("cuda"))
        for kernel in ("partial_kernel", "final_kernel"):
            out[f"indexer_select_{kernel.split('_')[0]}_k{k}"] = (
                "sparse_mla.ops.indexer.triton_select", kernel,
                dict(CH=ch, KP=k, HAS_LIM=True),
                {"key_ptr": "*i64", "lim_ptr": "*i32",
                 "part_ptr" if kernel == "partial_kernel" else "out_ptr":
                     "*i64" if kernel == "partial_kernel" else "*i32"}, set(),
                dict(num_warps=sel.warps_for(ch)))
    for fp8 in (False, True):
        out[f"indexer_k_insert_{'fp8' if fp8 else 'bf16'}"] = (
            INDEXER, "k_insert_kernel", dict(FP8=fp8, TPP=cfg["insert_tokens"], SOFT=soft),
            {"k_ptr": "*bf16", "cache_ptr": "*u8" if fp8 else "*bf16", "slot_ptr": "*i64"},
            set(), dict(num_warps=cfg["insert_warps"], **fuse))
    return out


def _indexer_v41_variants(soft):
    """The V4.1 indexer's keys kernel: both levels, paged and dense keys, all bf16 and all
    e4m3 (a bf16 q over e4m3 keys decodes the same keys: not compiled again, to spare CI)."""
    from sparse_mla.ops.indexer_v41 import triton_impl as v41
    out = {}
    for level1 in (True, False):
        for paged in (True, False):
            for q8, k8 in ((False, False), (True, True)):
                byte = lambda fp8: "*u8" if fp8 else "*bf16"  # noqa: E731
                name = (f"indexer_v41_{'blocks' if level1 else 'in_cand'}_"
                        f"{'paged' if paged else 'dense'}_{'q8' if q8 else 'qbf16'}_"
                        f"{'k8' if k8 else 'kbf16'}")
                out[name] = (
                    "sparse_mla.ops.indexer_v41.triton_kernels", "v41_keys_kernel",
                    dict(HP=32, BSL=v41.CONFIG["blocks"], CBP=8, PAGED=paged, LEVEL1=level1,
                         QFP8=q8, KFP8=k8, SOFT=soft, DOT_F32=False),
                    {"q_ptr": byte(q8), "w_ptr": "*fp32", "cache_ptr": byte(k8),
                     "k_ptr": byte(k8), "ks_ptr": "*fp32", "k0_ptr": "*i64",
                     "key_ptr": "*i64", "bkey_ptr": "*i64"}, set(),
                    dict(num_warps=v41.CONFIG["warps"], enable_fp_fusion=False))
    return out


def variants():
    """{(arch, name): spec} of every variant (spec: module, kernel, constexprs, pointer
    types, float parameters, compile options)."""
    return {(arch, name): spec for arch in ARCHS
            for name, spec in {**_attention_variants(arch), **_family_variants(arch)}.items()}


_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _compile_with_ptxas_log(src, arch, options):
    """(compiled kernel, ptxas's ``-v`` report). Triton runs ptxas with ``-v`` and prints its
    report only when asked to and only when it really compiles (not on a cache hit)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    out = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(out):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return compiled, out.getvalue()


def spill_bytes(ptxas_log):
    """Bytes of register spills (stores + loads) ptxas reports, over all functions; None if
    the report has no such line (the check would otherwise pass on an empty report)."""
    found = _SPILLS.findall(ptxas_log)
    return sum(int(a) + int(b) for a, b in found) if found else None


def compile_variant(spec, arch):
    """(shared bytes, spill bytes, None) of ``spec`` compiled for sm_``arch``, or (None, None,
    the error).
    Parameters named ``*_ptr`` (or listed in the spec's pointer types) are pointers (int32
    unless listed), the spec's floats fp32, the rest int32 scalars; constexprs the spec
    leaves out take their defaults, and one without a default fails the variant."""
    from triton.compiler import ASTSource
    module, kernel, constexprs, pointers, floats, options = spec
    fn = getattr(importlib.import_module(module), kernel)
    names = list(inspect.signature(fn.fn).parameters)
    cx = dict(constexprs)
    try:
        for p in fn.params:
            if p.is_constexpr and p.name not in cx:
                if not p.has_default:
                    raise TypeError(f"no value for constexpr {p.name}")
                cx[p.name] = p.default
            # run-time parameters defaulting to None: constexpr None where the variant leaves
            # them out, as the JIT makes them
            if not p.is_constexpr and p.has_default and p.default is None \
                    and p.name not in pointers:
                cx[p.name] = None
        # record parameters (ops/attention/records.py) are typed field by field; pointers
        # 16-byte aligned, as torch allocates them and Triton specializes for
        fields = [f for n in names if n not in cx for f in getattr(fn, "records", {}).get(n, (n,))]
        ptrs = {f: pointers.get(f, "*i32") for f in fields
                if f in pointers or f.endswith("_ptr")}
        sig, by_path, attrs = records.signature(fn, cx, ptrs, floats)
        src = ASTSource(fn, sig, constexprs=by_path, attrs=attrs)
        compiled, log = _compile_with_ptxas_log(src, arch, options)
        return compiled.metadata.shared, spill_bytes(log), None
    except Exception as exc:   # reported per variant by the test
        return None, None, f"{type(exc).__name__}: {str(exc)[:2000]}"


def _compile_all():
    specs = variants()
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                                mp_context=ctx) as pool:
        futures = {key: pool.submit(compile_variant, spec, key[0])
                   for key, spec in specs.items()}
        return {key: f.result() for key, f in futures.items()}


_RESULTS = {}


def results():
    """Every variant's (shared bytes, error), compiled once per process."""
    if not _RESULTS:
        _RESULTS.update(_compile_all())
    return _RESULTS


@pytest.mark.parametrize("arch", ARCHS)
def test_planner_knows_each_archs_shared_memory_and_fp8(arch):
    """The budget the planner fits launches to is the arch's, and the software e4m3 route is
    taken exactly where the GPU has no e4m3 conversion Triton compiles (below sm_89, and sm_89
    under Triton 3.6: ``triton_utils.hardware_fp8``), named by the arch."""
    p = planned(arch)
    assert p["shared"] == SHARED_LIMIT[arch]
    old = triton_utils._triton_release(triton.__version__) < (3, 7)
    assert p["soft"] == (arch < 89 or (arch == 89 and old))
    want = f"sm_{arch}" if arch < 89 else f"sm_{arch}, Triton {triton.__version__}"
    assert p["soft_route"] == (want if p["soft"] else "")


def missing_ptxas(arch):
    """Triton's error where its install has no ptxas for ``arch`` (the slim bundles of
    tools/triton_bundle.py keep only the one sm_90 needs: Triton 3.8's has no
    ``ptxas-blackwell``), else None."""
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        get_ptxas(arch)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("arch,name", sorted(variants()))
def test_kernel_compiles_within_the_archs_shared_memory_and_spill_bound(arch, name):
    shared, spills, error = results()[(arch, name)]
    missing = missing_ptxas(arch) if error is not None else None
    if missing is not None:
        pytest.skip(f"sm_{arch}: {missing}: this Triton install cannot compile for it (a "
                    "slim bundle's); CI's full Triton does")
    assert error is None, f"sm_{arch} {name}: {error}"
    assert shared <= SHARED_LIMIT[arch], (
        f"sm_{arch} {name} uses {shared} B of shared memory; one block may use "
        f"{SHARED_LIMIT[arch]} B")
    assert spills is not None, f"sm_{arch} {name}: ptxas reported no spill line"
    bound = spill_bound(name)
    assert spills <= bound, (
        f"sm_{arch} {name} spills {spills} B of registers (stores + loads); its bound is "
        f"{bound} B (SPILL_BOUND, SPILL_BOUND_BEFORE_TRITON39)")


def spill_bound(name, version=None):
    """The spill bound of kernel ``name`` under Triton ``version`` (the installed one)."""
    import triton
    major, minor = (int(x) for x in (version or triton.__version__).split(".")[:2])
    if (major, minor) < (3, 9) and name in SPILL_BOUND_BEFORE_TRITON39:
        return SPILL_BOUND_BEFORE_TRITON39[name]
    return SPILL_BOUND.get(name, 0)


def test_spill_bounds_by_triton():
    assert spill_bound("indexer_decode_qbf16_kbf16", "3.9.0") == 160
    assert spill_bound("indexer_decode_qbf16_kbf16", "3.6.0") == 1400
    assert spill_bound("index_convert_kernel", "3.9.0") == 0
    assert spill_bound("split_v4", "3.6.0") == SPILL_BOUND["split_v4"]


def test_spill_report_is_read():
    """The spill check reads ptxas's report (a report without the line fails the variant,
    it does not pass it)."""
    log = ("ptxas info    : Function properties for k\n"
           "    0 bytes stack frame, 8 bytes spill stores, 16 bytes spill loads\n")
    assert spill_bytes(log) == 24 and spill_bytes(log * 2) == 48
    assert spill_bytes("ptxas info    : Used 40 registers") is None
