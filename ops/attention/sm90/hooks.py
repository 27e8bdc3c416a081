"""Compile hooks and the 2-CTA cluster launcher of the sm_90 Gluon kernel (``kernel``).

Triton has one process-wide stages-inspection hook (``knobs.runtime.add_stages_inspection_hook``).
``install`` chains ours in front of whatever was there before (``kernel`` calls it on import);
it edits only the Gluon kernel's own builds (``sm90_kernel``; the cluster placeholders appear
in no other module), so every other kernel compiles exactly as it would without it. From
Triton 3.7 the hook is also called with no arguments and must return a ``(key, hash)`` pair
that joins the compile-cache key: ours is a digest of this file, so a changed hook never
reuses a kernel the old one built.
"""
from __future__ import annotations

import hashlib
import re

from triton import knobs
from triton.backends.compiler import Language

from sparse_mla.ops.attention.sm90 import cluster_ptx, compat
from sparse_mla.ops.common.triton_utils import launch_compiled

KERNEL_NAME = "sm90_kernel"
_OFFSET_NAMES = dict(cluster_ptx.OFFSET_NAMES)


def _digest() -> str:
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


_KEY = f"sparse_mla_sm90_hooks_{_digest()}"


class _Hook:
    """The installed hook: ``previous`` (the hook found at install time, or None) runs
    first. Called with the compiler's arguments it edits the stages; called with none
    (Triton >= 3.7) it returns the cache key and hash of both."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, *args):
        if not args:
            key, digest = "", ""
            if self.previous is not None:
                key, digest = self.previous()
            key += _KEY
            return key, hashlib.sha256(f"{digest}{_KEY}".encode()).hexdigest()
        if self.previous is not None:
            self.previous(*args)
        _edit_stages(*args)


def install():
    """Put the hook in place once per process (a second import or reload leaves it)."""
    current = knobs.runtime.add_stages_inspection_hook
    if not isinstance(current, _Hook):
        knobs.runtime.add_stages_inspection_hook = _Hook(current)


def _edit_stages(backend, stages, options, language, capability):
    """Two edits of ``sm90_kernel`` builds:

    * its cluster variant's ``SMLA_OFF_*`` placeholders become the allocator's shared-memory
      offsets (``_shared_offsets``), in the LLVM IR;
    * Triton stamps warp-specialized kernels with ``.maxnreg`` (the launch share: 168 for 12
      warps) and ptxas caps every ``setmaxnreg.inc`` region at it, so the lead warpgroup
      could never use the registers the other partitions give back. Without the directive
      ptxas takes the launch limit from ``.reqntid`` and honours each region's
      ``setmaxnreg`` (sm_90a, ptxas 12.9: 0 spills; with the cap, 236 B of spills and
      serialized wgmma)."""
    make_ptx = stages.get("ptx")
    make_llir = stages.get("llir")
    if make_ptx is None or make_llir is None:
        return

    def ptx(src, metadata):
        out = make_ptx(src, metadata)
        if metadata.get("name") == KERNEL_NAME:
            out = re.sub(r"^\.maxnreg \d+\n", "", out, flags=re.M)
        return out

    def llir(src, metadata):
        # Gluon kernels only: the module's text is read to find the cluster placeholders
        text = str(src) if language == Language.GLUON else ""
        offsets = _shared_offsets(text, src.context, options, backend, capability) \
            if "SMLA_OFF_" in text else None
        out = make_llir(src, metadata)
        if offsets:
            out = re.sub(r"SMLA_OFF_[A-Z_]+", lambda m: str(offsets[m.group(0)]), out)
        return out
    stages["ptx"] = ptx
    stages["llir"] = llir


def _shared_offsets(text, context, options, backend, capability):
    """The allocator's byte offsets (from ``global_smem``) of the buffers the ``cluster_ptx``
    text addresses, keyed by their placeholders: a copy of the TTGIR module is run
    through the passes ``make_llir`` runs up to and including shared-memory allocation (the
    same deterministic allocation), and each buffer is found by its SSA name."""
    import tempfile
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options
    with tempfile.NamedTemporaryFile("w", suffix=".ttgir") as f:
        f.write(text)
        f.flush()
        mod = ir.parse_mlir_module(f.name, context)
    pm = ir.pass_manager(context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    compat.add_allocate_warp_groups(passes, pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(
        pm, capability, get_ptx_version_from_options(options, backend.target.arch))
    pm.run(mod, "sparse_mla_shared_offsets")
    found = dict(re.findall(r"%(\w+) = ttg\.local_alloc \{allocation\.offset = (\d+) : i32\}",
                            str(mod)))
    wanted = {k: _OFFSET_NAMES[k] for k in set(re.findall(r"SMLA_OFF_[A-Z_]+", text))}
    missing = [n for n in wanted.values() if n not in found]
    if missing:
        raise RuntimeError(f"cluster kernel: no shared-memory offset found for {missing}")
    return {k: int(found[n]) for k, n in wanted.items()}


def cluster_launchable(kernel):
    """Make every launch of ``kernel`` (a compiled ``sm90_kernel`` with ``CLUSTER``) one of
    2-CTA clusters along x: Triton's launcher reads the cluster size from the packed launch
    metadata, adds the cluster-dimension attribute and multiplies grid x by it, so callers
    pass half the grid and program ids are unchanged (a cluster is one token's two head
    blocks). Compiled with ``num_ctas=1`` on purpose: Triton's own ``num_ctas=2`` would put
    a cluster-wide layout on every tensor."""
    num_warps, num_ctas, shared = kernel.packed_metadata
    if num_ctas != 2:
        kernel.packed_metadata = (num_warps, 2, shared)
    return kernel


def launch_clusters(fn, grid, args, kwargs):
    """Launch ``fn`` (``sm90_kernel`` with ``CLUSTER``) over ``grid`` as 2-CTA clusters, with
    one pass through Triton's argument binding: ``warmup`` finds (or compiles) the kernel,
    which is made cluster-launchable before its first launch and then launched directly with
    every parameter in signature order (constexprs included, as the launcher takes them).
    Returns the compiled kernel."""
    kernel = cluster_launchable(fn.warmup(*args, grid=grid, **kwargs))
    launch_compiled(kernel, fn, (grid[0] // 2, grid[1]), args, kwargs)
    return kernel
