"""Triton kernels for the index-combine family (docs/semantics.md §4); element-for-element
equal to reference.py. Their launchers, with the ops' signatures, are in triton_impl.py.

Rules every kernel here follows:
* one program per output row, columns in tiles of ``BLOCK`` (a power of two); every column of
  every output row is written (valid entries, then -1), so callers may pass uninitialised
  persistent buffers;
* no host synchronisation: every size that would need one arrives as a Python int or is a
  tensor shape;
* a kernel cannot raise, so every table read is guarded: a request id outside ``[0, R)``, a
  block index outside ``[0, B)`` or a negative position never leads to a load; such entries
  come out as -1 (the reference computes the same values; its validation raises first for
  inputs that are actually inconsistent, see ops.py);
* integer division only on non-negative operands (Triton's ``//`` truncates, PyTorch's floors).
"""
from __future__ import annotations

import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# helpers

@triton.jit
def _table_slot(bt_row, req_ok, B, bs, loc, live):
    """Global slot of request-local entry ``loc`` through the row ``bt_row`` of a block table, or
    -1 where the entry is not live, the request is out of range or the block is beyond the
    table. Returns (slot, good)."""
    locc = tl.maximum(loc, 0)
    blk = locc // bs
    # (scalar & vector masks trip Triton's interpreter: broadcast the scalar with tl.where)
    good = tl.where(req_ok, live & (loc >= 0) & (blk < B), False)
    num = tl.load(bt_row + blk, mask=good, other=0)
    return tl.where(good, num * bs + locc % bs, -1), good


