"""Launcher of the attention core: split-KV sparse attention over listed keys (its entry point,
``sparse_attention_triton``, is in ops/attention/__init__.py).

``run`` takes one call's plan from ``plan.plan_launch`` (which kernel route and why; the split
counts from a wave cost model) and launches it: the portable split and combine kernels
(``portable``: grid tokens × head blocks × output halves, splits; each token's key list is
virtual, ``[source 0's usable columns, padded to BLOCK_N | source 1's]``, cut into
``n_splits`` runs of whole tiles), or on sm_90 ``sm90.kernel.sm90_kernel`` (warp-specialized:
producer warps gather and dequantize, consumer warpgroups run the dots) for every cache
format unless the launch is tiny and has one head block. The combine kernel is shared
(launched with programmatic dependent launch on sm_90+), and when a launch has one split per
token the Gluon kernel writes out / lse / max logits itself. Where one launch would leave its
last wave mostly idle, ``plan_phases`` makes two: the tokens filling whole waves unsplit, then
the rest split (``t0``: the launch's first token). V4 and V3.2 rows at 65-128 heads run as
2-CTA clusters, each CTA dequantizing half of every tile for both. Tiny launches split the
512 output dims over two 4-warp programs (``DV`` = 2), which then both compute q·k.

Interpreted launches (TRITON_INTERPRET=1) feed the dots fp32 operands (``DOT_F32``: the
interpreter's bf16 ``tl.dot`` is wrong); compiled launches use bf16, or fp16 for plain e4m3
keys with an e4m3 q (``F16``, exact). Below sm_89, or forced (``SPARSE_MLA_SOFT_FP8=1``),
the portable kernel decodes e4m3 in integer arithmetic (``SOFT``; the plan's ``soft_e4m3``
says why); its dots stay bf16 / fp16. ``run`` returns the ``plan.LaunchPlan`` that ran.
"""
from __future__ import annotations

import torch
import triton

from sparse_mla.ops.attention import plan
from sparse_mla.ops.attention import fmt_codes
from sparse_mla.ops.attention import portable as kernels
from sparse_mla.ops.attention.reference import head_dims
from sparse_mla.ops.common import checks, formats
from sparse_mla.ops.common.dispatch import triton_interpreting
from sparse_mla.ops.common.triton_utils import launch_capped, pdl_supported

FMT_CODES = fmt_codes.BY_NAME
# Records of 512-wide rows with their own scales (V4 584 B, V4.1 528 B and 288 B, these two
# page-footer or token-inline): a launch's two sources may mix these (a V4.1 layer's 528 B SWA
# cache and its 288 B compressed cache); the portable kernel then decodes each source's tiles
# in its own format
TAIL_FORMATS = ("v4",) + tuple(formats.V41_RECORD_OF)
# The V4.1 records (the portable kernel decodes every pair, the sm_90 kernel those of
# ``plan.SM90_V41_PAIRS``)
V41_FORMATS = tuple(formats.V41_RECORD_OF)
FMT_V41_EXTRA = fmt_codes.V41_EXTRA
FMT_PLAIN_BF16_TILED = fmt_codes.PLAIN_BF16_TILED.value
LOG2E = 1.4426950408889634

# Programmatic dependent launch where the GPU has it (sm_90+): the split and combine kernels
# are scheduled while the kernel before them runs and wait for its writes in-kernel, so their
# launch latency is hidden (lab/perf-log.md, "Fixed per-call costs").
PDL = True
# Plain e4m3 keys with an e4m3 q run the dots on fp16 operands, in both kernels: exact (e4m3
# values are fp16 values as they are bf16 values), and e4m3 -> fp16 is one conversion per two
# bytes where -> bf16 is three: the fp8 path is faster on both kernels (lab/perf-log.md,
# "V3.2 and 576-wide rows on sm_90")
# The software e4m3 route (``SOFT``) keeps it: its fp32 decode converts to fp16 exactly too.
FP16_FOR_E4M3 = True


