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

import dataclasses

import torch
import triton

from sparse_mla.ops.attention import plan
from sparse_mla.ops.attention import fmt_codes
from sparse_mla.ops.attention import portable as kernels_mod
from sparse_mla.ops.attention import records
from sparse_mla.ops.attention.policy import DEFAULT
from sparse_mla.ops.attention.reference import head_dims
from sparse_mla.ops.common import formats
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

# Programmatic dependent launch wherever the GPU has it (sm_90+: ``pdl_supported``): the split
# and combine kernels are scheduled while the kernel before them runs and wait for its writes
# in-kernel, so their launch latency is hidden (lab/perf-log.md, "Fixed per-call costs").


def _launch_sm90(g, grid, q, args0, src0, i0, k0, len0, args1, src1, i1, k1, len1, scale,
                  part_o, part_ml, n_splits, n_units, max_logits, q_fp8, final, sink, out, lse,
                  out_scale, pdl, d576, f16, staged, cluster, t0, n_tok=None, policy=DEFAULT):
    """``cluster``: the two head blocks of each token run as one 2-CTA cluster (V4 rows
    staged or V3.2 rows, 65-128 heads; its producer gets ``Sm90.producer_regs_cluster``
    registers): the compiled kernel is made cluster-launchable before its first
    launch, and the launch then takes half the grid's x (the launcher multiplies it back).
    ``n_tok``: the launch's tokens where its programs are persistent
    (``plan.persist_programs``: the grid then has fewer programs than units), else None."""
    from sparse_mla.ops.attention.sm90 import tuning
    args = (
        records.query(q, q.shape[1]), records.source(args0, src0, i0, k0, len0),
        records.source(args1, src1, i1, k1, len1), _scalar_arg(scale, LOG2E, part_ml),
        (part_o, part_ml), n_splits, t0, records.rows(out, part_ml),
        records.rows(lse, part_ml), records.rows(max_logits, part_ml),
        sink if sink is not None else part_ml, _scalar_arg(out_scale, 1.0, part_ml))
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
        staged=staged, cluster=cluster, persist=n_tok is not None, shape=policy.sm90)
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
    return fmt == "v4" and all(plan.blocks_aligned(c, s0) for c, s0 in blocks)


def _source_args(src):
    """(pointer tensor, stride0, stride1) for a source's cache, strides in its element unit."""
    return plan.cache_view(src)


def run(q, sources, sink, scale, out, lse=None, out_scale=1.0, max_logits=None, policy=None):
    """Plan (``plan.plan_launch``) and launch the attention of ``q`` over ``sources``
    (``reference.KeySource``); returns what ran (``Launched``; None where there was nothing to
    compute)."""
    if q.shape[0] == 0 or q.shape[1] == 0:
        return None
    return execute(plan.plan_launch(q, sources, policy=policy), q, sources, sink, scale, out,
                   lse, out_scale, max_logits)


@dataclasses.dataclass(frozen=True)
class Launched:
    """A plan that ran, and the compiled split kernels it launched (one per phase: their
    registers and PTX, for tests and tools); reads as its plan (``route``, ``phases``...)."""
    plan: plan.LaunchPlan
    kernels: tuple

    @property
    def kernel(self):
        """The last compiled split kernel launched."""
        return self.kernels[-1] if self.kernels else None

    def __getattr__(self, name):
        if name.startswith("__") or name == "plan":     # copy / pickle probe these first
            raise AttributeError(name)
        return getattr(self.plan, name)

    def __str__(self):
        return str(self.plan)