@triton.jit
def _remap_span(v, bs, span, PACKED: tl.constexpr):
    """Packed pools: valid slot ``s`` → ``(s // bs) * span + s % bs``; -1 stays -1."""
    if PACKED:
        vv = tl.maximum(v, 0)
        return tl.where(v >= 0, (vv // bs) * span + vv % bs, v)
    else:
        return v


@triton.jit
def _find_request(qsl_ptr, R, t, base, niter):
    """Largest r in [0, R) with qsl[r] - base <= t (qsl non-decreasing), and whether token
    ``t`` lies inside request r's range."""
    lo = tl.zeros((), dtype=tl.int32)
    hi = lo + R
    for _ in range(niter):
        mid = (lo + hi) // 2
        q = tl.load(qsl_ptr + mid) - base
        go = (hi - lo > 1) & (q <= t)
        stay = (hi - lo > 1) & (q > t)
        lo = tl.where(go, mid, lo)
        hi = tl.where(stay, mid, hi)
    inside = t < tl.load(qsl_ptr + lo + 1) - base
    return lo, inside


# ---------------------------------------------------------------------------------------------
# §4.1 compute_global_topk_indices_and_lens

@triton.jit
def global_topk_kernel(topk_ptr, topk_s0, t2r_ptr, valid_ptr, bt_ptr, bt_s0, R, B, bs,
                        out_ptr, out_s0, lens_ptr, K, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    row = t.to(tl.int64)
    req = tl.load(t2r_ptr + t)
    req_ok = (req >= 0) & (req < R)
    bt_row = bt_ptr + tl.where(req_ok, req, 0).to(tl.int64) * bt_s0
    count = tl.zeros((), dtype=tl.int32)
    for c0 in range(0, K, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        m = offs < K
        loc = tl.load(topk_ptr + row * topk_s0 + offs, mask=m, other=-1)
        slot, good = _table_slot(bt_row, req_ok, B, bs, loc, m)
        tl.store(out_ptr + row * out_s0 + offs, slot, mask=m)
        count += tl.sum(good.to(tl.int32), axis=0)
    ok = tl.load(valid_ptr + t) != 0
    tl.store(lens_ptr + t, tl.where(ok, count, 0))


# ---------------------------------------------------------------------------------------------
# §4.1 V3.2 triton_convert_req_index_to_global_index

@triton.jit
def convert_kernel(req_ptr, bt_ptr, bt_s0, R, B, bs, stride_rows, tok_ptr, tok_s0,
                    out_ptr, out_s0, cnt_ptr, pre_ptr, ws_ptr, P, K,
                    HAS_PREFILL: tl.constexpr, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    row = t.to(tl.int64)
    req = tl.load(req_ptr + t)
    req_ok = (req >= 0) & (req < R)
    bt_row = bt_ptr + tl.where(req_ok, req, 0).to(tl.int64) * bt_s0
    dec_row = req_ok
    if HAS_PREFILL:
        preq = tl.load(pre_ptr + t)
        dec_row = req_ok & (preq < 0)
        pre_ok = (preq >= 0) & (preq < P)
        ws = tl.load(ws_ptr + tl.where(pre_ok, preq, 0), mask=pre_ok, other=0)
    count = tl.zeros((), dtype=tl.int32)
    for c0 in range(0, K, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        m = offs < K
        tok = tl.load(tok_ptr + row * tok_s0 + offs, mask=m, other=-1)
        tokc = tl.maximum(tok, 0)
        blk = tokc // bs
        in_table = m & (tok >= 0) & (blk < B)
        dec_good = tl.where(dec_row, in_table, False)
        num = tl.load(bt_row + blk, mask=dec_good, other=0)
        val = tl.where(dec_good, num * stride_rows + tokc % bs, -1)
        good = dec_good
        if HAS_PREFILL:
            pre_good = tl.where(pre_ok, in_table, False)
            val = tl.where(pre_good, ws + tok, val)
            good = dec_good | pre_good
        tl.store(out_ptr + row * out_s0 + offs, val, mask=m)
        count += tl.sum(good.to(tl.int32), axis=0)
    if COUNT:
        tl.store(cnt_ptr + t, count)


# ---------------------------------------------------------------------------------------------
# §4.2 SWA window indices

@triton.jit
def swa_kernel(qsl_ptr, seq_ptr, t2r_ptr, valid_ptr, bt_ptr, bt_s0, R, B, bs, token_offset,
                out_ptr, out_s0, lens_ptr, W, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = pid + token_offset
    row = pid.to(tl.int64)
    ok = tl.load(valid_ptr + t) != 0
    req = tl.load(t2r_ptr + t)
    ok = ok & (req >= 0) & (req < R)
    r = tl.where(ok, req, 0)
    qs = tl.load(qsl_ptr + r, mask=ok, other=0)
    qe = tl.load(qsl_ptr + r + 1, mask=ok, other=0)
    sl = tl.load(seq_ptr + r, mask=ok, other=0)
    pos = sl - (qe - qs) + (t - qs)
    start = tl.maximum(pos - W + 1, 0)
    n = tl.where(ok, tl.maximum(tl.minimum(pos + 1, W), 0), 0)
    bt_row = bt_ptr + r.to(tl.int64) * bt_s0
    for c0 in range(0, W, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        m = offs < W
        slot, good = _table_slot(bt_row, ok, B, bs, start + offs, m & (offs < n))
        tl.store(out_ptr + row * out_s0 + offs, slot, mask=m)
    tl.store(lens_ptr + pid, n)


# ---------------------------------------------------------------------------------------------
# §4.3 C128A indices

@triton.jit
def c128a_kernel(pos_ptr, slot_ptr, t2r_ptr, bt_ptr, bt_s0, R, B, bs, ratio, Td,
                  dec_ptr, dec_s0, dlens_ptr, pre_ptr, pre_s0, WIDTH, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    n = tl.minimum(tl.maximum(pos + 1, 0) // ratio, WIDTH)
    if t < Td:
        row = t.to(tl.int64)
        ok = tl.load(slot_ptr + t) >= 0
        req = tl.load(t2r_ptr + t)
        req_ok = ok & (req >= 0) & (req < R)
        r = tl.where(req_ok, req, 0)
        bt_row = bt_ptr + r.to(tl.int64) * bt_s0
        n = tl.where(ok, n, 0)
        for c0 in range(0, WIDTH, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            m = offs < WIDTH
            slot, good = _table_slot(bt_row, req_ok, B, bs, offs, m & (offs < n))
            tl.store(dec_ptr + row * dec_s0 + offs, slot, mask=m)
        tl.store(dlens_ptr + t, n)
    else:
        row = (t - Td).to(tl.int64)
        for c0 in range(0, WIDTH, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            tl.store(pre_ptr + row * pre_s0 + offs, tl.where(offs < n, offs, -1),
                     mask=offs < WIDTH)


# ---------------------------------------------------------------------------------------------
# §4.4 combine_topk_swa_indices

@triton.jit
def combine_kernel(topk_ptr, topk_s0, Kt, qsl_ptr, seq_ptr, glen_ptr, R, niter, M, N,
                    W, ratio, TOPK, out_ptr, out_s0, lens_ptr, CT, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    row = t.to(tl.int64)
    base = tl.load(qsl_ptr)
    b, inside = _find_request(qsl_ptr, R, t, base, niter)
    qs = tl.load(qsl_ptr + b) - base
    qe = tl.load(qsl_ptr + b + 1) - base
    sl = tl.load(seq_ptr + b)
    gl = tl.load(glen_ptr + b)
    pos = sl - (qe - qs) + (t - qs)
    pos1 = tl.maximum(pos + 1, 0)
    topk_len = tl.where(inside, tl.minimum(pos1 // ratio, TOPK), 0)
    swa_len = tl.where(inside, tl.minimum(pos1, W), 0)
    row_base = b.to(tl.int64) * M
    win0 = row_base + N + pos - swa_len + 1 - (sl - gl)
    for c0 in range(0, CT, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        m = offs < CT
        in_topk = m & (offs < topk_len)
        idx = tl.load(topk_ptr + row * topk_s0 + offs, mask=in_topk & (offs < Kt), other=-1)
        val = tl.where(in_topk & (idx >= 0) & (idx < N), row_base + idx, -1)
        i = offs - topk_len
        val = tl.where((i >= 0) & (i < swa_len), win0 + i, val)
        tl.store(out_ptr + row * out_s0 + offs, val.to(tl.int32), mask=m)
    tl.store(lens_ptr + t, topk_len + swa_len)


# ---------------------------------------------------------------------------------------------
# §4.5 build_flashinfer_mixed_sparse_indices

@triton.jit
def mixed_kernel(dswa_ptr, dswa_s0, dcomp_ptr, dcomp_s0, Kd, dlens_ptr, dvalid_ptr,
                  ptopk_ptr, ptopk_s0, Kp, qsl_ptr, seq_ptr, t2r_ptr, R,
                  sbt_ptr, sbt_s0, SB, sbs, sspan, cbt_ptr, cbt_s0, CB, cbs, cspan,
                  Td, W, ratio, TOPK, PK, out_ptr, out_s0, lens_ptr,
                  HAS_DCOMP: tl.constexpr, LOCAL: tl.constexpr, HAS_DLENS: tl.constexpr,
                  SPACKED: tl.constexpr, CPACKED: tl.constexpr,
                  WBLOCK: tl.constexpr, KBLOCK: tl.constexpr):
    t = tl.program_id(0)
    row = t.to(tl.int64)
    req = tl.load(t2r_ptr + t)
    req_ok = (req >= 0) & (req < R)
    r = tl.where(req_ok, req, 0)
    cbt_row = cbt_ptr + r.to(tl.int64) * cbt_s0
    out_row = out_ptr + row * out_s0
    if t < Td:
        for c0 in range(0, W, WBLOCK):
            offs = c0 + tl.arange(0, WBLOCK)
            m = offs < W
            v = tl.load(dswa_ptr + row * dswa_s0 + offs, mask=m, other=-1)
            tl.store(out_row + offs, _remap_span(v, sbs, sspan, SPACKED), mask=m)
        count = tl.zeros((), dtype=tl.int32)
        for c0 in range(0, PK, KBLOCK):
            offs = c0 + tl.arange(0, KBLOCK)
            m = offs < PK
            if HAS_DCOMP:
                v = tl.load(dcomp_ptr + row * dcomp_s0 + offs, mask=m & (offs < Kd), other=-1)
                if LOCAL:
                    v, good = _table_slot(cbt_row, req_ok, CB, cbs, v, m)
                    count += tl.sum(good.to(tl.int32), axis=0)
            else:
                v = tl.full((KBLOCK,), -1, tl.int32)
            tl.store(out_row + W + offs, _remap_span(v, cbs, cspan, CPACKED), mask=m)
        clen = tl.zeros((), dtype=tl.int32)
        if HAS_DCOMP:
            if LOCAL:
                clen = tl.where(tl.load(dvalid_ptr + t) != 0, count, 0)
            elif HAS_DLENS:
                clen = tl.load(dlens_ptr + t)
            else:
                clen = clen + Kd
        tl.store(lens_ptr + t, W + clen)
    else:
        prow = (t - Td).to(tl.int64)
        qs = tl.load(qsl_ptr + r, mask=req_ok, other=0)
        qe = tl.load(qsl_ptr + r + 1, mask=req_ok, other=0)
        sl = tl.load(seq_ptr + r, mask=req_ok, other=0)
        pos = sl - (qe - qs) + (t - qs)
        pos1 = tl.maximum(pos + 1, 0)
        swa_len = tl.where(req_ok, tl.minimum(pos1, W), 0)
        topk_len = tl.where(req_ok, tl.minimum(pos1 // ratio, TOPK), 0)
        start = pos - swa_len + 1
        sbt_row = sbt_ptr + r.to(tl.int64) * sbt_s0
        for c0 in range(0, W, WBLOCK):
            offs = c0 + tl.arange(0, WBLOCK)
            m = offs < W
            v, good = _table_slot(sbt_row, req_ok, SB, sbs, start + offs, m & (offs < swa_len))
            tl.store(out_row + offs, _remap_span(v, sbs, sspan, SPACKED), mask=m)
        for c0 in range(0, PK, KBLOCK):
            offs = c0 + tl.arange(0, KBLOCK)
            m = offs < PK
            live = m & (offs < topk_len)
            loc = tl.load(ptopk_ptr + prow * ptopk_s0 + offs, mask=live & (offs < Kp), other=-1)
            v, good = _table_slot(cbt_row, req_ok, CB, cbs, loc, live)
            tl.store(out_row + W + offs, _remap_span(v, cbs, cspan, CPACKED), mask=m)
        tl.store(lens_ptr + t, W + topk_len)
