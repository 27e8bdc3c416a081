"""Inline PTX of the sm_90 kernel's 2-CTA clusters, as plain text (importable on any Triton,
so CPU tests can check it; ``cluster`` wraps it in ``gl.constexpr`` for the kernel).

Shared memory is addressed as ``global_smem`` plus the ``SMLA_OFF_*`` placeholders, which the
kernel's compile hook (``hooks``) replaces with the allocator's byte offsets of the buffers named in
``OFFSET_NAMES``. A placeholder missing there is a compile error.

Each CTA of a cluster dequantizes one ``PAIR_SUB``-row half of every 64-row tile and copies
the dequantized 64-dim panels of that half into the peer's stage (``cp.async.bulk``
shared::cta -> shared::cluster), completing their bytes on the peer's ``ready``; the peer
expects exactly the panels sent (``V4_SENDS`` / ``V32_SENDS``). Everything else of the
peer's half (bias, RoPE dims) each CTA writes itself: the copies cost by the byte
(lab/perf-log.md, "Cluster exchange").
"""
from __future__ import annotations

PAIR_SUB = 32                   # rows per CTA per 64-row tile
PANEL = 64 * 128                # bytes of one 64-column panel of a [64, 512] bf16 stage
PANEL_TX = PAIR_SUB * 128       # bytes of one panel of a half
OFFSET_NAMES = {"SMLA_OFF_K": "k_bufs", "SMLA_OFF_READY": "ready",
                "SMLA_OFF_PEER_FREE": "peer_free"}

# (first panel, panels) of each copy batch. V4: panels 0-6 in one batch after the whole
# half is stored (panel 7, the RoPE dims, comes from the cache; a second batch's barrier made
# V4 slower: lab/perf-log.md, "Cluster exchange"). V3.2: the two staged pairs of panels (one
# fp32 scale each) together, then each register pair as soon as it is stored, so the copies
# overlap the rest's dequantization (faster than one batch, and the first two pairs in one
# batch than four: lab/perf-log.md, "Cluster exchange", "V3.2 cluster bounds").
V4_SENDS = ((0, 7),)
V32_SENDS = ((0, 4), (4, 2), (6, 2))
# V4.1 rows (528 B, or 288 B extra rows) have no bf16 dims: all eight panels, one batch
V41_SENDS = ((0, 8),)


def sent_panels(sends) -> int:
    """The panels a plan copies (what the peer's ready expects)."""
    return sum(n for _, n in sends)


_COPY = ("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes"
         " [dst], [src], {nbytes}, [rbar];")


def _peer_address(reg: str, placeholder: str, offset: str, rank: str) -> str:
    """PTX setting ``reg`` to the peer CTA's (rank ``rank``) address of this CTA's buffer
    ``placeholder`` plus byte ``offset``; ``base`` holds ``global_smem``."""
    return f"""
    add.u32 {reg}, base, {placeholder};
    add.u32 {reg}, {reg}, {offset};
    mapa.shared::cluster.u32 {reg}, {reg}, {rank};"""


def _leader_block(body: str) -> str:
    """An asm block whose ``body`` sees ``leader`` (thread id $1 is 0) and ``base``
    (``global_smem``); its output $0 is a dummy 0."""
    return """{
    .reg .u32 base, bar, rbar, src, dst;
    .reg .pred leader;
    setp.eq.u32 leader, $1, 0;
    mov.u32 base, global_smem;""" + body + """
    mov.b32 $0, 0;
    }"""


def send_panels(first: int, panels: int) -> str:
    """Copy panels [first, first + panels) of this CTA's half of a stage into the peer's:
    $1 thread id (thread 0 issues), $2 the half's byte offset in k_bufs, $3 st * 8 (the
    stage's ready barrier), $4 the peer's rank. Every other thread branches around the copies
    (``${:uid}``: a label unique to each instance of the asm). Predicated copies made ptxas
    wrap each one in a uniform-datapath loop that all producer warps ran, a measurable share
    of V4 h128's time (lab/perf-log.md, "Cluster exchange")."""
    copies = "".join(f"""
    add.u32 src, base, SMLA_OFF_K;
    add.u32 src, src, $2;
    add.u32 src, src, {j * PANEL};
    mapa.shared::cluster.u32 dst, src, $4;
    {_COPY.format(nbytes=PANEL_TX)}""" for j in range(first, first + panels))
    return _leader_block(_peer_address("rbar", "SMLA_OFF_READY", "$3", "$4") + """
    @!leader bra SMLA_SKIP_${:uid};""" + copies + """
SMLA_SKIP_${:uid}:""")


# $1 thread id (thread 0 arrives), $2 st * 8 (peer_free[st]), $3 the peer's rank. Default
# semantics (release, CTA scope), as CUTLASS's ClusterBarrier::arrive(cta_id): the arrive only
# has to follow this thread's wait on ``empty``; ``.release.cluster`` compiled to a GPU-wide
# MEMBAR + ERRBAR that showed among the kernel's stall samples (ncu, lab/perf-log.md,
# "Two-launch schedule and 2-CTA clusters")
REMOTE_ARRIVE = _leader_block(_peer_address("bar", "SMLA_OFF_PEER_FREE", "$2", "$3") + """
    @leader mbarrier.arrive.shared::cluster.b64 _, [bar];""")
# every thread of both CTAs arrives once at its partition's start (the lead, whose warps ran
# the mbarrier inits, fences them for the cluster first) and waits before it first touches
# the peer: no copy or arrive reaches a barrier before its CTA has initialized it
CLUSTER_ARRIVE_INIT = """{
    fence.mbarrier_init.release.cluster;
    barrier.cluster.arrive.release.aligned;
    mov.b32 $0, 0;
    }"""
CLUSTER_ARRIVE = """{
    barrier.cluster.arrive.release.aligned;
    mov.b32 $0, 0;
    }"""
CLUSTER_WAIT = """{
    barrier.cluster.wait.acquire.aligned;
    mov.b32 $0, 0;
    }"""
