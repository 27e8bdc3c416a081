"""The 2-CTA cluster exchange of the sm_90 kernel (V4 / V3.2 / V4.1 rows at 65-128 heads: the
two head blocks of one token).

Both CTAs of a cluster read the same key rows. Each one's producer gathers and dequantizes
one 32-row half of every 64-row tile (rank 0 rows [0, 32), rank 1 rows [32, 64)), stores it
in its own stage and copies its dequantized panels into the peer's with ``cp.async.bulk``
shared::cta -> shared::cluster, completing bytes on the peer's ``ready`` (``_send_half``). The
copies cost by the byte (lab/perf-log.md, "Cluster exchange"), so what needs no decoding (the
RoPE dims) and the bias each CTA writes for the peer's rows itself. Since either producer
writes both CTAs' stages, the producers hand each released stage over to each other
(``_pair_handoff``). FlashMLA's sm_90 kernel splits its h128 dequantization the same way.

Gluon (Triton 3.6) has no API for any of it: the kernel is compiled as an ordinary one-CTA
kernel and launched as clusters (``hooks.cluster_launchable``), and inline PTX
(``cluster_ptx``, plain text) addresses shared memory as ``global_smem`` plus the allocator's
offsets, which ``hooks`` reads at compile time and writes over the ``SMLA_OFF_*``
placeholders (lab/tools/probe_cluster.py proved the route). This module wraps that PTX for the
kernel and holds the Gluon side of the exchange: hand-offs, cluster barriers, sends.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from sparse_mla.ops.attention.sm90 import cluster_ptx
from sparse_mla.ops.attention.sm90.compat import barrier
from sparse_mla.ops.attention.sm90.dequant import _store_v32

PAIR_SUB = gl.constexpr(cluster_ptx.PAIR_SUB)
# e4m3 panels of the next tile's V3.2 rows that the cluster producer stages by cp.async (the
# first two pairs: 8 KB, what is left once p shares the RoPE stages: consumers._p_buf); they go
# to the peer as the first copy batch, so that batch defines them
V32_STAGED_PANELS = gl.constexpr(cluster_ptx.V32_SENDS[0][1])
PANEL_TX = gl.constexpr(cluster_ptx.PANEL_TX)
_SEND_V4 = gl.constexpr(cluster_ptx.send_panels(*cluster_ptx.V4_SENDS[0]))
V4_PANELS = gl.constexpr(cluster_ptx.sent_panels(cluster_ptx.V4_SENDS))
_SEND_V41 = gl.constexpr(cluster_ptx.send_panels(*cluster_ptx.V41_SENDS[0]))
V41_PANELS = gl.constexpr(cluster_ptx.sent_panels(cluster_ptx.V41_SENDS))
_SEND_V32_STAGED, _SEND_V32_2, _SEND_V32_3 = (
    gl.constexpr(cluster_ptx.send_panels(*b)) for b in cluster_ptx.V32_SENDS)
V32_PANELS = gl.constexpr(cluster_ptx.sent_panels(cluster_ptx.V32_SENDS))
_REMOTE_ARRIVE = gl.constexpr(cluster_ptx.REMOTE_ARRIVE)
_CLUSTER_ARRIVE_INIT = gl.constexpr(cluster_ptx.CLUSTER_ARRIVE_INIT)
_CLUSTER_ARRIVE = gl.constexpr(cluster_ptx.CLUSTER_ARRIVE)
_CLUSTER_WAIT = gl.constexpr(cluster_ptx.CLUSTER_WAIT)


@gluon.jit
def _pair_handoff(empty, peer_free, i, rank, tid, STAGES: gl.constexpr):
    """Before tile ``i`` is written into stage i % STAGES of both CTAs: wait until this CTA's
    consumers have released the stage, tell the peer's producer so (a remote arrive on its
    ``peer_free``; a stage's first use needs no release), and wait for the peer's word that
    its consumers have too. Only the producers touch the peer's barriers, so the consumers'
    loops are unchanged (a remote arrive there made the lead spill)."""
    st = i % STAGES
    phase = ((i // STAGES) & 1) ^ 1
    mbarrier.wait(empty.index(st), phase)
    if i >= STAGES:
        gl.inline_asm_elementwise(_REMOTE_ARRIVE, "=r,r,r,r", [tid, tid * 0 + st * 8,
                                                                tid * 0 + (1 - rank)],
                                  dtype=gl.int32, is_pure=False, pack=1)
    mbarrier.wait(peer_free.index(st), phase)


@gluon.jit
def _pair_drain(empty, peer_free, n_tiles, rank, tid, STAGES: gl.constexpr):
    """A cluster producer's last hand-offs, as if for tiles n_tiles .. n_tiles + STAGES - 1:
    this CTA must not exit while the peer may still arrive here or its copy may still read
    this CTA's last halves (the peer's consumers are done with them once it has handed them
    back)."""
    for s in gl.static_range(STAGES):
        _pair_handoff(empty, peer_free, n_tiles + s, rank, tid, STAGES)


@gluon.jit
def _thread_ids(WARPS: gl.constexpr):
    """0 .. 32·WARPS - 1, one per thread of the calling partition: the operand that lets
    inline PTX run once per thread and elect thread 0."""
    return gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))


@gluon.jit
def _cluster_sync(tid, ASM: gl.constexpr):
    """One of the ``barrier.cluster`` steps (``_CLUSTER_*``), by every thread of the caller."""
    gl.inline_asm_elementwise(ASM, "=r,r", [tid], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _send_half(ready, st, rank, tid, BN: gl.constexpr, SUB: gl.constexpr, PTX: gl.constexpr,
               EXPECT: gl.constexpr):
    """Dequantized 64-dim panels of this CTA's half of stage ``st`` (which: ``PTX``, one of
    the ``_SEND_*``) into the peer's, completing on the peer's ready[st] (thread 0 issues);
    then, where ``EXPECT`` > 0, this CTA's arrive on its own ready[st], expecting that many
    panels from the peer: it completes once they are here too (the rest of the peer's half
    each CTA writes itself: ``cluster_ptx``)."""
    zero = tid * 0
    k_off = zero + (st * (BN * 1024) + rank * (SUB * 128))
    gl.inline_asm_elementwise(PTX, "=r,r,r,r,r", [tid, k_off, zero + st * 8, zero + (1 - rank)],
                              dtype=gl.int32, is_pure=False, pack=1)
    if EXPECT > 0:
        mbarrier.expect(ready.index(st), EXPECT * PANEL_TX)


@gluon.jit
def _store_pair_v32(k_bufs, st, rank, PAIR: gl.constexpr, xa, xb, scale, SUB: gl.constexpr):
    """One ``_store_v32`` pair into this CTA's half (rank ``rank``) of stage ``st``."""
    if rank == 0:   # static slice starts: one branch per rank
        _store_v32(k_bufs.index(st).slice(0, SUB), PAIR, xa, xb, scale)
    else:
        _store_v32(k_bufs.index(st).slice(SUB, SUB), PAIR, xa, xb, scale)


@gluon.jit
def _send_pair_v32(k_bufs, ready, st, rank, tid, PAIR: gl.constexpr, xa, xb, scale,
                   BN: gl.constexpr, SUB: gl.constexpr, PTX: gl.constexpr):
    """One ``_store_v32`` pair of this CTA's half of stage ``st``, then its copy to the peer."""
    _store_pair_v32(k_bufs, st, rank, PAIR, xa, xb, scale, SUB)
    fence_async_shared()    # generic stores -> the bulk copy (async proxy); all warps first
    barrier()
    _send_half(ready, st, rank, tid, BN, SUB, PTX, 0)
