"""TRTLLM-gen-semantics sparse MLA decode (docs/semantics.md §6) as ``sparse_mla::`` custom ops.

* ``trtllm_decode_dsv4``: FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4`` (DeepSeek-V4,
  plain bf16 / per-tensor-fp8 SWA and compressed pools, 512-dim q/k/v).
* ``trtllm_decode_v32``: FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla(...,
  sparse_mla_top_k=K)`` as vLLM's V3.2 ``FlashInferMLASparseBackend`` calls it (576-dim q/k,
  512-dim v, one plain cache, global token indices).

Each op: validate (raises before anything is written) → dispatch → implementation:
reference.py / triton_impl.py translate the arguments into ``KeySource`` lists of the shared
attention core, so the reference and the Triton kernel are the shared ones. Vendor
(vendor.py): FlashInfer, imported lazily, only on SM100/SM103 with ``flashinfer`` installed;
the argument translation is a pure function (``dsv4_vendor_arguments``,
``v32_vendor_arguments``) unit-tested on CPU; **FlashInfer's kernel itself was never run by
this project (no SM100 GPU was available), so the vendor path is unverified.**

Addressing: FlashInfer's TRTLLM-gen kernels see a pool as flat token rows (page size 1): slot
``s`` is read at ``base + s * token_stride``. For a contiguous pool that is page
``s // page_size``, offset ``s % page_size``; for a "packed" pool (pages further apart than
``page_size`` rows, docs/semantics.md §2.3) callers must already have remapped slots to the page
span, and this op reads exactly what FlashInfer reads. Slots outside ``[0, rows)`` are skipped.

No host syncs on the hot path. Per-token column counts: a dense batch (one query length)
hands ``seq_lens`` / ``sparse_topk_lens`` to the kernels as they are (``KeySource.causal`` /
``length_offset``); a varlen batch's counts are computed with tensor ops (one Triton launch on
the Triton path). ``max_q_len`` arrives as a Python int. Value checks (lens range, seq_len >=
q_len, slots in range) run for CPU tensors, or with ``SPARSE_MLA_CHECK_VALUES=1``
(ops/common/checks.py). Tensor-form ``bmm1_scale`` / ``bmm2_scale`` are read on the device by
the Triton path (no sync: a CUDA graph replay sees their current values) and on the host by
the reference.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from sparse_mla.ops.common import checks
from sparse_mla.ops.common.dispatch import implementations
from sparse_mla.ops.common.opdef import custom_op
from sparse_mla.ops.trtllm_decode import reference, triton_impl, vendor
from sparse_mla.ops.trtllm_decode.reference import DSV4_DIM, SWA_COLS, V32_DIM, V_DIM

I32 = torch.int32
TOPK_ALIGNMENT = 4                    # TRTLLM-gen loads index rows with 16-byte cp.async
MAX_HEADS = 128
KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
LAYOUTS = ("HND", "NHD")
# what a slot addresses: FlashInfer reads a pool as flat token rows (reference.flat_rows)
_POOL_ROWS = "a row of its pool ({capacity} rows = pages * page_size, flat token addressing)"


# ---------------------------------------------------------------------------------------------
# argument checks shared by both ops (the checks themselves: ops/common/checks.py)

def _check_pool(name: str, cache: Tensor, kv_layout: str, width: int) -> Tensor:
    """Validate one pool and return its ``[pages, page_size, width]`` view."""
    checks.expect_dtype(name, cache, KV_DTYPES)
    if cache.dim() == 3:
        if kv_layout != "HND":
            raise ValueError(f"{name} is 3-D [pages, page_size, {width}], which FlashInfer "
                             f"accepts only with kv_layout='HND', got kv_layout={kv_layout!r}")
    elif cache.dim() == 4:
        if kv_layout == "HND" and cache.shape[1] != 1:
            raise ValueError(f"{name} with kv_layout='HND' must be [pages, 1, page_size, "
                             f"{width}] (one KV head), got {list(cache.shape)}")
        if kv_layout == "NHD" and cache.shape[2] != 1:
            raise ValueError(f"{name} with kv_layout='NHD' must be [pages, page_size, 1, "
                             f"{width}] (one KV head), got {list(cache.shape)}")
    else:
        raise ValueError(f"{name} must be 3-D [pages, page_size, {width}] or 4-D "
                         f"(HND [pages, 1, page_size, {width}] / NHD [pages, page_size, 1, "
                         f"{width}]), got {list(cache.shape)}")
    v = reference.pool_view(cache, kv_layout)
    if v.shape[-1] != width:
        raise ValueError(f"{name} head dim must be {width}, got {v.shape[-1]}")
    checks.expect_last_dim_contiguous(name, v)
    pages, ps = v.shape[0], v.shape[1]
    if pages < 1 or ps < 1:
        raise ValueError(f"{name} must hold at least one page of at least one token, "
                         f"got {list(cache.shape)}")
    tok = reference.token_stride(v)
    if tok < width:
        raise ValueError(f"{name} token rows overlap: token stride {tok} < head dim {width}")
    if pages > 1 and (v.stride(0) % tok or v.stride(0) < ps * tok):
        raise ValueError(f"{name} page stride {v.stride(0)} must be a multiple of the token "
                         f"stride {tok} and at least page_size * token stride = {ps * tok} "
                         f"(FlashInfer addresses slot s at base + s * token_stride)")
    return v


def _check_scales(bmm1_scale, bmm1_scale_tensor, bmm2_scale, bmm2_scale_tensor):
    for name, v in (("bmm1_scale", bmm1_scale), ("bmm2_scale", bmm2_scale)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be a float (or pass a tensor), got {type(v).__name__}")
        if not math.isfinite(v):
            raise ValueError(f"{name} must be finite, got {v}")
    for name, t in (("bmm1_scale", bmm1_scale_tensor), ("bmm2_scale", bmm2_scale_tensor)):
        if t is not None:
            checks.expect_scalar_tensor(name, t)


def _check_query_batch(query, width, cum_seq_lens_q, max_q_len, allow_flat_tokens=False):
    """Returns (T, B, Q, H). ``Q`` is the per-request token count of the dense form, or
    ``max_q_len`` for the varlen form."""
    checks.expect_dtype("query", query, KV_DTYPES)
    if cum_seq_lens_q is not None:
        if query.dim() != 3 or query.shape[2] != width:
            raise ValueError(f"query must have shape [sum_q, num_heads, {width}] when "
                             f"cum_seq_lens_q is given, got {list(query.shape)}")
        checks.expect_dtype("cum_seq_lens_q", cum_seq_lens_q, I32)
        if cum_seq_lens_q.dim() != 1 or cum_seq_lens_q.shape[0] < 2:
            raise ValueError(f"cum_seq_lens_q must be 1-D [batch_size + 1] with at least 2 "
                             f"entries, got shape {list(cum_seq_lens_q.shape)}")
        if max_q_len is None:
            raise ValueError("max_q_len is required with cum_seq_lens_q (it avoids a "
                             "device-to-host sync)")
        checks.expect_int("max_q_len", max_q_len, 1)
        T, H = query.shape[0], query.shape[1]
        B, Q = cum_seq_lens_q.shape[0] - 1, max_q_len
    elif query.dim() == 4:
        if query.shape[3] != width:
            raise ValueError(f"query must have shape [batch_size, q_len, num_heads, {width}], "
                             f"got {list(query.shape)}")
        B, Q, H = query.shape[0], query.shape[1], query.shape[2]
        if max_q_len is not None:
            checks.expect_int("max_q_len", max_q_len, 1)
            if max_q_len != Q:
                raise ValueError(f"max_q_len must equal query.shape[1] = {Q} for the dense "
                                 f"[batch_size, q_len, num_heads, {width}] form, got {max_q_len}")
        T = B * Q
    elif query.dim() == 3 and allow_flat_tokens and query.shape[2] == width:
        T, H = query.shape[0], query.shape[1]
        B, Q = T, 1
    else:
        form = f"[batch_size, q_len, num_heads, {width}]"
        if allow_flat_tokens:
            form += f" or [num_tokens, num_heads, {width}]"
        raise ValueError(f"query must have shape {form} (or [sum_q, num_heads, {width}] with "
                         f"cum_seq_lens_q), got {list(query.shape)}")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"query has {H} heads; expected 1..{MAX_HEADS}")
    checks.expect_last_dim_contiguous("query", query)
    return T, B, Q, H


def _check_out(out, query, T, H):
    checks.expect_dtype("out", out, torch.bfloat16)
    want = list(query.shape[:-1]) + [V_DIM]
    if list(out.shape) != want:
        raise ValueError(f"out must have shape {want}, got {list(out.shape)}")
    checks.expect_last_dim_contiguous("out", out)
    try:
        out.view(T, H, V_DIM)
    except RuntimeError:
        raise ValueError(f"out must be viewable as [{T}, {H}, {V_DIM}] (tokens flattened) "
                         f"without a copy, got strides {out.stride()}") from None


def _check_sinks(sinks, H):
    if sinks is not None:
        checks.expect_dtype("sinks", sinks, torch.float32)
        checks.expect_shape("sinks", sinks, (H,))


def _check_requests(cum_seq_lens_q, max_q_len, T):
    """Values: ``cum_seq_lens_q`` non-decreasing inside the query rows, no request longer than
    ``max_q_len``; returns the query lengths."""
    ql = checks.expect_query_starts("cum_seq_lens_q", cum_seq_lens_q, "q_len", lo=0, hi=T,
                                    note=" (query rows)")
    if int(ql.max()) > max_q_len:
        raise ValueError(f"max_q_len = {max_q_len} is smaller than the longest request "
                         f"({int(ql.max())} query tokens)")
    return ql


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4: trtllm_batch_decode_sparse_mla_dsv4

def _validate_dsv4(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens,
                   seq_lens, out, bmm1_scale, bmm1_scale_tensor, bmm2_scale, bmm2_scale_tensor,
                   sinks, kv_layout, cum_seq_lens_q, max_q_len, workspace_buffer):
    if kv_layout not in LAYOUTS:
        raise ValueError(f"kv_layout must be 'HND' or 'NHD', got {kv_layout!r}")
    T, B, Q, H = _check_query_batch(query, DSV4_DIM, cum_seq_lens_q, max_q_len)
    swa = _check_pool("swa_kv_cache", swa_kv_cache, kv_layout, DSV4_DIM)
    cmp = _check_pool("compressed_kv_cache", compressed_kv_cache, kv_layout, DSV4_DIM)
    for name, c in (("swa_kv_cache", swa), ("compressed_kv_cache", cmp)):
        if c.dtype != query.dtype:
            raise TypeError(f"{name} dtype must match query dtype (TRTLLM-gen reads q and KV in "
                            f"one precision), got {str(c.dtype).removeprefix('torch.')} and "
                            f"{str(query.dtype).removeprefix('torch.')}")
    checks.expect_dtype("sparse_indices", sparse_indices, I32)
    if sparse_indices.dim() != 2 or sparse_indices.shape[0] != T:
        raise ValueError(f"sparse_indices must have shape [{T}, TOPK] (one row per query "
                         f"token), got {list(sparse_indices.shape)}")
    topk = sparse_indices.shape[1]
    if topk < SWA_COLS:
        raise ValueError(f"sparse_indices must include the fixed {SWA_COLS} SWA columns: "
                         f"TOPK >= {SWA_COLS}, got {topk}")
    if topk % TOPK_ALIGNMENT:
        raise ValueError(f"sparse_indices last dimension (TOPK) must be a multiple of "
                         f"{TOPK_ALIGNMENT} (16-byte rows), got {topk}")
    checks.expect_dtype("sparse_topk_lens", sparse_topk_lens, I32)
    checks.expect_shape("sparse_topk_lens", sparse_topk_lens, (T,))
    checks.expect_dtype("seq_lens", seq_lens, I32)
    checks.expect_shape("seq_lens", seq_lens, (B,))
    _check_out(out, query, T, H)
    _check_scales(bmm1_scale, bmm1_scale_tensor, bmm2_scale, bmm2_scale_tensor)
    _check_sinks(sinks, H)
    if workspace_buffer is not None and not isinstance(workspace_buffer, Tensor):
        raise TypeError("workspace_buffer must be a tensor or None")
    checks.expect_same_device(query=query, swa_kv_cache=swa_kv_cache,
                              compressed_kv_cache=compressed_kv_cache,
                              sparse_indices=sparse_indices, sparse_topk_lens=sparse_topk_lens,
                              seq_lens=seq_lens, out=out, sinks=sinks,
                              cum_seq_lens_q=cum_seq_lens_q, bmm1_scale=bmm1_scale_tensor,
                              bmm2_scale=bmm2_scale_tensor, workspace_buffer=workspace_buffer)
    if checks.value_checks_enabled(query, sparse_topk_lens, seq_lens, sparse_indices):
        checks.expect_values_in("sparse_topk_lens", sparse_topk_lens, SWA_COLS, topk,
                                f" (it counts the {SWA_COLS} SWA columns; TOPK = {topk})",
                                "token")
        if cum_seq_lens_q is not None:
            ql = _check_requests(cum_seq_lens_q, max_q_len, T)
        else:
            ql = torch.full((B,), Q, dtype=torch.long, device=seq_lens.device)
        checks.expect_seq_lens_cover(seq_lens, ql, "q_len",
                                     " (TRTLLM-gen derives the SWA window from it)")
        swa_len, cmp_len = reference.dsv4_lengths(T, B, Q, sparse_topk_lens, seq_lens,
                                                  cum_seq_lens_q, topk)
        checks.expect_active_slots("sparse_indices", sparse_indices[:, :SWA_COLS], swa_len,
                                   reference.pool_rows(swa), _POOL_ROWS)
        checks.expect_active_slots("sparse_indices[:, 128:]", sparse_indices[:, SWA_COLS:],
                                   cmp_len, reference.pool_rows(cmp), _POOL_ROWS)
    return T, B, Q, H, swa, cmp


_DSV4 = implementations("trtllm_decode_dsv4", vendor=vendor.DSV4, triton=triton_impl.dsv4,
                       reference=reference.dsv4, triton_planner=triton_impl.plan_dsv4)


@custom_op("sparse_mla::trtllm_decode_dsv4",
           mutates_args=("out", "workspace_buffer"),
           caches=("swa_kv_cache", "compressed_kv_cache"))
def trtllm_decode_dsv4(query: Tensor, swa_kv_cache: Tensor, sparse_indices: Tensor,
                       compressed_kv_cache: Tensor, sparse_topk_lens: Tensor, seq_lens: Tensor,
                       out: Tensor, bmm1_scale: float = 1.0,
                       bmm1_scale_tensor: Optional[Tensor] = None, bmm2_scale: float = 1.0,
                       bmm2_scale_tensor: Optional[Tensor] = None,
                       sinks: Optional[Tensor] = None, kv_layout: str = "HND",
                       cum_seq_lens_q: Optional[Tensor] = None,
                       max_q_len: Optional[int] = None,
                       workspace_buffer: Optional[Tensor] = None, impl: str = "auto") -> None:
    """DeepSeek-V4 sparse decode with TRTLLM-gen semantics (docs/semantics.md §6); writes ``out``.

    Per query token ``t`` of request ``b`` (token ``q_idx`` of its ``q_len``), keys are the
    union of: SWA pool rows ``sparse_indices[t, j]`` for ``j < min(seq_lens[b] - q_len + q_idx
    + 1, 128)``, and compressed pool rows ``sparse_indices[t, j]`` for ``128 <= j <
    sparse_topk_lens[t]``. Entries that are negative or beyond the pool are skipped — in
    particular a -1 inside the active compressed range is skipped (TRTLLM-gen's own behaviour
    for that case is UNCONFIRMED: closed-source cubins; FlashInfer's test reference masks -1
    and vLLM never produces it). Softmax scale ``bmm1_scale`` (natural units, fp8: ``scale *
    q_scale * kv_scale``), output multiplier ``bmm2_scale`` (fp8: ``kv_scale``), sink
    ``o *= sigmoid(lse - sinks[h])``; no valid key ⇒ 0. Rows of a varlen query outside
    ``cum_seq_lens_q`` get output 0. ``bmm*_scale_tensor`` (fp32, one element) replaces the
    float when given.
    """
    _validate_dsv4(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens,
                   seq_lens, out, bmm1_scale, bmm1_scale_tensor, bmm2_scale, bmm2_scale_tensor,
                   sinks, kv_layout, cum_seq_lens_q, max_q_len, workspace_buffer)
    _DSV4(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens, seq_lens,
          out, bmm1_scale, bmm1_scale_tensor, bmm2_scale, bmm2_scale_tensor, sinks, kv_layout,
          cum_seq_lens_q, max_q_len, workspace_buffer, impl=impl)


@trtllm_decode_dsv4.register_fake
def _(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens, seq_lens, out,
      bmm1_scale=1.0, bmm1_scale_tensor=None, bmm2_scale=1.0, bmm2_scale_tensor=None,
      sinks=None, kv_layout="HND", cum_seq_lens_q=None, max_q_len=None, workspace_buffer=None,
      impl="auto"):
    _validate_dsv4(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens,
                   seq_lens, out, bmm1_scale, bmm1_scale_tensor, bmm2_scale, bmm2_scale_tensor,
                   sinks, kv_layout, cum_seq_lens_q, max_q_len, workspace_buffer)


def _split_scale(v):
    if isinstance(v, Tensor):
        return 1.0, v
    return v, None


def _split_scales(bmm1_scale, bmm2_scale):
    """FlashInfer's float-or-tensor scales as the ops' (float, tensor) argument pairs."""
    return (*_split_scale(bmm1_scale), *_split_scale(bmm2_scale))


def workspace_arg(workspace_buffer, query):
    """The workspace to hand the custom ops: the caller's, or a 0-element placeholder for
    "none" (the vendor route then uses its process-wide one). Never None, because torch
    2.11's custom-op wrapper drops a mutated argument left at its default and then fails
    bumping its version (IndexError; seen on CPU and on the H200); torch 2.13 does not."""
    if workspace_buffer is None:
        return torch.empty(0, dtype=torch.uint8, device=query.device)
    return workspace_buffer


def _out_or_new(query, out):
    """``out``, or a new bf16 ``[..., 512]`` output shaped like ``query``."""
    if out is None:
        checks.expect_dtype("query", query, KV_DTYPES)
        out = torch.empty(list(query.shape[:-1]) + [V_DIM], dtype=torch.bfloat16,
                          device=query.device)
    return out


def trtllm_batch_decode_sparse_mla_dsv4(query, swa_kv_cache, workspace_buffer=None,
                                        sparse_indices=None, compressed_kv_cache=None,
                                        sparse_topk_lens=None, seq_lens=None, out=None,
                                        bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
                                        kv_layout="HND", cum_seq_lens_q=None, max_q_len=None,
                                        enable_pdl=None, *, impl="auto"):
    """FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4`` signature (TRTLLM-gen arguments
    only); returns ``out`` (bf16 ``[..., H, 512]``, allocated when not given). ``bmm1_scale`` /
    ``bmm2_scale``: float or fp32 tensor. ``enable_pdl`` is accepted and ignored."""
    for name, v in (("sparse_indices", sparse_indices),
                    ("compressed_kv_cache", compressed_kv_cache),
                    ("sparse_topk_lens", sparse_topk_lens), ("seq_lens", seq_lens)):
        if v is None:
            raise ValueError(f"{name} is required (TRTLLM-gen DSv4 decode)")
    out = _out_or_new(query, out)
    b1, b1t, b2, b2t = _split_scales(bmm1_scale, bmm2_scale)
    trtllm_decode_dsv4(query, swa_kv_cache, sparse_indices, compressed_kv_cache,
                       sparse_topk_lens, seq_lens, out, b1, b1t, b2, b2t, sinks, kv_layout,
                       cum_seq_lens_q, max_q_len, workspace_arg(workspace_buffer, query), impl)
    return out


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3.2: trtllm_batch_decode_with_kv_cache_mla(..., sparse_mla_top_k=K)

def _validate_v32(query, kv_cache, block_tables, seq_lens, out, bmm1_scale, bmm1_scale_tensor,
                  bmm2_scale, bmm2_scale_tensor, sinks, cum_seq_lens_q, max_q_len,
                  workspace_buffer):
    T, B, Q, H = _check_query_batch(query, V32_DIM, cum_seq_lens_q, max_q_len,
                                    allow_flat_tokens=True)
    cache = _check_pool("kv_cache", kv_cache, "HND", V32_DIM)
    if cache.dtype != query.dtype:
        raise TypeError(f"kv_cache dtype must match query dtype (TRTLLM-gen sparse MLA reads "
                        f"q and KV in one precision), got "
                        f"{str(cache.dtype).removeprefix('torch.')} and "
                        f"{str(query.dtype).removeprefix('torch.')}")
    checks.expect_dtype("block_tables", block_tables, I32)
    dense = query.dim() == 4
    ok = (block_tables.dim() == 2 and block_tables.shape[0] == T) or (
        dense and block_tables.dim() == 3 and tuple(block_tables.shape[:2]) == (B, Q)) or (
        not dense and cum_seq_lens_q is None and block_tables.dim() == 3
        and tuple(block_tables.shape[:2]) == (T, 1))
    if not ok or block_tables.shape[-1] < 1:
        raise ValueError(f"block_tables must hold one row of K >= 1 global token indices per "
                         f"query token: [{T}, K]" + (f" or [{B}, {Q}, K]" if dense else "")
                         + (f" or [{T}, 1, K]" if not dense and cum_seq_lens_q is None else "")
                         + f", got {list(block_tables.shape)}")
    checks.expect_dtype("seq_lens", seq_lens, I32)
    checks.expect_shape("seq_lens", seq_lens, (B,))
    _check_out(out, query, T, H)
    _check_scales(bmm1_scale, bmm1_scale_tensor, bmm2_scale, bmm2_scale_tensor)
    _check_sinks(sinks, H)
    checks.expect_same_device(query=query, kv_cache=kv_cache, block_tables=block_tables,
                              seq_lens=seq_lens, out=out, sinks=sinks,
                              cum_seq_lens_q=cum_seq_lens_q, bmm1_scale=bmm1_scale_tensor,
                              bmm2_scale=bmm2_scale_tensor,
                              workspace_buffer=workspace_buffer)
    if checks.value_checks_enabled(query, seq_lens, block_tables):
        checks.expect_values_in("seq_lens (valid top-k counts)", seq_lens, 0, entry="request")
        if cum_seq_lens_q is not None:
            _check_requests(cum_seq_lens_q, max_q_len, T)
        idx = block_tables.reshape(T, -1)
        checks.expect_active_slots(
            "block_tables", idx,
            reference.v32_lengths(T, B, Q, seq_lens, cum_seq_lens_q, idx.shape[1]),
            reference.pool_rows(cache), _POOL_ROWS)
    return T, B, Q, H


_V32 = implementations("trtllm_decode_v32", vendor=vendor.V32, triton=triton_impl.v32,
                      reference=reference.v32, triton_planner=triton_impl.plan_v32)


@custom_op("sparse_mla::trtllm_decode_v32", mutates_args=("out", "workspace_buffer"),
           caches=("kv_cache",))
def trtllm_decode_v32(query: Tensor, kv_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                      out: Tensor, bmm1_scale: float = 1.0,
                      bmm1_scale_tensor: Optional[Tensor] = None, bmm2_scale: float = 1.0,
                      bmm2_scale_tensor: Optional[Tensor] = None,
                      sinks: Optional[Tensor] = None, cum_seq_lens_q: Optional[Tensor] = None,
                      max_q_len: Optional[int] = None,
                      workspace_buffer: Optional[Tensor] = None, impl: str = "auto") -> None:
    """DeepSeek-V3.2 sparse MLA decode with TRTLLM-gen semantics (docs/semantics.md §6 last bullet).

    ``query`` ``[T, H, 576]`` (one token per request, vLLM's call: ``seq_lens`` ``[T]``),
    ``[B, Q, H, 576]``, or varlen ``[sum_q, H, 576]`` with ``cum_seq_lens_q``/``max_q_len``;
    ``kv_cache`` ``[pages, page_size, 576]`` or ``[pages, 1, page_size, 576]`` (bf16, or e4m3
    with an e4m3 query); ``block_tables`` global token rows ``[T, K]`` / ``[T, 1, K]`` /
    ``[B, Q, K]``, -1 invalid; ``seq_lens`` ``[B]``: the number of leading columns each token
    of request ``b`` may use (vLLM passes the per-token valid count; values above K mean all
    K). Scores use all 576 dims, the output the first 512. For Q > 1 every token of a request
    uses the same ``seq_lens[b]`` columns (no extra causal mask) — UNCONFIRMED against the
    kernel (vLLM only calls with Q = 1).
    """
    _validate_v32(query, kv_cache, block_tables, seq_lens, out, bmm1_scale, bmm1_scale_tensor,
                  bmm2_scale, bmm2_scale_tensor, sinks, cum_seq_lens_q, max_q_len,
                  workspace_buffer)
    _V32(query, kv_cache, block_tables, seq_lens, out, bmm1_scale, bmm1_scale_tensor, bmm2_scale,
         bmm2_scale_tensor, sinks, cum_seq_lens_q, max_q_len, workspace_buffer, impl=impl)


@trtllm_decode_v32.register_fake
def _(query, kv_cache, block_tables, seq_lens, out, bmm1_scale=1.0, bmm1_scale_tensor=None,
      bmm2_scale=1.0, bmm2_scale_tensor=None, sinks=None, cum_seq_lens_q=None, max_q_len=None,
      workspace_buffer=None, impl="auto"):
    _validate_v32(query, kv_cache, block_tables, seq_lens, out, bmm1_scale, bmm1_scale_tensor,
                  bmm2_scale, bmm2_scale_tensor, sinks, cum_seq_lens_q, max_q_len,
                  workspace_buffer)


def trtllm_batch_decode_with_kv_cache_mla(query, kv_cache, workspace_buffer=None,
                                          qk_nope_head_dim=128, kv_lora_rank=512,
                                          qk_rope_head_dim=64, block_tables=None,
                                          seq_lens=None, max_seq_len=None, sparse_mla_top_k=0,
                                          out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None,
                                          cum_seq_lens_q=None, max_q_len=None, *,
                                          impl="auto"):
    """FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla`` signature, sparse V3.2 case only
    (``sparse_mla_top_k = K > 0``, kv_lora_rank 512, qk_rope_head_dim 64). Returns ``out``.
    ``max_seq_len`` and ``qk_nope_head_dim`` are scheduling / bookkeeping values and are only
    type-checked. ``sinks`` may be a tensor or a one-element list (FlashInfer's form)."""
    if kv_lora_rank != 512 or qk_rope_head_dim != 64:
        raise ValueError(f"only V3.2 sparse MLA is served: kv_lora_rank 512, qk_rope_head_dim "
                         f"64, got {kv_lora_rank}, {qk_rope_head_dim}")
    if block_tables is None or seq_lens is None:
        raise ValueError("block_tables and seq_lens are required")
    checks.expect_int("sparse_mla_top_k", sparse_mla_top_k, 1)
    if sparse_mla_top_k != block_tables.shape[-1]:
        raise ValueError(f"sparse_mla_top_k = {sparse_mla_top_k} must equal "
                         f"block_tables.shape[-1] = {block_tables.shape[-1]}")
    if max_seq_len is not None:
        checks.expect_int("max_seq_len", max_seq_len, 0)
    if isinstance(sinks, (list, tuple)):
        if len(sinks) != 1:
            raise ValueError(f"sinks must be one tensor or a one-element list, got {len(sinks)}")
        sinks = sinks[0]
    out = _out_or_new(query, out)
    b1, b1t, b2, b2t = _split_scales(bmm1_scale, bmm2_scale)
    trtllm_decode_v32(query, kv_cache, block_tables, seq_lens, out, b1, b1t, b2, b2t, sinks,
                      cum_seq_lens_q, max_q_len, workspace_arg(workspace_buffer, query), impl)
    return out