def execute(p, q, sources, sink, scale, out, lse=None, out_scale=1.0, max_logits=None):
    """Launch plan ``p`` (``plan.plan_launch``'s, for a call of this kind: ``p.check_fits``)
    on these tensors; nothing is decided here."""
    T, H = q.shape[0], q.shape[1]
    if T == 0 or H == 0:
        return None
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
    cfg = p.shape
    dev = q.device
    q_fp8 = q.dtype == torch.float8_e4m3fn
    i0 = src0.indices
    i1 = src1.indices if src1 is not None else i0
    dummy = i0
    pdl = pdl_supported(dev)
    n_hb = p.head_blocks
    kernels = []
    if p.sm90:
        from sparse_mla.ops.attention.sm90 import kernel as g
        # the sm_90 kernel decodes an e4m3 q into shared memory itself; one split per token:
        # it finishes the rows itself (no partials, no combine)
        qq = q.view(torch.uint8) if q_fp8 else q
        for ph in p.phases:
            final = ph.splits == 1
            part_o, part_ml = _partials(0 if final else (ph.t1 - ph.t0) * H * ph.splits, dev,
                                         ph.splits, p.policy)
            kernels.append(_launch_sm90(
                g, ((ph.programs or ph.t1 - ph.t0) * n_hb, ph.splits), qq, (c0, c0s0, c0s1),
                src0, i0, k0, _length_args(src0, dummy), (c1, c1s0, c1s1), src1, i1, k1,
                _length_args(src1, dummy), scale, part_o, part_ml, ph.splits, n_hb,
                max_logits, q_fp8, final, sink, out, lse, out_scale, pdl, d576, p.fp16_dots,
                p.staged, p.cluster, ph.t0, (ph.t1 - ph.t0) if ph.programs else None,
                p.policy))
            if not final:
                _combine(part_o, part_ml, ph.splits, ph.t0, ph.t1, H, sink, out, lse,
                         max_logits, out_scale, pdl, False, p.policy)
        return Launched(p, tuple(kernels))
    (ph,) = p.phases
    n_splits = ph.splits
    dvs = cfg.dv
    part_o, part_ml = _partials(T * H * n_splits, dev, n_splits, p.policy)
    interp = triton_interpreting()
    if p.q_cast is not None:
        q, q_fp8 = q.to(p.q_cast), False
    qq = q.view(torch.uint8) if q_fp8 else q
    kernels.append(kernels_mod._split_kernel[(T * n_hb * dvs, n_splits)](
        records.query(qq, H), records.source((c0, c0s0, c0s1), src0, i0, k0,
                                             _length_args(src0, dummy)),
        records.source((c1, c1s0, c1s1), src1, i1, k1, _length_args(src1, dummy)),
        _scalar_arg(scale, LOG2E, part_ml), (part_o, part_ml), n_splits,
        FMT=(FMT_PLAIN_BF16_TILED if src0.fmt == "plain_bf16" and cfg.tiled_bf16
             else FMT_CODES[src0.fmt]), FMT1=fmt1,
        HAS_L0=src0.lengths is not None,
        HAS_L1=src1 is not None and src1.lengths is not None, HAS_SRC1=src1 is not None,
        Q_FP8=q_fp8, HB=p.head_block, BN=cfg.block_n, D576=d576,
        TRACK_MAX=max_logits is not None, PREFETCH=True, DV=dvs,
        N_UNITS=n_hb * dvs, SCALE64=scale64,
        SCALE_T=isinstance(scale, torch.Tensor), DOT_F32=interp, PDL=pdl, F16=p.fp16_dots,
        ONE_TILE=p.one_tile, SOFT=bool(p.soft_e4m3),
        num_warps=cfg.num_warps // dvs, num_stages=cfg.stages(src0.fmt),
        launch_pdl=pdl))
    _combine(part_o, part_ml, n_splits, 0, T, H, sink, out, lse, max_logits, out_scale, pdl,
             interp, p.policy)
    return Launched(p, tuple(kernels))


def _partials(n_rows, dev, n_splits, policy=DEFAULT):
    """Partial outputs ([n_rows, 512]; ``Policy.partials`` where a token has several splits,
    else fp32) and fp32 (lse2, max) pairs for ``n_rows`` rows."""
    dtype = policy.partials if n_splits > 1 else torch.float32
    return (torch.empty(max(1, n_rows * 512), dtype=dtype, device=dev),
            torch.empty(max(1, n_rows * 2), dtype=torch.float32, device=dev))


def _combine(part_o, part_ml, n_splits, t0, t1, H, sink, out, lse, max_logits, out_scale, pdl,
             interp, policy=DEFAULT):
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
    cap = combine_residency(grid[0] * grid[1], plan.device_facts(part_o.device).sms, pdl,
                           policy.combine_spread)
    if cap is None:
        kernels_mod._combine_kernel[grid](*args, **kwargs)
    else:
        launch_capped(kernels_mod._combine_kernel, grid, args, kwargs, cap)


def combine_residency(ctas, sms, pdl, spread=DEFAULT.combine_spread):
    """The per-SM cap on a combine launch of ``ctas`` CTAs (None: uncapped): launched early
    (``pdl``) and small enough to spread ceil(ctas / sms) to an SM within ``spread``
    (``Policy.combine_spread``: launched early, the combine's CTAs all land on the SMs the
    split launch leaves free, and only those merge the partials; capped, the rest start on
    the split's SMs as they empty)."""
    if not pdl or spread is None:
        return None
    per_sm = triton.cdiv(ctas, sms)
    return per_sm if per_sm <= spread else None
