"""The FlashMLA-semantics ops' Triton implementations: their arguments as key sources
(reference.py's) of the shared attention core (ops/attention/), run by its Triton launcher
(``sparse_attention_triton``; which kernel ran: ``dispatch.last_choice(op).route``)."""
from __future__ import annotations

import torch
from torch import Tensor

from sparse_mla.ops.attention import plan_attention, sparse_attention_triton
from sparse_mla.ops.flashmla_decode.reference import (decode_sources, dequantized_q,
                                                       prefill_source)


def _token_rows(t: Tensor, shape):
    """``(rows, target)``: ``t`` viewed as ``shape`` (tokens flattened) for the kernels to
    write through, target None; or, where ``t``'s strides allow no such view (``lse`` as a
    contiguous [b, h, s_q] buffer with s_q > 1), a new buffer and ``t`` to copy it into."""
    try:
        return t.view(shape), None
    except RuntimeError:
        return torch.empty(shape, dtype=t.dtype, device=t.device), t


def _q_and_scale(q, q_scale, scale):
    """(q as the kernels read it, the softmax scale): an e4m3 q stays e4m3 with a per-tensor
    ``q_scale`` folded into the scale (a device tensor: no host sync); a per-token-head one is
    applied to q first, rounded to bf16."""
    if q_scale is None:
        return q, scale
    if q_scale.numel() == 1:
        return q, q_scale.reshape(1) * scale
    return dequantized_q(q, q_scale).to(torch.bfloat16), scale


def plan_decode(q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices,
                extra_topk_length, attn_sink, scale, kv_format, bs, extra_bs, extra_fmt=None,
                q_scale=None):
    """What ``decode`` would launch on these arguments (``plan.LaunchPlan``), not launched."""
    q, _ = _q_and_scale(q, q_scale, scale)
    b, s_q, h, d = q.shape
    srcs = decode_sources(k_cache, indices, topk_length, extra_k_cache, extra_indices,
                          extra_topk_length, kv_format, bs, extra_bs, extra_fmt)
    return plan_attention(q.reshape(b * s_q, h, d), srcs)


def decode(q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices,
           extra_topk_length, attn_sink, scale, kv_format, bs, extra_bs, extra_fmt=None,
           q_scale=None, plan=None):
    """``plan``: ``plan_decode``'s for a call of this kind (else one is made now)."""
    q, scale = _q_and_scale(q, q_scale, scale)
    b, s_q, h, d = q.shape
    srcs = decode_sources(k_cache, indices, topk_length, extra_k_cache, extra_indices,
                          extra_topk_length, kv_format, bs, extra_bs, extra_fmt)
    o_rows, o_target = _token_rows(out, (b * s_q, h, 512))
    l_rows, l_target = _token_rows(lse.transpose(1, 2), (b * s_q, h))
    sparse_attention_triton(q.reshape(b * s_q, h, d), srcs, attn_sink, scale, o_rows, l_rows,
                            plan=plan)
    for rows, target in ((o_rows, o_target), (l_rows, l_target)):
        if target is not None:
            target.copy_(rows.view(target.shape))


def plan_prefill(q, kv, indices, out, max_logits, lse, topk_length, attn_sink, scale):
    """What ``prefill`` would launch on these arguments (``plan.LaunchPlan``), not launched."""
    return plan_attention(q, prefill_source(kv, indices, topk_length))


def prefill(q, kv, indices, out, max_logits, lse, topk_length, attn_sink, scale, plan=None):
    """``plan``: ``plan_prefill``'s for a call of this kind (else one is made now)."""
    sparse_attention_triton(q, prefill_source(kv, indices, topk_length), attn_sink, scale, out,
                            lse, max_logits=max_logits, plan=plan)
