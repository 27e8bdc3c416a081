"""The TRTLLM-gen family's one kernel: per-token usable-column counts of a varlen batch in one
launch (a dense batch's counts are derived inside the attention kernels, see
``reference.dsv4_problem``); its launchers are in triton_impl.py.

The PyTorch formulation (``reference.dsv4_lengths`` / ``reference.v32_lengths``, kept as the
readable definition and used by the reference path) costs about ten small PyTorch kernels
(lab/perf-log.md, "Attention core rework"); this kernel computes the same int32 counts in one
launch.

Per token t: its request r (``t // Q``, or the varlen request whose ``cum_seq_lens_q`` range
holds t: ``searchsorted(cu[1:], t, right=True)`` clamped to B - 1), index i in the request,
the request's query length ql, and whether t lies in the request at all. Then
  DSv4: swa = clamp(seq_lens[r] - ql + i + 1, 0, 128), cmp = clamp(topk_lens[t] - 128, 0,
        topk - 128)   (128 = SWA_COLS);
  V3.2: n = clamp(seq_lens[r], 0, K);
every count 0 for a token outside any request.
"""
import triton
import triton.language as tl

from sparse_mla.ops.common.triton_utils import grid_launch_dependents


@triton.jit
def lengths_kernel(seq_lens, cu, topk_lens, out_a, out_b, T, B, Q, K,
                   HAS_CU: tl.constexpr, DSV4: tl.constexpr, SWA: tl.constexpr,
                   BLOCK: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:     # the attention kernel after this one may launch now (it waits for these rows)
        grid_launch_dependents()
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = t < T
    if HAS_CU:
        req = tl.zeros((BLOCK,), tl.int32)
        for j in range(0, B, CHUNK):
            jj = j + tl.arange(0, CHUNK)
            ends = tl.load(cu + 1 + jj, mask=jj < B, other=2147483647)
            req += tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), axis=1)
        req = tl.minimum(req, B - 1)
        has = live & (req >= 0)
        start = tl.load(cu + req, mask=has, other=0)
        end = tl.load(cu + req + 1, mask=has, other=0)
        qi = t - start
        ql = end - start
        inb = has & (t >= start) & (t < end)
    else:
        req = t // Q
        qi = t - req * Q
        ql = t * 0 + Q
        inb = live & (req < B)
    sl = tl.load(seq_lens + req, mask=inb, other=0)
    if DSV4:
        swa = tl.minimum(tl.maximum(sl - ql + qi + 1, 0), SWA)
        tk = tl.load(topk_lens + t, mask=inb, other=0)
        cmp = tl.minimum(tl.maximum(tk - SWA, 0), K - SWA)
        tl.store(out_a + t, tl.where(inb, swa, 0), mask=live)
        tl.store(out_b + t, tl.where(inb, cmp, 0), mask=live)
    else:
        n = tl.minimum(tl.maximum(sl, 0), K)
        tl.store(out_a + t, tl.where(inb, n, 0), mask=live)
