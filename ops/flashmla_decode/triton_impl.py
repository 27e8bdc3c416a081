"""The FlashMLA-semantics ops' Triton implementations: their arguments as key sources
(reference.py's) of the shared attention core (ops/attention/), run by its Triton launcher
(``sparse_attention_triton``; which kernel ran: ``dispatch.last_choice(op).route``)."""
from __future__ import annotations

import torch
from torch import Tensor

from sparse_mla.ops.attention import sparse_attention_triton
from sparse_mla.ops.flashmla_decode.reference import decode_sources, prefill_source


def _token_rows(t: Tensor, shape):
    """``(rows, target)``: ``t`` viewed as ``shape`` (tokens flattened) for the kernels to
    write through, target None; or, where ``t``'s strides allow no such view (``lse`` as a
    contiguous [b, h, s_q] buffer with s_q > 1), a new buffer and ``t`` to copy it into."""
    try:
        return t.view(shape), None
    except RuntimeError:
        return torch.empty(shape, dtype=t.dtype, device=t.device), t


def decode(q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices,
           extra_topk_length, attn_sink, scale, kv_format, bs, extra_bs, extra_fmt=None):
    b, s_q, h, d = q.shape
    srcs = decode_sources(k_cache, indices, topk_length, extra_k_cache, extra_indices,
                          extra_topk_length, kv_format, bs, extra_bs, extra_fmt)
    o_rows, o_target = _token_rows(out, (b * s_q, h, 512))
    l_rows, l_target = _token_rows(lse.transpose(1, 2), (b * s_q, h))
    sparse_attention_triton(q.reshape(b * s_q, h, d), srcs, attn_sink, scale, o_rows, l_rows)
    for rows, target in ((o_rows, o_target), (l_rows, l_target)):
        if target is not None:
            target.copy_(rows.view(target.shape))


def prefill(q, kv, indices, out, max_logits, lse, topk_length, attn_sink, scale):
    sparse_attention_triton(q, prefill_source(kv, indices, topk_length), attn_sink, scale, out,
                            lse, max_logits=max_logits)
