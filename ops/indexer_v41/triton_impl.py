"""The V4.1 indexer ops' Triton implementations: triton_kernels.py's keys, then
``ops.indexer.triton_impl.select`` (the top-k of int64 selection keys, ids decoded from the
keys). ops.py validates the arguments before these run.

Each row's causal count (and, for prefill, its request's first key row) is computed on the
device, so decode needs no host sync; level 2 sorts each row's candidate list (a repeat is
then the slot before it) and scores only the listed blocks.
"""
from __future__ import annotations

import torch
import triton

from sparse_mla.ops.common.dispatch import triton_interpreting
from sparse_mla.ops.common.errors import ImplementationUnavailable
from sparse_mla.ops.common.triton_utils import soft_fp8
from sparse_mla.ops.indexer import format as fmt
from sparse_mla.ops.indexer import triton_select
from sparse_mla.ops.indexer.triton_impl import _bytes, _cache_args, select
from sparse_mla.ops.indexer_v41.triton_kernels import v41_keys_kernel

_LAUNCH = dict(enable_fp_fusion=False)
# ``blocks``: candidate blocks per program (BSL); ``chunk_bytes``: a prefill chunk's keys;
# ``select_rows``: rows per select call (select's torch.topk fallback beyond its kernel's row
# count would return columns, which level 2's keys do not index by position).
CONFIG = {"blocks": 8, "warps": 4, "chunk_bytes": 1 << 30, "select_rows": 2048}
INTERPRET_CONFIG = {"blocks": 2}


def _config(device):
    return {**CONFIG, **INTERPRET_CONFIG} if device.type == "cpu" else CONFIG


def _need_select(k: int, what: str):
    if not triton_select.selectable(k):
        raise ImplementationUnavailable(
            f"the Triton route selects 1..{triton_select.MAX_K} {what} per row, got {k}",
            f"{what} > {triton_select.MAX_K}")


def _select_rows(keys, out, lim):
    step = CONFIG["select_rows"]
    for s in range(0, keys.shape[0], step):
        select(keys[s:s + step], out[s:s + step], None if lim is None else lim[s:s + step])


class _Keys:
    """The common launch arguments of one call: q, weights and the key source."""

    def __init__(self, q, weights, ratio):
        self.q, self.w, self.ratio = q, weights, ratio
        self.cfg = _config(q.device)
        self.is_paged = False
        self.paged = (q, 0, 0, 0, q, 0, 0, 1, 1)       # placeholders where dense
        self.dense = (q, 0, q, q)                      # placeholders where paged
        self.kfp8 = False

    def launch(self, n, start, rows, keys, bkeys, cand, cb):
        """Keys of rows start..start + rows; level 1 where ``bkeys`` is given."""
        level1 = bkeys is not None
        bsl = self.cfg["blocks"]
        nblk = bkeys.shape[1] if level1 else 0
        slots = nblk if level1 else cand.shape[1]
        if rows == 0 or slots == 0:
            return
        q = self.q
        v41_keys_kernel[(rows, triton.cdiv(slots, bsl))](
            _bytes(q), q.stride(0), q.stride(1), self.w, self.w.stride(0), n, start,
            *self.paged, *self.dense,
            q if level1 else cand, 0 if level1 else cand.stride(0), slots,
            keys, keys.stride(0), bkeys if level1 else keys,
            bkeys.stride(0) if level1 else 0, keys.shape[1] if level1 else 0, nblk,
            q.shape[1], cb, HP=max(16, triton.next_power_of_2(q.shape[1])), BSL=bsl,
            CBP=triton.next_power_of_2(cb), PAGED=self.is_paged, LEVEL1=level1,
            QFP8=q.dtype == torch.float8_e4m3fn, KFP8=self.kfp8, SOFT=soft_fp8(q.device),
            DOT_F32=triton_interpreting(), num_warps=self.cfg["warps"], **_LAUNCH)


def _paged(q, weights, k_cache, block_table, ratio, next_n, block_size):
    src = _Keys(q, weights, ratio)
    kfp8, cache, s0, s1 = _cache_args(k_cache, block_size)
    src.kfp8, src.is_paged = kfp8, True
    src.paged = (cache, s0, s1, k_cache.shape[0], block_table, block_table.stride(0),
                 block_table.shape[1], block_size, next_n)
    return src


