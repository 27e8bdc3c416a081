"""Can a Gluon kernel share shared memory across a 2-CTA cluster on this GPU (sm_90)?

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.lab.tools.probe_cluster [--ctas 264]

FlashMLA's h128 decode halves each CTA's fp8 dequantization by sharing the dequantized rows
between the two CTAs of a cluster (lab/perf-log.md, "bf16 stage completion by cp.async"). Triton
3.6 Gluon has no API for it: ``num_ctas=2`` forces a CGA layout onto every tensor, and no op exposes
a buffer's shared-memory address, a remote mbarrier or distributed shared memory. This probe checks
the route around that on a real GPU:

* the kernel is compiled with ``num_ctas=1`` (ordinary layouts) and launched as clusters of
  two by patching the compiled kernel's packed launch metadata (Triton's launcher turns
  ``num_ctas`` into the cluster-dimension launch attribute and multiplies grid x by it);
* shared-memory addresses are ``global_smem`` (the PTX symbol Triton allocates from) plus
  the allocator's offsets: here the tile is the first buffer (offset 0) and the barriers
  follow it, which the kernel's total shared size confirms;
* inline PTX then does what Gluon cannot: ``mapa`` to the peer's address, a
  ``cp.async.bulk`` shared::cta -> shared::cluster copy completing bytes on the peer's
  mbarrier, a remote ``mbarrier.arrive.release.cluster``, and ``barrier.cluster`` syncs.

Each CTA writes one 32-row half of a [64, 64] bf16 tile (128-byte swizzle, the ring stages'
layout) and sends it to its peer. Prints how many CTAs ended with both halves; a missing
remote arrive hangs (run it under ``timeout``). ``--graph`` launches it from a captured CUDA
graph; ``--compile-only`` builds the PTX for sm_90a on any machine and checks that ptxas
accepts it.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from sparse_mla.ops.attention.sm90.compat import barrier

TILE_BYTES = 64 * 64 * 2
HALF_BYTES = TILE_BYTES // 2
BAR_OFFSET = TILE_BYTES         # the allocator puts the two barriers right after the tile

_CLUSTER_SYNC = gl.constexpr("""{
    barrier.cluster.arrive.release.aligned;
    barrier.cluster.wait.acquire.aligned;
    mov.b32 $0, 0;
    }""")
# $1 thread id (thread 0 issues), $2 this CTA's half of the tile, $3 barrier 0, $4 barrier 1
# (byte offsets into global_smem), $5 the peer's rank in the cluster
_SEND_HALF = gl.constexpr("""{
    .reg .u32 base, lbuf, rbuf, lbar, rbar, lbar1, rbar1;
    .reg .pred leader;
    setp.eq.u32 leader, $1, 0;
    mov.u32 base, global_smem;
    add.u32 lbuf, base, $2;
    add.u32 lbar, base, $3;
    add.u32 lbar1, base, $4;
    mapa.shared::cluster.u32 rbuf, lbuf, $5;
    mapa.shared::cluster.u32 rbar, lbar, $5;
    mapa.shared::cluster.u32 rbar1, lbar1, $5;
    @leader cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes
        [rbuf], [lbuf], 4096, [rbar];
    @leader cp.async.bulk.commit_group;
    @leader mbarrier.arrive.release.cluster.shared::cluster.b64 _, [rbar1];
    @leader cp.async.bulk.wait_group.read 0;
    mov.b32 $0, 0;
    }""")


@gluon.jit
def _cluster_sync(z):
    return gl.inline_asm_elementwise(_CLUSTER_SYNC, "=r,r", [z], dtype=gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def _probe_kernel(out_ptr, BAR: gl.constexpr, HALF: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    L1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    tile = gl.allocate_shared_memory(
        gl.bfloat16, [64, 64],
        gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    pid = gl.program_id(0)
    rank = pid % 2              # a 1-D cluster of two along x: the CTA's rank in it
    tid = gl.arange(0, 128, layout=L1)
    zero = tid * 0
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    fence_async_shared(cluster=True)
    barrier()
    _cluster_sync(zero)         # both CTAs' barriers exist before either is signalled
    r = gl.arange(0, 32, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    half = ((r[:, None] * 64 + c[None, :]) % 64).to(gl.float32) + 0.5 * rank.to(gl.float32)
    if rank == 0:               # shared-memory slices need constant starts
        tile.slice(0, 32).store(half.to(gl.bfloat16))
    else:
        tile.slice(32, 32).store(half.to(gl.bfloat16))
    fence_async_shared()        # generic stores -> the bulk copy (async proxy) reads them
    barrier()
    mbarrier.expect(bars.index(0), HALF)    # arrive + expect the peer's half
    gl.inline_asm_elementwise(_SEND_HALF, "=r,r,r,r,r,r",
                              [tid, zero + HALF * rank, zero + BAR, zero + BAR + 8,
                               zero + (1 - rank)],
                              dtype=gl.int32, is_pure=False, pack=1)
    mbarrier.wait(bars.index(0), 0)         # the peer's half has landed
    mbarrier.wait(bars.index(1), 0)         # the peer's remote arrive
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    x = tile.load(L).to(gl.float32)
    gl.store(out_ptr + pid * 4096 + rows[:, None] * 64 + c[None, :], x)
    _cluster_sync(zero)         # neither CTA leaves while its peer may still touch it


def expected() -> torch.Tensor:
    rows = torch.arange(64)[:, None]
    cols = torch.arange(64)[None, :]
    return ((rows * 64 + cols) % 64).float() + 0.5 * (rows >= 32).float()


def compile_only() -> int:
    """sm_90a PTX on any machine; ptxas must accept it and the allocator must have put the
    tile at 0 and the barriers right after it (the offsets the kernel assumes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource
    src = GluonASTSource(_probe_kernel, {"out_ptr": "*fp32", "BAR": "constexpr",
                                         "HALF": "constexpr"},
                         constexprs={(1,): BAR_OFFSET, (2,): HALF_BYTES})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    if k.metadata.shared != BAR_OFFSET + 16:
        print(f"unexpected shared-memory layout: {k.metadata.shared} bytes", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as d:
        ptx = f"{d}/probe.ptx"
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        res = subprocess.run([get_ptxas(90).path, "--gpu-name=sm_90a", ptx, "-o", f"{d}/p.o"],
                             capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr, file=sys.stderr)
        return 1
    print("sm_90a: compiled, ptxas accepted it")
    return 0


def run(ctas: int, graph: bool = False) -> int:
    """Launch once (``graph``: captured in a CUDA graph, then replayed) and count the CTAs
    that hold both halves."""
    out = torch.full((ctas, 64, 64), -1.0, device="cuda")
    k = _probe_kernel.warmup(out, BAR=BAR_OFFSET, HALF=HALF_BYTES, grid=(ctas, ), num_warps=4)
    if k.metadata.shared != BAR_OFFSET + 16:
        print(f"unexpected shared-memory layout: {k.metadata.shared} bytes", file=sys.stderr)
        return 1
    k._init_handles()
    num_warps, _, shared = k.packed_metadata
    k.packed_metadata = (num_warps, 2, shared)      # launch as clusters of two

    def launch():
        k[(ctas // 2, 1, 1)](out, BAR_OFFSET, HALF_BYTES)   # the launcher takes constexprs too
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            launch()
        out.fill_(-1.0)
        g.replay()
    else:
        launch()
    torch.cuda.synchronize()
    bad = int((out.cpu() != expected()).flatten(1).any(1).sum())
    how = "a CUDA graph replay" if graph else "one launch"
    print(f"{torch.cuda.get_device_name()}: {ctas} CTAs in clusters of 2 ({how}), "
          f"{ctas - bad} with both halves, {bad} without")
    return 0 if bad == 0 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctas", type=int, default=264, help="CTAs (even): two per cluster")
    p.add_argument("--compile-only", action="store_true", help="sm_90a PTX + ptxas, no GPU")
    p.add_argument("--graph", action="store_true", help="launch inside a captured CUDA graph")
    args = p.parse_args(argv)
    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU (or --compile-only)", file=sys.stderr)
        return 1
    if args.ctas % 2:
        p.error("--ctas must be even")
    return run(args.ctas, args.graph)


if __name__ == "__main__":
    sys.exit(main())