def _launch_sm90(g, grid, q, args0, src0, i0, k0, len0, args1, src1, i1, k1, len1, scale,
                  part_o, part_ml, n_splits, n_units, max_logits, q_fp8, final, sink, out, lse,
                  out_scale, pdl, d576, f16, staged, cluster, t0, n_tok=None):
    """``cluster``: the two head blocks of each token run as one 2-CTA cluster (V4 rows
    staged or V3.2 rows, 65-128 heads; its producer gets ``PRODUCER_REGS_CLUSTER``
    registers): the compiled kernel is made cluster-launchable before its first
    launch, and the launch then takes half the grid's x (the launcher multiplies it back).
    ``n_tok``: the launch's tokens where its programs are persistent
    (``plan.persist_programs``: the grid then has fewer programs than units), else None."""
    from sparse_mla.ops.attention.sm90 import tuning
    lse_args = (lse, lse.stride(0), lse.stride(1)) if lse is not None else (part_ml, 0, 0)
    mx_args = ((max_logits, max_logits.stride(0), max_logits.stride(1))
               if max_logits is not None else (part_ml, 0, 0))
    args = (
        q, q.stride(0), q.stride(1), q.shape[1],
        *args0, src0.block_size, src0.capacity, i0, i0.stride(0), k0, *len0,
        *args1, src1.block_size if src1 else 1, src1.capacity if src1 else 0, i1,
        i1.stride(0), k1, *len1,
        *_scalar_arg(scale, LOG2E, part_ml), part_o, part_ml, n_splits, t0,
        out, out.stride(0), out.stride(1), *lse_args, *mx_args,
        sink if sink is not None else part_ml, *_scalar_arg(out_scale, 1.0, part_ml))
    fmt = FMT_CODES[src0.fmt]
    if src0.fmt == "v41" and src1 is not None and src1.fmt != src0.fmt:
        fmt = FMT_V41_EXTRA[src1.fmt]
    kwargs = tuning.launch_constexprs(
        fmt, has_l0=src0.lengths is not None,
        has_l1=src1 is not None and src1.lengths is not None, has_src1=src1 is not None,
        track_max=max_logits is not None, n_units=n_units,
        scale_t=isinstance(scale, torch.Tensor), q_fp8=q_fp8, final=final,
        has_sink=sink is not None, has_lse=lse is not None,
        out_scale_t=isinstance(out_scale, torch.Tensor), pdl=pdl, d576=d576, f16=f16,
        staged=staged, cluster=cluster, persist=n_tok is not None)
    # n_tok always (None where not persistent): the cluster launch passes every parameter by
    # name (``triton_utils.launch_compiled``)
    kwargs["n_tok"] = n_tok
    kwargs["launch_pdl"] = pdl
    if cluster:
        from sparse_mla.ops.attention.sm90 import hooks
        return hooks.launch_clusters(g.sm90_kernel, grid, args, kwargs)
    return g.sm90_kernel[grid](*args, **kwargs)


def _length_args(src, dummy):
    """(lengths, div, offset, lag) kernel arguments of a source's usable-column count
    (``KeySource.usable``); ``dummy`` stands in for absent lengths (never read)."""
    if src is None or src.lengths is None:
        return dummy, 1, 0, 0
    return src.lengths, src.tokens_per_length, src.length_offset, int(src.causal)


def _scalar_arg(value, factor, dummy):
    """(float, pointer) kernel arguments for a scale given as a float or as a one-element
    device tensor (then the kernel reads it: no host sync, CUDA-graph safe)."""
    if isinstance(value, torch.Tensor):
        return 0.0, value.reshape(-1)
    return float(value) * factor, dummy


def scales_aligned(fmt, blocks):
    """Whether the portable kernel reads V4 scale bytes as one int64 per row (``SCALE64``):
    every block of every source (``blocks``: (uint8 cache, block stride) pairs) starts 8-byte
    aligned."""
    return fmt == "v4" and all(plan._blocks_aligned(c, s0) for c, s0 in blocks)


