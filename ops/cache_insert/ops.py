"""The cache-insert ops (docs/semantics.md §2, §3) as ``sparse_mla::`` custom ops.

Each op: validate (raises before anything is written) → dispatch (triton or reference; no
vendor kernel exists for cache writes) → implementation. The fake implementations validate
shapes too, so torch.compile traces fail with the same messages.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.ops.cache_insert import reference, triton_impl, vendor
from sparse_mla.ops.common import checks, formats
from sparse_mla.ops.common.dispatch import implementations
from sparse_mla.ops.common.opdef import custom_op

FLOAT_IN = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEADS = 128


def _check_slots(slot_mapping, n_tokens, capacity, *others):
    checks.expect_vector("slot_mapping", slot_mapping, checks.INDEX_DTYPES, at_most=n_tokens,
                         note=" (one per token)")
    if checks.value_checks_enabled(slot_mapping, *others):
        checks.expect_slots_in_range("slot_mapping", slot_mapping, capacity)


def _check_rope_inputs(q, kv, positions, cos_sin_cache):
    checks.expect_dtype("q", q, FLOAT_IN)
    if q.dim() != 3 or q.shape[2] != formats.HEAD_DIM:
        raise ValueError(f"q must have shape [num_tokens, num_heads, 512], got {list(q.shape)}")
    n, h = q.shape[0], q.shape[1]
    if not 1 <= h <= MAX_HEADS:
        raise ValueError(f"q has {h} heads; expected 1..{MAX_HEADS}")
    checks.expect_last_dim_contiguous("q", q)
    _check_kv_rope_inputs(kv, n, positions, cos_sin_cache, q)
    return n, h


def _check_kv_rope_inputs(kv, n, positions, cos_sin_cache, other):
    """``kv`` [n, 512], ``positions`` [n] in the rows of ``cos_sin_cache`` [max_pos, 64]
    (values where ``checks.value_checks_enabled`` for ``positions`` and ``other``)."""
    checks.expect_tensor("kv", kv, FLOAT_IN, (n, formats.HEAD_DIM))
    checks.expect_dtype("positions", positions, checks.INDEX_DTYPES)
    checks.expect_shape("positions", positions, (n,))
    checks.expect_dtype("cos_sin_cache", cos_sin_cache, torch.float32)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != formats.ROPE_DIM:
        raise ValueError(f"cos_sin_cache must have shape [max_position, 64] (cos[0:32] || "
                         f"sin[0:32]), got {list(cos_sin_cache.shape)}")
    if cos_sin_cache.shape[0] == 0:
        raise ValueError("cos_sin_cache has no rows")
    checks.expect_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    if checks.value_checks_enabled(positions, other):
        checks.expect_indices("positions", positions, cos_sin_cache.shape[0],
                              " (rows of cos_sin_cache)", "token")


def _check_q_out(q_out, n, h, dtype):
    checks.expect_dtype("q_out", q_out, dtype)
    if q_out.dim() != 3 or q_out.shape[0] != n or q_out.shape[2] != formats.HEAD_DIM \
            or not h <= q_out.shape[1] <= MAX_HEADS:
        raise ValueError(f"q_out must have shape [{n}, H_padded, 512] with {h} <= H_padded <= "
                         f"{MAX_HEADS}, got {list(q_out.shape)}")
    checks.expect_last_dim_contiguous("q_out", q_out)


# ---------------------------------------------------------------------------------------------
# quantize + insert into a V4 584 B cache (docs/semantics.md §2.2, §3.4)

_V4_INSERT = implementations("quantize_insert_v4", vendor=vendor.ROUTE,
                             triton=triton_impl.quantize_insert_v4,
                             reference=reference.quantize_insert_v4)


def _validate_v4_insert(k, k_cache, slot_mapping, block_size):
    bs = checks.paged_cache_block_size("k_cache", k_cache, formats.V4, block_size)
    n = k.shape[0] if k.dim() == 2 else -1
    checks.expect_tensor("k", k, FLOAT_IN, (n, formats.HEAD_DIM))
    _check_slots(slot_mapping, n, k_cache.shape[0] * bs, k)
    checks.expect_same_device(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
    return bs


@custom_op("sparse_mla::quantize_insert_v4", mutates_args=("k_cache",))
def quantize_insert_v4(k: Tensor, k_cache: Tensor, slot_mapping: Tensor,
                       block_size: Optional[int] = None, impl: str = "auto") -> None:
    """Quantize rows ``k`` [N, 512] into a V4 584 B paged cache at ``slot_mapping`` (−1 skips).

    ``k_cache``: uint8 ``[num_blocks, bytes]`` (pass ``block_size``), ``[num_blocks, bs, 584]``
    or ``[num_blocks, bs, 1, 584]``; blocks addressed through ``stride(0)``.
    """
    bs = _validate_v4_insert(k, k_cache, slot_mapping, block_size)
    _V4_INSERT(k, k_cache, slot_mapping, bs, impl=impl)


@quantize_insert_v4.register_fake
def _(k, k_cache, slot_mapping, block_size=None, impl="auto"):
    _validate_v4_insert(k, k_cache, slot_mapping, block_size)


# ---------------------------------------------------------------------------------------------
# V3.2 656 B insert (docs/semantics.md §2.1)

_V32_INSERT = implementations("quantize_insert_v32", vendor=vendor.ROUTE,
                              triton=triton_impl.quantize_insert_v32,
                              reference=reference.quantize_insert_v32)


def _validate_v32_insert(kv_c, k_pe, kv_cache, slot_mapping, block_size, scale_format):
    if scale_format not in ("fp32", "pow2"):
        raise ValueError(f"scale_format must be 'fp32' (vLLM) or 'pow2' (FlashMLA tests), "
                         f"got {scale_format!r}")
    bs = checks.paged_cache_block_size("kv_cache", kv_cache, formats.V32, block_size)
    n = kv_c.shape[0] if kv_c.dim() == 2 else -1
    checks.expect_tensor("kv_c", kv_c, FLOAT_IN, (n, 512))
    checks.expect_tensor("k_pe", k_pe, FLOAT_IN, (n, 64))
    _check_slots(slot_mapping, n, kv_cache.shape[0] * bs, kv_c)
    checks.expect_same_device(kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping)
    return bs


@custom_op("sparse_mla::quantize_insert_v32", mutates_args=("kv_cache",))
def quantize_insert_v32(kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                        block_size: Optional[int] = None, scale_format: str = "fp32",
                        impl: str = "auto") -> None:
    """Write V3.2 ``fp8_ds_mla`` records (512 e4m3 + 4 fp32 scales + 64 bf16 RoPE, 656 B)."""
    bs = _validate_v32_insert(kv_c, k_pe, kv_cache, slot_mapping, block_size, scale_format)
    _V32_INSERT(kv_c, k_pe, kv_cache, slot_mapping, bs, scale_format, impl=impl)


@quantize_insert_v32.register_fake
def _(kv_c, k_pe, kv_cache, slot_mapping, block_size=None, scale_format="fp32", impl="auto"):
    _validate_v32_insert(kv_c, k_pe, kv_cache, slot_mapping, block_size, scale_format)


_V32_NOPE_INSERT = implementations("quantize_insert_v32_nope", vendor=vendor.ROUTE,
                                   triton=triton_impl.quantize_insert_v32_nope,
                                   reference=reference.quantize_insert_v32_nope)


def _validate_v32_nope_insert(kv_c, kv_cache, slot_mapping, block_size, scale_format):
    n = kv_c.shape[0] if kv_c.dim() == 2 else -1
    k_pe_like = kv_c.new_empty(max(n, 0), 64) if n >= 0 else kv_c
    return _validate_v32_insert(kv_c, k_pe_like, kv_cache, slot_mapping, block_size,
                                scale_format)


@custom_op("sparse_mla::quantize_insert_v32_nope", mutates_args=("kv_cache",))
def quantize_insert_v32_nope(kv_c: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                             block_size: Optional[int] = None, scale_format: str = "fp32",
                             impl: str = "auto") -> None:
    """GLM-5.3 (no-RoPE MLA): the V3.2 ``fp8_ds_mla`` record from ``kv_c`` alone, RoPE bytes
    +0.0 (docs/semantics.md §13.5)."""
    bs = _validate_v32_nope_insert(kv_c, kv_cache, slot_mapping, block_size, scale_format)
    _V32_NOPE_INSERT(kv_c, kv_cache, slot_mapping, bs, scale_format, impl=impl)


@quantize_insert_v32_nope.register_fake
def _(kv_c, kv_cache, slot_mapping, block_size=None, scale_format="fp32", impl="auto"):
    _validate_v32_nope_insert(kv_c, kv_cache, slot_mapping, block_size, scale_format)


# ---------------------------------------------------------------------------------------------
# fused q-norm + RoPE + kv insert into the V4 SWA cache (docs/semantics.md §3.1)

_FUSED_V4 = implementations("fused_qnorm_rope_insert_v4", vendor=vendor.ROUTE,
                            triton=triton_impl.fused_insert_v4,
                            reference=reference.fused_insert_v4)


def _validate_fused_v4(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                       block_size):
    n, h = _check_rope_inputs(q, kv, positions, cos_sin_cache)
    _check_q_out(q_out, n, h, torch.bfloat16)
    bs = checks.paged_cache_block_size("k_cache", k_cache, formats.V4, block_size)
    _check_slots(slot_mapping, n, k_cache.shape[0] * bs, q)
    checks.expect_same_device(q=q, kv=kv, k_cache=k_cache, slot_mapping=slot_mapping,
                              positions=positions, cos_sin_cache=cos_sin_cache, q_out=q_out)
    return bs


@custom_op("sparse_mla::fused_qnorm_rope_insert_v4",
           mutates_args=("k_cache", "q_out"))
def fused_qnorm_rope_insert_v4(q: Tensor, kv: Tensor, k_cache: Tensor, slot_mapping: Tensor,
                               positions: Tensor, cos_sin_cache: Tensor, q_out: Tensor,
                               eps: float = 1e-6, block_size: Optional[int] = None,
                               apply_q_norm: bool = True, impl: str = "auto") -> None:
    """vLLM's fused V4 SWA insert (docs/semantics.md §3.1), writing ``q_out`` and ``k_cache``.

    ``q`` ``[N, H, 512]``: each head optionally RMS-normed without weight (``apply_q_norm``,
    ``eps``), then GPT-J RoPE on dims 448..511 at ``positions[t]``, into ``q_out``
    ``[N, Hp >= H, 512]`` bf16 (heads ``H..Hp`` written as zeros). ``kv`` ``[N, 512]``: RoPE at
    the same position, then quantized (§2.2) into the V4 584 B ``k_cache`` at
    ``slot_mapping[t]`` for ``t < len(slot_mapping)``; -1 skips. ``cos_sin_cache`` fp32
    ``[max_pos, 64]`` (cos then sin). ``qnorm_rope_kv_insert_v4`` is vLLM's signature.
    """
    bs = _validate_fused_v4(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                            block_size)
    _FUSED_V4(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out, eps, bs,
              apply_q_norm, impl=impl)


@fused_qnorm_rope_insert_v4.register_fake
def _(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out, eps=1e-6, block_size=None,
      apply_q_norm=True, impl="auto"):
    _validate_fused_v4(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                       block_size)


def _q_out_buffer(q, q_head_padded, out):
    """``out``, or a new bf16 ``[N, q_head_padded (default H), 512]`` q_out buffer."""
    if out is None:
        hp = q.shape[1] if q_head_padded is None else q_head_padded
        return torch.empty(q.shape[0], hp, formats.HEAD_DIM, dtype=torch.bfloat16,
                           device=q.device)
    if q_head_padded is not None and out.shape[1] != q_head_padded:
        raise ValueError(f"out has {out.shape[1]} heads but q_head_padded={q_head_padded}")
    return out


def qnorm_rope_kv_insert_v4(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, *,
                            q_head_padded=None, eps=1e-6, block_size=None, apply_q_norm=True,
                            out=None, impl="auto"):
    """vLLM's ``fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert``: returns q_out
    ``[N, q_head_padded, 512]`` bf16 (pad heads zero); kv is RoPE'd, quantized and inserted.

    Pass ``out`` (a persistent buffer) to avoid the allocation, e.g. under CUDA graphs.
    """
    out = _q_out_buffer(q, q_head_padded, out)
    fused_qnorm_rope_insert_v4(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, out,
                               eps, block_size, apply_q_norm, impl)
    return out


# ---------------------------------------------------------------------------------------------
# fused q-norm + RoPE + kv insert into a plain bf16 / per-tensor fp8 cache (docs/semantics.md §3.2)

_FUSED_PLAIN = implementations("fused_qnorm_rope_insert_plain", vendor=vendor.ROUTE,
                               triton=triton_impl.fused_insert_plain,
                               reference=reference.fused_insert_plain)


def _validate_fused_plain(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                          kv_scale, q_scale_inv):
    n, h = _check_rope_inputs(q, kv, positions, cos_sin_cache)
    fp8 = _check_plain_cache(k_cache)
    _check_q_out(q_out, n, h, torch.float8_e4m3fn if fp8 else torch.bfloat16)
    if q_out.shape[1] != h:
        raise ValueError(f"q_out must have exactly {h} heads for a plain cache (the TRTLLM "
                         f"glue pads heads itself), got {q_out.shape[1]}")
    for name, t in (("kv_scale", kv_scale), ("q_scale_inv", q_scale_inv)):
        _check_scale(name, t, fp8)
    _check_slots(slot_mapping, n, k_cache.shape[0] * k_cache.shape[1], q)
    checks.expect_same_device(q=q, kv=kv, k_cache=k_cache, slot_mapping=slot_mapping,
                              positions=positions, cos_sin_cache=cos_sin_cache, q_out=q_out,
                              kv_scale=kv_scale, q_scale_inv=q_scale_inv)


@custom_op("sparse_mla::fused_qnorm_rope_insert_plain",
           mutates_args=("k_cache", "q_out"), strided=("k_cache",))
def fused_qnorm_rope_insert_plain(q: Tensor, kv: Tensor, k_cache: Tensor, slot_mapping: Tensor,
                                  positions: Tensor, cos_sin_cache: Tensor, q_out: Tensor,
                                  kv_scale: Optional[Tensor] = None,
                                  q_scale_inv: Optional[Tensor] = None, eps: float = 1e-6,
                                  apply_q_norm: bool = True, impl: str = "auto") -> None:
    """docs/semantics.md §3.2: q → ``q_out`` (bf16, or e4m3 of ``q' * q_scale_inv`` for an
    fp8 cache); kv row → bf16 or e4m3 of ``kv' * (1 / kv_scale)`` at
    ``k_cache[slot // bs, slot % bs]``."""
    _validate_fused_plain(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                          kv_scale, q_scale_inv)
    _FUSED_PLAIN(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out, kv_scale,
                 q_scale_inv, eps, apply_q_norm, impl=impl)


@fused_qnorm_rope_insert_plain.register_fake
def _(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out, kv_scale=None,
      q_scale_inv=None, eps=1e-6, apply_q_norm=True, impl="auto"):
    _validate_fused_plain(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                          kv_scale, q_scale_inv)


# ---------------------------------------------------------------------------------------------
# insert finished rows (the compressor's) into a plain bf16 / per-tensor fp8 cache
# (docs/semantics.md §3.3)

_PLAIN_INSERT = implementations("insert_plain", vendor=vendor.ROUTE,
                                triton=triton_impl.insert_plain,
                                reference=reference.insert_plain)


def _check_plain_cache(k_cache):
    checks.expect_dtype("k_cache", k_cache, (torch.bfloat16, torch.float8_e4m3fn))
    if k_cache.dim() != 3 or k_cache.shape[2] != formats.HEAD_DIM:
        raise ValueError(f"k_cache must have shape [num_blocks, block_size, 512], "
                         f"got {list(k_cache.shape)}")
    checks.expect_last_dim_contiguous("k_cache", k_cache)
    return k_cache.dtype == torch.float8_e4m3fn


def _check_scale(name, t, fp8):
    if fp8:
        if t is None:
            raise ValueError(f"{name} is required for a float8_e4m3fn cache")
        checks.expect_scalar_tensor(name, t)
    elif t is not None:
        raise ValueError(f"{name} applies only to a float8_e4m3fn cache")


def _validate_plain_insert(k, k_cache, slot_mapping, kv_scale):
    fp8 = _check_plain_cache(k_cache)
    n = k.shape[0] if k.dim() == 2 else -1
    checks.expect_tensor("k", k, FLOAT_IN, (n, formats.HEAD_DIM))
    _check_scale("kv_scale", kv_scale, fp8)
    _check_slots(slot_mapping, n, k_cache.shape[0] * k_cache.shape[1], k)
    checks.expect_same_device(k=k, k_cache=k_cache, slot_mapping=slot_mapping,
                              kv_scale=kv_scale)


@custom_op("sparse_mla::insert_plain", mutates_args=("k_cache",), strided=("k_cache",))
def insert_plain(k: Tensor, k_cache: Tensor, slot_mapping: Tensor,
                 kv_scale: Optional[Tensor] = None, impl: str = "auto") -> None:
    """Row ``t`` of ``k`` [N, 512] (already normed and rotated: the compressor's output) goes to
    ``k_cache[slot // bs, slot % bs]`` as bf16, or for an fp8 cache as e4m3 of
    ``k * (1 / kv_scale)`` (one-element fp32 device tensor). Slots < 0 are skipped."""
    _validate_plain_insert(k, k_cache, slot_mapping, kv_scale)
    _PLAIN_INSERT(k, k_cache, slot_mapping, kv_scale, impl=impl)


@insert_plain.register_fake
def _(k, k_cache, slot_mapping, kv_scale=None, impl="auto"):
    _validate_plain_insert(k, k_cache, slot_mapping, kv_scale)


# ---------------------------------------------------------------------------------------------
# gather + dequantize a request range into a bf16 workspace (docs/semantics.md §3.4)

_GATHER = implementations("gather_dequant", vendor=vendor.ROUTE,
                          triton=triton_impl.gather_dequant,
                          reference=reference.gather_dequant)


def _validate_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                     cache_format):
    fmt = formats.get_format(cache_format)
    if not isinstance(fmt, formats.PagedFormat):
        raise ValueError(f"cache_format must be a quantized paged format "
                         f"{tuple(formats.PAGED_FORMATS)}, got {cache_format!r}")
    bs = checks.paged_cache_block_size("k_cache", k_cache, fmt, block_size)
    checks.expect_dtype("out", out, torch.bfloat16)
    if out.dim() != 3 or out.shape[2] != fmt.out_dim:
        raise ValueError(f"out must have shape [num_reqs, max_tokens, {fmt.out_dim}] for "
                         f"format {fmt.name}, got {list(out.shape)}")
    checks.expect_last_dim_contiguous("out", out)
    r = out.shape[0]
    checks.expect_dtype("seq_lens", seq_lens, checks.INDEX_DTYPES)
    checks.expect_shape("seq_lens", seq_lens, (r,))
    if gather_lens is not None:
        checks.expect_dtype("gather_lens", gather_lens, checks.INDEX_DTYPES)
        checks.expect_shape("gather_lens", gather_lens, (r,))
    checks.expect_dtype("block_table", block_table, checks.INDEX_DTYPES)
    checks.expect_shape("block_table", block_table, (r, None))
    checks.expect_last_dim_contiguous("block_table", block_table)
    checks.expect_int("offset", offset, 0)
    checks.expect_same_device(out=out, k_cache=k_cache, seq_lens=seq_lens,
                              gather_lens=gather_lens, block_table=block_table)
    if checks.value_checks_enabled(seq_lens, out):
        checks.expect_values_in("seq_lens", seq_lens, 0, entry="request")
        if gather_lens is not None and r and (
                int(gather_lens.min()) < 0 or bool((gather_lens > seq_lens).any())):
            raise ValueError("gather_lens must be in [0, seq_lens]")
    return bs


