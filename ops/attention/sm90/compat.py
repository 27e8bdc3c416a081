"""The Triton-version differences the sm_90 Gluon kernel meets, in one place.

The kernel (``kernel`` and the modules it is made of) and its compile hooks (``hooks``) are
written once against the names below; each resolves to what the installed Triton calls it.
The supported range itself is ``plan.SM90_TRITON`` (ops/attention/plan.py, pure Python:
checked before this module, which needs Gluon, is imported). What changed, release by release
(each checked by compiling every launch variant for sm_90a: ``variants``,
tests/ops/attention/test_sm90_compile.py):

* 3.7: ``gl.thread_barrier`` became ``gl.barrier`` (the same ``debug_barrier`` op);
  ``allocate_warp_groups`` did not change until 3.8, where it takes a second argument
  (whether the concurrency sanitizer runs);
* 3.7: stages-inspection hooks are also called with no arguments and must then return a
  ``(key, hash)`` pair for the compile cache (``hooks``);
* 3.8: ``async_copy.async_copy_global_to_shared`` became ``async_load`` (the old name raises
  in 3.9);
* 3.8: ``_reinterpret`` to a different byte size is rejected; 3.9 renames it ``reinterpret``.
  The kernel only ever reinterprets at the same size (``reinterpret`` below), which every
  version accepts;
* 3.7: a store into a column slice of a 128-byte-swizzled buffer folds the slice's offset
  into the swizzle's XOR (one address register per slice, where 3.6 added the offset as an
  immediate), and shared stores became inline ``st.shared::cta`` asm. In the V4 cluster
  producer that cost seven live registers, and ptxas then scheduled all of the
  dequantization after the stage hand-off's wait (3.6: 3 of 7 panels before it), and
  Triton 3.8 ran V4 h128 slower on an H100 (lab/perf-log.md, "Session 35: Triton 3.8").
  ``PANEL_VIEWS`` stores through [panels, rows, 64] views of the stage instead
  (``dequant._panel``); 3.6 keeps the slices (its code is unchanged).
* 3.7 only: the V4 cluster producer's two branches on the CTA's rank (static row starts) were
  never merged. Its stores are inline asm, which LLVM can neither hoist nor sink with
  differing operands, and only the rank-1 branch's store addresses (row offset 4096 B set)
  get a ``nonnull`` attribute, so the two branches' stores are not identical and both keep a
  copy of the dequantization (PTX: 104 e4m3 conversions for 56). ptxas then scheduled all of
  it after the stage hand-off's waits. On 3.6 and 3.8 LLVM folds the branches into one path
  with a ``rank << 12`` row offset. ``RANK_VIEWS`` builds that one path in the source
  instead (``dequant._panel``'s ``half``).
"""
from __future__ import annotations

import os
import re

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy

# A barrier among the calling partition's threads (bar.sync); 3.6 names it thread_barrier
barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

# cp.async of a distributed tensor of pointers into shared memory, zero-filling masked rows
async_load = (async_copy.async_load if hasattr(async_copy, "async_load")
              else async_copy.async_copy_global_to_shared)

_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def reinterpret(buf, dtype: gl.constexpr, outer: gl.constexpr, rows: gl.constexpr,
                cols: gl.constexpr, layout: gl.constexpr):
    """``buf`` viewed as ``[outer, rows, cols]`` of ``dtype`` in ``layout`` (the same bytes:
    3.8 rejects a view of another size)."""
    if _PUBLIC_REINTERPRET:
        view = buf.reinterpret(dtype, [outer, rows, cols], layout)
    else:
        view = buf._reinterpret(dtype, [outer, rows, cols], layout)
    return view


@gluon.jit
def reinterpret2(buf, dtype: gl.constexpr, rows: gl.constexpr, cols: gl.constexpr,
                 layout: gl.constexpr):
    """``buf`` viewed as ``[rows, cols]`` of ``dtype`` in ``layout`` (the same bytes)."""
    if _PUBLIC_REINTERPRET:
        view = buf.reinterpret(dtype, [rows, cols], layout)
    else:
        view = buf._reinterpret(dtype, [rows, cols], layout)
    return view


def add_allocate_warp_groups(passes, pm):
    """``passes.ttgpuir.add_allocate_warp_groups`` as ``make_llir`` calls it (the concurrency
    sanitizer off: the kernel never runs under it)."""
    try:
        passes.ttgpuir.add_allocate_warp_groups(pm, False)       # 3.8+
    except TypeError:
        passes.ttgpuir.add_allocate_warp_groups(pm)              # 3.6, 3.7


TRITON = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])

PANEL_VIEWS = gl.constexpr({"0": False, "1": True}.get(
    os.environ.get("SPARSE_MLA_GLUON_PANEL_VIEWS", ""), TRITON >= (3, 7)))
"""Whether the kernel stores into a stage's 64-dim panels through panel views (see the module
doc, 3.7): on from Triton 3.7. ``SPARSE_MLA_GLUON_PANEL_VIEWS=0`` / ``=1`` forces it off / on
for A/B timing (read once, at import)."""

RANK_VIEWS = TRITON == (3, 7)
"""Whether the V4 cluster producer stores its half and its peer's half of a stage through views
indexed by the CTA's rank at run time (one code path) instead of one branch per rank with
static row starts (see the module doc, 3.7 only): on for Triton 3.7 only (3.6 and 3.8+ fold
the branches themselves). A plain flag, read by ``tuning.launch_constexprs`` at each launch
and passed to the kernel as the ``RANK_VIEWS`` constexpr, so flipping it between launches
builds the other kernel (lab/tools/ab_triton37.py times both in one process)."""