def _source_args(src):
    """(pointer tensor, stride0, stride1) for a source's cache, strides in its element unit."""
    if src.fmt in ("v4", "v32") + V41_FORMATS:
        fmt = formats.get_format(src.fmt)
        raw = src.cache.view(torch.uint8) if src.cache.dtype != torch.uint8 else src.cache
        return raw, checks.block_stride(src.cache, fmt, src.block_size), 0
    cache = src.cache.view(torch.uint8) if src.fmt == "plain_fp8" else src.cache
    return cache, src.cache.stride(0), src.cache.stride(1)


def run(q, sources, sink, scale, out, lse=None, out_scale=1.0, max_logits=None):
    """Launch the attention of ``q`` over ``sources`` (``reference.KeySource``) and return
    the ``plan.LaunchPlan`` that ran (None where there was nothing to compute)."""
    T, H = q.shape[0], q.shape[1]
    if T == 0 or H == 0:
        return None
    n_hb = triton.cdiv(H, plan.CONFIG["max_heads"])    # head blocks are max_heads wide past it
    src0 = sources[0]
    src1 = sources[1] if len(sources) > 1 else None
    k0 = src0.indices.shape[1]
    k1 = src1.indices.shape[1] if src1 is not None else 0
    if src1 is not None and src1.fmt != src0.fmt and not (
            src0.fmt in TAIL_FORMATS and src1.fmt in TAIL_FORMATS):
        raise ValueError(f"sources must share one cache format (or both be one of "
                         f"{TAIL_FORMATS}), got {src0.fmt} and {src1.fmt}")
    # the second source's format code where it differs from the first's
    fmt1 = (FMT_CODES[src1.fmt] if src1 is not None and src1.fmt != src0.fmt
            else fmt_codes.SAME_AS_FMT.value)
    c0, c0s0, c0s1 = _source_args(src0)
    if src1 is not None:
        c1, c1s0, c1s1 = _source_args(src1)
    else:
        c1, c1s0, c1s1 = c0, 0, 0
    blocks = [(c0, c0s0)] + ([(c1, c1s0)] if src1 is not None else [])
    scale64 = scales_aligned(src0.fmt, blocks)
    d576 = head_dims(sources) == 576
    sms = plan._sm_count(q.device)     # asked once a call (a per-decode-step host path)
    launch, cfg, g = plan.plan_launch(q, src0.fmt, blocks, T, n_hb, k0, k1, heads=H,
                                      extra_fmt=src1.fmt if src1 is not None else None,
                                      sms=sms)
    staged = launch.staged
    cluster = launch.route == "sm90_cluster"
    bn = cfg["block_n"]
    # enough programs to fill the card; the kernel cuts each token's own key list (lengths
    # applied) into n_splits runs of whole tiles, so at most this many tiles ever exist
    max_tiles = max(1, plan._tiles(k0, k1, bn))
    dvs = cfg["dv"]
    dev = q.device
    q_fp8 = q.dtype == torch.float8_e4m3fn
    # e4m3 keys and q: the dots run on fp16 operands (exact; one conversion per two bytes)
    f16 = src0.fmt == "plain_fp8" and q_fp8 and FP16_FOR_E4M3 and not triton_interpreting()
    i0 = src0.indices
    i1 = src1.indices if src1 is not None else i0
    dummy = i0
    pdl = PDL and pdl_supported(dev)
    if g is not None:
        # the sm_90 kernel decodes an e4m3 q into shared memory itself; one split per token:
        # it finishes the rows itself (no partials, no combine)
        qq = q.view(torch.uint8) if q_fp8 else q
        phases = plan.plan_phases(T, n_hb, max_tiles, sms,
                                  cfg["split_overhead"])
        launch.phases = tuple(phases)
        launch.combined = any(n_splits > 1 for _, _, n_splits in phases)
        for t0, t1, n_splits in phases:
            final = n_splits == 1
            part_o, part_ml = _partials(0 if final else (t1 - t0) * H * n_splits, dev,
                                         n_splits)
            # persistent programs (each running several tokens) where they pay
            progs = plan.persist_programs(t1 - t0, n_hb, sms, src0.fmt, staged, q_fp8,
                                          n_splits, cluster) if len(phases) == 1 else 0
            launch.persist = progs
            launch.kernels.append(_launch_sm90(
                g, ((progs or t1 - t0) * n_hb, n_splits), qq, (c0, c0s0, c0s1), src0, i0, k0,
                _length_args(src0, dummy), (c1, c1s0, c1s1), src1, i1, k1,
                _length_args(src1, dummy), scale, part_o, part_ml, n_splits, n_hb, max_logits,
                q_fp8, final, sink, out, lse, out_scale, pdl, d576, f16, staged, cluster, t0,
                (t1 - t0) if progs else None))
            if not final:
                _combine(part_o, part_ml, n_splits, t0, t1, H, sink, out, lse, max_logits,
                         out_scale, pdl, interp=False)
        return launch
    # waves of one program per SM even where two 4-warp programs fit (dv 2): twice the splits
    # were slower (lab/perf-log.md, "FlashMLA timed per layer")
    n_splits = plan.choose_splits(T * n_hb * dvs, max_tiles, sms,
                                  cfg["split_overhead"], cfg["max_splits"])
    hb = plan.head_block(H, cfg["tiny"], dev, src0.fmt)
    part_o, part_ml = _partials(T * H * n_splits, dev, n_splits)
    interp = triton_interpreting()
    if q_fp8 and (cfg["dv"] == 1 or (launch.soft_e4m3 and not interp)):
        # exact (e4m3 ⊂ bf16). Decoded in the kernel, Triton keeps a computed q as a register
        # wgmma operand for the whole key loop (64 registers: the fp8 path spilled and ran
        # slower than bf16); one elementwise pass here keeps q in shared memory. Tiny
        # launches (one or two tiles per program) decode in the kernel: the extra launch
        # would cost them more (lab/perf-log.md, "Attention core rework") — except on the
        # software e4m3 route, where decoding a whole q block in integer arithmetic spilled
        # tens of KB of registers (tests/ops/test_arch_compile.py, SPILL_BOUND); torch's
        # cast is exact on any GPU. (Interpreted launches keep the in-kernel decode tested.)
        q, q_fp8 = q.to(torch.float16 if f16 else torch.bfloat16), False
    qq = q.view(torch.uint8) if q_fp8 else q
    launch.phases = ((0, T, n_splits), )
    launch.combined = True
    launch.kernels.append(kernels._split_kernel[(T * n_hb * dvs, n_splits)](
        qq, q.stride(0), q.stride(1), H,
        c0, c0s0, c0s1, src0.block_size, src0.capacity, i0, i0.stride(0), k0,
        *_length_args(src0, dummy),
        c1, c1s0, c1s1, src1.block_size if src1 else 1, src1.capacity if src1 else 0, i1,
        i1.stride(0), k1, *_length_args(src1, dummy),
        *_scalar_arg(scale, LOG2E, part_ml), part_o, part_ml, n_splits,
        FMT=(FMT_PLAIN_BF16_TILED if src0.fmt == "plain_bf16" and cfg["tiled_bf16"]
             else FMT_CODES[src0.fmt]), FMT1=fmt1,
        HAS_L0=src0.lengths is not None,
        HAS_L1=src1 is not None and src1.lengths is not None, HAS_SRC1=src1 is not None,
        Q_FP8=q_fp8, HB=hb, BN=bn, D576=d576,
        TRACK_MAX=max_logits is not None, PREFETCH=cfg["prefetch"], DV=dvs,
        N_UNITS=n_hb * dvs, SCALE64=scale64,
        SCALE_T=isinstance(scale, torch.Tensor), DOT_F32=interp, PDL=pdl, F16=f16,
        ONE_TILE=plan.one_tile(max_tiles, n_splits), SOFT=bool(launch.soft_e4m3),
        num_warps=cfg["num_warps"] // dvs,
        num_stages=cfg["num_stages_v32"] if src0.fmt == "v32" else cfg["num_stages"],
        launch_pdl=pdl))
    _combine(part_o, part_ml, n_splits, 0, T, H, sink, out, lse, max_logits, out_scale, pdl,
             interp)
    return launch


