"""FlashMLA (the ``sgl-flash-mla`` wheel, module ``flash_mla``) as the vendor implementation.

Only its frozen legacy kernels read the V4 584 B / V3.2 656 B formats, and they were verified
here on SM90 (H100/H200) only, so that is all this path accepts. FlashMLA needs 64 or 128
heads and top-k widths that are multiples of 64 (decode) / 128 (prefill): this module pads
heads (zero q rows, -inf sinks) and index lists (-1) itself and copies the real heads back.
FlashMLA's decode skips only the slot id -1 (docs/semantics.md §5.1): on the H200 and H100 an id of
-2, -64 or INT_MAX within the lengths faulted (illegal memory access, the CUDA context lost), and
one at or past the capacity read past the cache (lab/perf-log.md, "Vendor decode route").
The reference and Triton paths skip every id outside [0, capacity), so this path writes its padded
index lists with every such id as -1 (one small kernel per list) and gives their answer. FlashMLA
also refuses strided lengths, sinks and prefill index lists (RuntimeError), which the op accepts:
those are copied to unit stride first (``checks.unit_stride``), and it reads past an index
list given a length past its width, so lengths reach it clamped to [0, width].
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sparse_mla.ops.common import dispatch, formats
from sparse_mla.ops.common.checks import unit_stride
from sparse_mla.ops.attention.plan import sm90_enabled
from sparse_mla.ops.common.vendor_heads import pad_heads


@functools.lru_cache(maxsize=1)
def _flash_mla():
    try:
        import flash_mla
    except ImportError as exc:
        return None, f"flash_mla is not importable (pip install sgl-flash-mla): {exc}"
    if not getattr(flash_mla, "has_legacy", lambda: True)():
        return None, "this flash_mla build has no legacy kernels (V4 / V3.2 formats)"
    return flash_mla, None


def _device_reason(t: torch.Tensor) -> Optional[str]:
    if t.device.type != "cuda":
        return f"FlashMLA needs CUDA tensors, got {t.device.type}"
    return capability_reason(*dispatch.device_capability(t.device))


def capability_reason(major: int, minor: int) -> Optional[str]:
    """Why FlashMLA does not run this op on an SM``major````minor`` GPU, or None (SM90)."""
    if (major, minor) == (9, 0):
        return None
    if major == 10:
        # docs/semantics.md §10: the wheel's current SM100 kernels read only the V4.1 formats (528 B
        # fp8, 288 B fp4), which this op does not take; its legacy kernels were verified on SM90
        return (f"FlashMLA's SM100 kernels read only the V4.1 cache formats, not V4 (584 B) "
                f"or V3.2 (656 B); its legacy kernels are used on SM90 only (this GPU is "
                f"SM{major}{minor})")
    return (f"FlashMLA's legacy V4/V3.2 kernels are used on SM90 only (verified there); "
            f"this GPU is SM{major}{minor}")


def flash_mla_heads(h: int) -> int:
    """The head count FlashMLA's sparse kernels run ``h`` heads at: 64 or 128 (q is padded
    with zero heads up to it)."""
    return 64 if h <= 64 else 128


def pad_for_flash_mla(q: torch.Tensor, attn_sink, head_dim: int):
    """``(q, attn_sink)`` at ``flash_mla_heads`` heads along ``head_dim``: zero q heads and
    -inf sinks past the real ones (they change nothing; callers keep the real heads' rows)."""
    qp, sink, _ = pad_heads(q, attn_sink, flash_mla_heads(q.shape[head_dim]), head_dim=head_dim)
    return qp, sink


def _pad_cols(idx: torch.Tensor, multiple: int) -> torch.Tensor:
    """``idx`` padded with -1 columns to a multiple of ``multiple``, with a unit last stride
    (FlashMLA's prefill refuses others): no copy where it has both already."""
    pad = (-idx.shape[-1]) % multiple
    return F.pad(idx, (0, pad), value=-1) if pad else unit_stride(idx)


@triton.jit
def _usable_ids_kernel(src, src_s0, src_s1, dst, K, KP, capacity, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(src + row * src_s0 + cols * src_s1, mask=cols < K, other=-1)
    ids = tl.where((ids >= 0) & (ids < capacity), ids, -1)
    tl.store(dst + row * KP + cols, ids, mask=cols < KP)


def _usable_ids(idx: torch.Tensor, capacity: int, multiple: int) -> torch.Tensor:
    """``idx`` [b, s_q, K] as a new [b, s_q, K rounded up to ``multiple`` (at least one)]
    list for FlashMLA: ids in [0, capacity) as they are, every other id and the added columns
    -1."""
    b, s_q, k = idx.shape
    # at least one block of columns: FlashMLA's decode rejects an empty list (RuntimeError)
    kp = max(-(-k // multiple), 1) * multiple
    out = torch.empty(b, s_q, kp, dtype=idx.dtype, device=idx.device)
    flat = idx.reshape(b * s_q, k)
    if out.numel():
        block = min(triton.next_power_of_2(kp), 1024)
        _usable_ids_kernel[(b * s_q, triton.cdiv(kp, block))](
            flat, flat.stride(0), flat.stride(1), out, k, kp, capacity, BLOCK=block)
    return out


def _usable_lengths(lengths: Optional[torch.Tensor], width: int) -> Optional[torch.Tensor]:
    """``lengths`` clamped to [0, width] (a new contiguous list), as the op defines them
    (``KeySource.usable``). FlashMLA reads index columns up to a length past the list's width
    (an H200 faulted at 5000 over a 64-wide list) and gave another answer than the reference
    for negative ones (lab/perf-log.md, "Edges of the ops")."""
    return None if lengths is None else lengths.clamp(0, width)


def _paged_4d(cache: torch.Tensor, bs: int, bytes_per_token: int) -> torch.Tensor:
    """FlashMLA's [num_blocks, block_size, 1, B] view of any accepted cache view."""
    raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    nb = cache.shape[0]
    stride0 = cache.stride(0) if nb > 1 else bs * bytes_per_token
    return raw.as_strided((nb, bs, 1, bytes_per_token), (stride0, bytes_per_token,
                                                          bytes_per_token, 1),
                          raw.storage_offset())


def decode_check(q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices,
                 extra_topk_length, attn_sink, scale, kv_format, bs, extra_bs, extra_fmt=None,
                 q_scale=None):
    if q.dtype != torch.bfloat16:
        return "FlashMLA's sparse decode takes a bf16 q (its SM90 kernels read no e4m3 q)"
    if kv_format not in ("v4", "v32") or (extra_k_cache is not None
                                          and (extra_fmt or kv_format) != kv_format):
        return ("FlashMLA is wired here for one V4 (584 B) or V3.2 (656 B) cache format per "
                "call; its V4.1 record decode is SM100-only")
    reason = _device_reason(q)
    if reason:
        return reason
    mod, why = _flash_mla()
    if mod is None:
        return why
    if kv_format == "v32" and (topk_length is not None or extra_k_cache is not None):
        return "FlashMLA's V3.2 kernels on SM90 take neither topk_length nor an extra cache"
    if q.shape[0] * q.shape[1] == 0:
        return "FlashMLA's decode rejects an empty batch (RuntimeError)"
    return None


def decode(q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices,
           extra_topk_length, attn_sink, scale, kv_format, bs, extra_bs, extra_fmt=None,
           q_scale=None):
    flash_mla, _ = _flash_mla()
    h = q.shape[2]
    qp, sink = pad_for_flash_mla(q, attn_sink, head_dim=2)
    nbytes = formats.get_format(kv_format).bytes_per_token
    meta, _ = flash_mla.get_mla_metadata()
    kwargs = dict(softmax_scale=scale, causal=False, is_fp8_kvcache=True,
                  indices=_usable_ids(indices, k_cache.shape[0] * bs, 64),
                  attn_sink=unit_stride(sink),
                  topk_length=_usable_lengths(topk_length, indices.shape[-1]),
                  use_legacy=True, kv_format="V4" if kv_format == "v4" else "V32")
    if extra_k_cache is not None:
        kwargs.update(extra_k_cache=_paged_4d(extra_k_cache, extra_bs, nbytes),
                      extra_indices_in_kvcache=_usable_ids(extra_indices,
                                                           extra_k_cache.shape[0] * extra_bs, 64),
                      extra_topk_length=_usable_lengths(extra_topk_length,
                                                        extra_indices.shape[-1]))
    o, l = flash_mla.flash_mla_with_kvcache(qp, _paged_4d(k_cache, bs, nbytes), None, None, 512,
                                           meta, **kwargs)
    _deliver(out, lse, o, l, h)


def _deliver(out, lse, o, l, h):
    """FlashMLA's decode outputs (its own tensors, heads padded) into the op's: a copy an
    engine calling FlashMLA directly does not make (vLLM's pure decode hands FlashMLA's output
    on as it is), so tools/bench_backend.py's vLLM-like layer calls FlashMLA itself."""
    out.copy_(o[:, :, :h])
    lse.copy_(l[:, :h])


def decode_automatic(*args, **kwargs):
    """Why the automatic choice passes this path over where our sm_90 kernel can run: a
    stateless op must give FlashMLA fresh scheduler metadata on every call, so its planner runs
    every time, and the path was then slower than the Triton op on every decode shape measured
    (lab/perf-log.md, "Vendor decode route"). ``impl="vendor"`` still runs it."""
    if sm90_enabled():
        return ("passed over automatically: with its planner run on every call FlashMLA is "
                "slower here than the Triton kernel (lab/perf-log.md, 'Vendor decode route'); "
                "impl='vendor' runs it")
    return None


def prefill_check(q, kv, indices, out, max_logits, lse, topk_length, attn_sink, scale):
    reason = _device_reason(q)
    if reason:
        return reason
    mod, why = _flash_mla()
    if why is None and (q.shape[0] == 0 or indices.shape[-1] == 0):
        return "FlashMLA's prefill asserts s_q > 0 and topk > 0"
    return why


def prefill(q, kv, indices, out, max_logits, lse, topk_length, attn_sink, scale):
    """d_qk 512 (V4) or 576 (V3.2): the legacy SM90 prefill reads both widths (FlashMLA's
    V3.2 case classes, sinks and topk_length included, matched the reference on an H200)."""
    flash_mla, _ = _flash_mla()
    h = q.shape[1]
    qp, sink = pad_for_flash_mla(q, attn_sink, head_dim=1)
    o, m, l = flash_mla.flash_mla_sparse_fwd(qp, kv, _pad_cols(indices, 128), scale, 512,
                                             unit_stride(sink),
                                             _usable_lengths(topk_length, indices.shape[-1]),
                                             use_legacy=True)
    out.copy_(o[:, :h])
    max_logits.copy_(m[:, :h])
    lse.copy_(l[:, :h])


# FlashMLA's sparse prefill: the head counts it runs without padding, and the multiple its
# index lists' width must be (the op pads both otherwise)
PREFILL_HEADS = (64, 128)
PREFILL_WIDTH = 128


def prefill_direct_fits(q, indices) -> bool:
    """Whether FlashMLA's prefill takes these arguments as they are (``prefill_direct``)."""
    return q.shape[1] in PREFILL_HEADS and indices.shape[-1] % PREFILL_WIDTH == 0


def prefill_direct(q, kv, indices, scale, attn_sink, topk_length):
    """FlashMLA's prefill called as it is: its ``out`` [s_q, h, 512], no padding and no
    copies. The caller guarantees what the op would otherwise make so: ``prefill_direct_fits``,
    unit-stride ``attn_sink`` / ``topk_length`` / ``indices``, ids in [0, s_kv) or -1 and
    lengths in [0, width] (FlashMLA reads past a list given a longer length)."""
    flash_mla, _ = _flash_mla()
    return flash_mla.flash_mla_sparse_fwd(q, kv, indices, scale, 512, attn_sink, topk_length,
                                          use_legacy=True)[0]


# Where this project's tests ran the legacy kernels: H100 and H200 (lab/perf-log.md); the
# checks above refuse every other architecture, so no canary is ever needed.
VERIFIED_CCS = ((9, 0),)

# The routes ops.py registers (dispatch.implementations).
DECODE = dispatch.VendorRoute(decode, decode_check, decode_automatic, VERIFIED_CCS)
PREFILL = dispatch.VendorRoute(prefill, prefill_check, verified_ccs=VERIFIED_CCS)
