"""The Triton-version differences the sm_90 Gluon kernel meets, in one place.

The kernel (``sparse_attention_gluon``) and its compile hooks (``gluon_hooks``) are written once
against the names below; each resolves to what the installed Triton calls it. The supported
range itself is ``attention_plan.GLUON_TRITON`` (pure Python: checked before this module, which
needs Gluon, is imported). What changed, release by release (each checked by compiling every
launch variant for sm_90a: ``sm90_variants``, tests/ops/common/test_sm90_compile.py):

* 3.7: ``gl.thread_barrier`` became ``gl.barrier`` (the same ``debug_barrier`` op);
  ``allocate_warp_groups`` did not change until 3.8, where it takes a second argument
  (whether the concurrency sanitizer runs);
* 3.7: stages-inspection hooks are also called with no arguments and must then return a
  ``(key, hash)`` pair for the compile cache (``gluon_hooks``);
* 3.8: ``async_copy.async_copy_global_to_shared`` became ``async_load`` (the old name raises
  in 3.9);
* 3.8: ``_reinterpret`` to a different byte size is rejected; 3.9 renames it ``reinterpret``.
  The kernel only ever reinterprets at the same size (``reinterpret`` below), which every
  version accepts.
"""
from __future__ import annotations

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


def add_allocate_warp_groups(passes, pm):
    """``passes.ttgpuir.add_allocate_warp_groups`` as ``make_llir`` calls it (the concurrency
    sanitizer off: the kernel never runs under it)."""
    try:
        passes.ttgpuir.add_allocate_warp_groups(pm, False)       # 3.8+
    except TypeError:
        passes.ttgpuir.add_allocate_warp_groups(pm)              # 3.6, 3.7