@custom_op("sparse_mla::gather_dequant", mutates_args=("out",), caches=("k_cache",))
def gather_dequant(out: Tensor, k_cache: Tensor, seq_lens: Tensor, gather_lens: Optional[Tensor],
                   block_table: Tensor, block_size: Optional[int] = None, offset: int = 0,
                   cache_format: str = "v4", impl: str = "auto") -> None:
    """For request r, dequantize positions ``[seq_len - gather_len, seq_len)`` (all ``seq_len``
    when ``gather_lens`` is None) into ``out[r, offset + i]``. Entries whose block id is
    negative / beyond the cache or whose destination row is >= ``out.shape[1]`` are skipped
    (left as they were)."""
    bs = _validate_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                          cache_format)
    _GATHER(out, k_cache, seq_lens, gather_lens, block_table, bs, offset, cache_format,
            impl=impl)


@gather_dequant.register_fake
def _(out, k_cache, seq_lens, gather_lens, block_table, block_size=None, offset=0,
      cache_format="v4", impl="auto"):
    _validate_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                     cache_format)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4.1 writers (docs/semantics.md §12): the SWA insert (q RoPE + head padding, no q
# norm) and the compressed-entry insert, for the 528 B / 288 B records and the 584 B one

_FUSED_V41 = implementations("fused_rope_insert_v41", vendor=vendor.ROUTE,
                             triton=triton_impl.fused_insert_v41,
                             reference=reference.fused_insert_v41)


def _validate_fused_v41(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                        block_size, cache_format):
    if cache_format not in formats.V41_SWA_FORMATS:
        raise ValueError(f"cache_format must be one of {formats.V41_SWA_FORMATS} for a V4.1 "
                         f"SWA cache, got {cache_format!r}")
    n, h = _check_rope_inputs(q, kv, positions, cos_sin_cache)
    _check_q_out(q_out, n, h, torch.bfloat16)
    bs = checks.paged_cache_block_size("k_cache", k_cache, formats.get_format(cache_format),
                                       block_size)
    _check_slots(slot_mapping, n, k_cache.shape[0] * bs, q)
    checks.expect_same_device(q=q, kv=kv, k_cache=k_cache, slot_mapping=slot_mapping,
                              positions=positions, cos_sin_cache=cos_sin_cache, q_out=q_out)
    return bs


@custom_op("sparse_mla::fused_rope_insert_v41", mutates_args=("k_cache", "q_out"))
def fused_rope_insert_v41(q: Tensor, kv: Tensor, k_cache: Tensor, slot_mapping: Tensor,
                          positions: Tensor, cos_sin_cache: Tensor, q_out: Tensor,
                          block_size: Optional[int] = None, cache_format: str = "v41",
                          impl: str = "auto") -> None:
    """The V4.1 SWA insert (docs/semantics.md §12): ``q`` ``[N, H, 512]`` gets GPT-J RoPE on
    dims 448..511 at ``positions[t]`` (no RMSNorm) into ``q_out`` ``[N, Hp >= H, 512]`` bf16
    (heads ``H..Hp`` zero); ``kv`` ``[N, 512]`` gets the same RoPE in fp32 and goes to
    ``k_cache`` at ``slot_mapping[t]`` (-1 skips), rounded to bf16 and back (vLLM's CUDA
    writer does), as the 528 B record (``cache_format="v41"``: page footer, vLLM 0.32;
    ``"v41_inline"``: token-inline, vLLM 0.33) or the 584 B one (``"v4"``). One launch."""
    bs = _validate_fused_v41(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                             block_size, cache_format)
    _FUSED_V41(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out, bs, cache_format,
               impl=impl)


@fused_rope_insert_v41.register_fake
def _(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out, block_size=None,
      cache_format="v41", impl="auto"):
    _validate_fused_v41(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, q_out,
                        block_size, cache_format)


def rope_kv_insert_v41(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, *,
                       q_head_padded=None, block_size=None, cache_format="v41", out=None,
                       impl="auto"):
    """``fused_rope_insert_v41`` returning q_out ``[N, q_head_padded, 512]`` bf16 (allocated
    unless ``out``, a persistent buffer, is given)."""
    out = _q_out_buffer(q, q_head_padded, out)
    fused_rope_insert_v41(q, kv, k_cache, slot_mapping, positions, cos_sin_cache, out,
                          block_size, cache_format, impl)
    return out


_COMPRESSED_V41 = implementations("compressed_insert_v41", vendor=vendor.ROUTE,
                                  triton=triton_impl.compressed_insert_v41,
                                  reference=reference.compressed_insert_v41)
COMPRESSED_FORMATS = formats.V41_COMPRESSED_FORMATS + ("plain_bf16", "plain_fp8")


def _validate_compressed_v41(k, k_cache, slot_mapping, positions, cos_sin_cache,
                             compress_ratio, block_size, cache_format, kv_scale):
    if cache_format not in COMPRESSED_FORMATS:
        raise ValueError(f"cache_format must be one of {COMPRESSED_FORMATS}, got "
                         f"{cache_format!r}")
    checks.expect_int("compress_ratio", compress_ratio, 1)
    n = k.shape[0] if k.dim() == 2 else -1
    checks.expect_tensor("k", k, FLOAT_IN, (n, formats.HEAD_DIM))
    checks.expect_dtype("positions", positions, checks.INDEX_DTYPES)
    checks.expect_shape("positions", positions, (n,))
    checks.expect_dtype("cos_sin_cache", cos_sin_cache, torch.float32)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != formats.ROPE_DIM \
            or cos_sin_cache.shape[0] == 0:
        raise ValueError(f"cos_sin_cache must have shape [max_position >= 1, 64] (cos[0:32] || "
                         f"sin[0:32]), got {list(cos_sin_cache.shape)}")
    checks.expect_last_dim_contiguous("cos_sin_cache", cos_sin_cache)
    if cache_format in formats.PAGED_FORMATS:
        bs = checks.paged_cache_block_size("k_cache", k_cache, formats.get_format(cache_format),
                                           block_size)
        if kv_scale is not None:
            raise ValueError("kv_scale applies only to a plain_fp8 cache")
    else:
        fp8 = _check_plain_cache(k_cache)
        if fp8 != (cache_format == "plain_fp8"):
            raise ValueError(f"k_cache dtype {k_cache.dtype} does not match cache_format "
                             f"{cache_format!r}")
        _check_scale("kv_scale", kv_scale, fp8)
        bs = k_cache.shape[1]
    _check_slots(slot_mapping, n, k_cache.shape[0] * bs, k)
    checks.expect_same_device(k=k, k_cache=k_cache, slot_mapping=slot_mapping,
                              positions=positions, cos_sin_cache=cos_sin_cache,
                              kv_scale=kv_scale)
    if checks.value_checks_enabled(positions, k):
        checks.expect_indices("positions", positions, cos_sin_cache.shape[0],
                              " (rows of cos_sin_cache)", "token")
    return bs


@custom_op("sparse_mla::compressed_insert_v41", mutates_args=("k_cache",))
def compressed_insert_v41(k: Tensor, k_cache: Tensor, slot_mapping: Tensor, positions: Tensor,
                          cos_sin_cache: Tensor, compress_ratio: int,
                          block_size: Optional[int] = None, cache_format: str = "v41",
                          kv_scale: Optional[Tensor] = None, impl: str = "auto") -> None:
    """The V4.1 compressed-entry insert (docs/semantics.md §12): row ``t`` of ``k`` ``[N, 512]``
    (the compressor's normed latent, not yet rotated) is written at ``slot_mapping[t]`` only
    where that is >= 0 and ``(positions[t] + 1) % compress_ratio == 0``, after GPT-J RoPE at
    position ``(positions[t] // compress_ratio) * compress_ratio`` in fp32. ``cache_format``:
    "v41" (528 B), "v41_fp4" (288 B) (page footer, vLLM 0.32), "v41_inline",
    "v41_fp4_inline" (token-inline, vLLM 0.33), all quantized from the fp32 rotated row,
    "v4" (584 B), or a plain ``[nb, bs, 512]`` cache,
    "plain_bf16" / "plain_fp8" (e4m3 of the bf16 row times ``1 / kv_scale``)."""
    bs = _validate_compressed_v41(k, k_cache, slot_mapping, positions, cos_sin_cache,
                                  compress_ratio, block_size, cache_format, kv_scale)
    _COMPRESSED_V41(k, k_cache, slot_mapping, positions, cos_sin_cache, compress_ratio, bs,
                    cache_format, kv_scale, impl=impl)


@compressed_insert_v41.register_fake
def _(k, k_cache, slot_mapping, positions, cos_sin_cache, compress_ratio, block_size=None,
      cache_format="v41", kv_scale=None, impl="auto"):
    _validate_compressed_v41(k, k_cache, slot_mapping, positions, cos_sin_cache, compress_ratio,
                             block_size, cache_format, kv_scale)
