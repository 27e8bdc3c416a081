"""The attention core both decode families share (ops/flashmla_decode, ops/trtllm_decode):
sparse MLA attention of each query token over up to two listed key sets in paged caches.

Entry points: ``KeySource`` (one key list over one cache) and ``sparse_attention_reference``
(the PyTorch oracle, any device), both from ``reference``; ``sparse_attention_triton`` (below:
the Triton kernels on a GPU or the interpreter). Where the Triton path goes:

* ``plan.py``: the whole plan of a call, made before it runs (``LaunchPlan``: route, reason,
  the kernel's file, phases and splits; ``plan_attention`` below; printed by
  ``dispatch.explain`` before a call and ``dispatch.last_choice`` after one);
* ``policy.py``: every setting the plan reads, one frozen ``Policy``;
* ``launch.py``: carries a plan out (kernel arguments, partial buffers, the combine launch);
* ``portable.py``: the portable Triton split and combine kernels (any CUDA GPU, the
  interpreter): routes ``portable`` and ``tiny``;
* ``sm90/``: the warp-specialized Hopper kernel in Gluon (routes ``sm90``, ``sm90_cluster``):
  ``kernel.py`` (the entry kernel), ``producers.py``, ``gather.py``, ``dequant.py``,
  ``consumers.py``, ``epilogue.py``, ``cluster.py`` / ``cluster_ptx.py`` (2-CTA clusters),
  ``tuning.py`` (compile-time parameters), ``hooks.py`` (compile hooks), ``compat.py``
  (Triton-version shims), ``variants.py`` (every launch variant compiled without a GPU).

Importing this package imports no Triton: the launcher is imported at the first Triton call.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from sparse_mla.ops.attention.reference import KeySource, sparse_attention_reference
from sparse_mla.ops.common import checks

__all__ = ["KeySource", "plan_attention", "sparse_attention_reference",
           "sparse_attention_triton"]


def _unit_strides(src: KeySource) -> KeySource:
    idx, lens = checks.unit_stride(src.indices), checks.unit_stride(src.lengths)
    if idx is src.indices and lens is src.lengths:
        return src          # the usual case: no copy, no new object on the decode hot path
    return dataclasses.replace(src, indices=idx, lengths=lens)


def plan_attention(q: torch.Tensor, sources: Sequence[KeySource], policy=None):
    """The launch plan (``plan.LaunchPlan``: route, reason, kernel file, phases) that
    ``sparse_attention_triton`` would carry out for ``q`` over ``sources``, made without
    launching anything; pass it back as ``plan=`` to reuse it for calls of the same kind."""
    from sparse_mla.ops.attention import plan as planning
    return planning.plan_launch(q, sources, policy=policy)


def sparse_attention_triton(q: torch.Tensor, sources: Sequence[KeySource],
                            sink: Optional[torch.Tensor], scale, out: torch.Tensor,
                            lse: Optional[torch.Tensor] = None, out_scale=1.0,
                            max_logits: Optional[torch.Tensor] = None, plan=None,
                            policy=None):
    """The same math on the GPU (or the Triton interpreter): writes ``out`` [T, H, 512] bf16
    and, if given, ``lse`` / ``max_logits`` [T, H] fp32 (any strides; ``out``'s last dim
    contiguous). ``scale`` / ``out_scale`` may be one-element fp32 tensors on q's device:
    the kernels read them, so nothing syncs with the host. Index lists, lengths and the sink
    may be strided views: the kernels need unit-stride ones, made here (a copy only where the
    view has gaps). ``plan``: a ``plan_attention`` result for a call of this kind (checked:
    ``LaunchPlan.check_fits``), else one is made under ``policy`` (``policy.DEFAULT``).
    Returns what ran (``launch.Launched``: the plan and its compiled kernels; also on
    ``dispatch.last_choice(op)`` of the op that called this).
    """
    from sparse_mla.ops.attention import launch
    from sparse_mla.ops.common import dispatch
    sources = [_unit_strides(s) for s in sources]
    sink = checks.unit_stride(sink)
    if plan is None:
        ran = launch.run(q, sources, sink, scale, out, lse, out_scale, max_logits, policy)
    else:
        plan.check_fits(q, sources)
        ran = launch.execute(plan, q, sources, sink, scale, out, lse, out_scale, max_logits)
    dispatch.record_plan(ran)
    return ran