# Split partials (each split's normalized output rows) in bf16, their (lse2, max) pairs in
# fp32: half the bytes between the split kernels and the combine, faster at small and medium
# batches and a tie at large ones (lab/perf-log.md, "bf16 split partials"). Each partial is
# rounded once more than FlashMLA's fp32 ones (2^-9 relative per term of a convex combination,
# within docs/semantics.md §9's rel 2/128; the error against the reference did not change).
# A launch of one split (the portable kernel, whose combine then only applies the sink and
# output scale) keeps fp32, so its rows are rounded once, as the sm_90 kernel's own epilogue
# rounds them. torch.float32 restores fp32 everywhere (both kernels take either).
PARTIAL_DTYPE = torch.bfloat16


def _partials(n_rows, dev, n_splits):
    """Partial outputs ([n_rows, 512]; ``PARTIAL_DTYPE`` where a token has several splits,
    else fp32) and fp32 (lse2, max) pairs for ``n_rows`` rows."""
    dtype = PARTIAL_DTYPE if n_splits > 1 else torch.float32
    return (torch.empty(max(1, n_rows * 512), dtype=dtype, device=dev),
            torch.empty(max(1, n_rows * 2), dtype=torch.float32, device=dev))


def _combine(part_o, part_ml, n_splits, t0, t1, H, sink, out, lse, max_logits, out_scale, pdl,
             interp):
    """Merge the splits of tokens [t0, t1) (partial rows numbered from t0) into out / lse /
    max logits."""
    if part_o.dtype == torch.bfloat16:     # read as their bits (see the kernel)
        part_o = part_o.view(torch.int16)
    # 2-byte partials: two warps span a row's 512 dims in 16-byte loads, so all splits of a
    # column sit in one thread; with four, the splits were summed across warps through shared
    # memory and the combine ran several times slower (lab/perf-log.md, "bf16 split partials")
    grid = (t1 - t0, H)
    args = (
        part_o, part_ml, n_splits, t0, H, sink if sink is not None else part_ml, out,
        out.stride(0), out.stride(1), lse if lse is not None else part_ml,
        lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        max_logits if max_logits is not None else part_ml,
        max_logits.stride(0) if max_logits is not None else 0,
        max_logits.stride(1) if max_logits is not None else 0,
        *_scalar_arg(out_scale, 1.0, part_ml))
    kwargs = dict(
        OUT_SCALE_T=isinstance(out_scale, torch.Tensor),
        HAS_SINK=sink is not None, HAS_LSE=lse is not None, HAS_MAX=max_logits is not None,
        SPLITS=triton.next_power_of_2(n_splits), SOFT=interp, PDL=pdl,
        num_warps=4 if part_o.element_size() == 4 else 2,
        launch_pdl=pdl)
    cap = combine_residency(grid[0] * grid[1], plan._sm_count(part_o.device), pdl)
    if cap is None:
        kernels._combine_kernel[grid](*args, **kwargs)
    else:
        launch_capped(kernels._combine_kernel, grid, args, kwargs, cap)


# Launched early (PDL), the combine's CTAs all land on the SMs the split launch leaves free,
# as many as fit, and only those SMs merge the partials (at batch 2, h128: fewer than half the
# SMs). Capped at ceil(CTAs / SMs) per SM, the rest start on the split's SMs as they empty,
# and small calls got faster (lab/perf-log.md, "Small-launch timeline and combine cap").
# Large combines (thousands of CTAs) lost under a cap, so only small ones are capped:
# ``COMBINE_SPREAD`` CTAs per SM at most (None: never).
COMBINE_SPREAD = 8


def combine_residency(ctas, sms, pdl):
    """The per-SM cap on a combine launch of ``ctas`` CTAs (None: uncapped): launched early
    (``pdl``) and small enough to spread ceil(ctas / sms) to an SM within ``COMBINE_SPREAD``."""
    if not pdl or COMBINE_SPREAD is None:
        return None
    per_sm = triton.cdiv(ctas, sms)
    return per_sm if per_sm <= COMBINE_SPREAD else None