def _decode_counts(seq_lens, n_rows, next_n, ratio, width):
    """Row t's causal count min(width, (p + 1) // ratio), p = seq_lens[t // next_n] - next_n +
    t % next_n (0 where p < 0), as int32 on the device."""
    t = torch.arange(n_rows, device=seq_lens.device)
    p1 = seq_lens[t // next_n].long() - next_n + t % next_n + 1
    return torch.div(p1.clamp_min(0), ratio, rounding_mode="floor").clamp_max(width).to(
        torch.int32)


def _sorted(candidates):
    return torch.sort(candidates, dim=1).values if candidates.shape[1] else candidates


def candidates_decode(q, weights, k_cache, seq_lens, block_table, out, candidates, ratio,
                      next_n, block_size, cb, max_candidates):
    _need_select(out.shape[1], "top-k ids")
    _need_select(candidates.shape[1], "candidate blocks")
    n_rows = q.shape[0]
    width = fmt.decode_width(block_table, block_size, max_candidates)
    if n_rows == 0:
        return
    if width == 0:
        out.fill_(-1)
        candidates.fill_(-1)
        return
    n = _decode_counts(seq_lens, n_rows, next_n, ratio, width)
    keys = torch.empty(n_rows, width, dtype=torch.int64, device=q.device)
    bkeys = torch.empty(n_rows, triton.cdiv(width, cb), dtype=torch.int64, device=q.device)
    _paged(q, weights, k_cache, block_table, ratio, next_n, block_size).launch(
        n, 0, n_rows, keys, bkeys, None, cb)
    _select_rows(keys, out, n)
    _select_rows(bkeys, candidates, torch.div(n + cb - 1, cb, rounding_mode="floor").to(
        torch.int32))


def topk_in_candidates_decode(q, weights, k_cache, seq_lens, block_table, candidates, out,
                              ratio, next_n, block_size, cb):
    _need_select(out.shape[1], "top-k ids")
    n_rows = q.shape[0]
    if n_rows == 0:
        return
    width = fmt.decode_width(block_table, block_size, None)
    if width == 0 or candidates.shape[1] == 0:
        out.fill_(-1)
        return
    n = _decode_counts(seq_lens, n_rows, next_n, ratio, width)
    keys = torch.empty(n_rows, candidates.shape[1] * cb, dtype=torch.int64, device=q.device)
    _paged(q, weights, k_cache, block_table, ratio, next_n, block_size).launch(
        n, 0, n_rows, keys, None, _sorted(candidates), cb)
    _select_rows(keys, out, None)


def _dense(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, ratio):
    """(the key source, each token's causal count min(C_r, (p + 1) // ratio) int32): the
    token's request found on the device (cu_seqlens_q is non-decreasing)."""
    src = _Keys(q, weights, ratio)
    src.kfp8 = k.dtype != torch.bfloat16
    t = torch.arange(q.shape[0], device=q.device)
    req = torch.searchsorted(cu_seqlens_q[1:].long().contiguous(), t, right=True)
    cu_k = cu_seqlens_k.long()
    k0 = cu_k[req]
    p1 = positions[:q.shape[0]].long() + 1
    n = torch.minimum(cu_k[req + 1] - k0, torch.div(p1.clamp_min(0), ratio,
                                                    rounding_mode="floor"))
    src.dense = (_bytes(k), k.stride(0), k_scale if src.kfp8 else weights, k0)
    return src, n.to(torch.int32)


def _max_width(cu_seqlens_k, max_seqlen_k):
    if max_seqlen_k is not None:
        return max_seqlen_k
    lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]      # one host sync; max_seqlen_k avoids it
    return int(lens.max()) if lens.numel() else 0


def candidates_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, out,
                       candidates, ratio, cb, chunk, max_seqlen_k):
    _need_select(out.shape[1], "top-k ids")
    _need_select(candidates.shape[1], "candidate blocks")
    n_rows = q.shape[0]
    if n_rows == 0:
        return
    width = _max_width(cu_seqlens_k, max_seqlen_k)
    if width == 0:
        out.fill_(-1)
        candidates.fill_(-1)
        return
    src, n = _dense(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, ratio)
    n = n.clamp_max(width)
    nblk = triton.cdiv(width, cb)
    rows = min(chunk or fmt.auto_chunk(width + nblk, src.cfg["chunk_bytes"]), n_rows)
    keys = torch.empty(rows, width, dtype=torch.int64, device=q.device)
    bkeys = torch.empty(rows, nblk, dtype=torch.int64, device=q.device)
    for s in range(0, n_rows, rows):
        m = min(rows, n_rows - s)
        src.launch(n, s, m, keys, bkeys, None, cb)
        _select_rows(keys[:m], out[s:s + m], n[s:s + m])
        _select_rows(bkeys[:m], candidates[s:s + m],
                     torch.div(n[s:s + m] + cb - 1, cb, rounding_mode="floor").to(torch.int32))


def topk_in_candidates_prefill(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions,
                               candidates, out, ratio, cb):
    _need_select(out.shape[1], "top-k ids")
    n_rows = q.shape[0]
    if n_rows == 0:
        return
    if candidates.shape[1] == 0 or k.shape[0] == 0:
        out.fill_(-1)
        return
    src, n = _dense(q, weights, k, k_scale, cu_seqlens_q, cu_seqlens_k, positions, ratio)
    width = candidates.shape[1] * cb
    rows = min(fmt.auto_chunk(width, src.cfg["chunk_bytes"]), n_rows)
    keys = torch.empty(rows, width, dtype=torch.int64, device=q.device)
    cand = _sorted(candidates)
    for s in range(0, n_rows, rows):
        m = min(rows, n_rows - s)
        src.launch(n, s, m, keys, None, cand, cb)
        _select_rows(keys[:m], out[s:s + m], None)
