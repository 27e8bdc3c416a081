"""The FlashMLA-semantics ops' PyTorch reference (the oracle and the CPU kernel of both ops):
their arguments as key sources of the shared attention reference (ops/attention/reference.py)."""
from __future__ import annotations

import torch

from sparse_mla.ops.attention import KeySource, sparse_attention_reference


def decode_sources(k_cache, indices, topk_length, extra_k_cache, extra_indices,
                   extra_topk_length, kv_format, bs, extra_bs, extra_fmt=None):
    b, s_q = indices.shape[0], indices.shape[1]
    # FlashMLA's lengths are per batch row [b]: every s_q token of the row shares them
    # (the widths are spelled out: -1 cannot be inferred for an empty batch)
    srcs = [KeySource(k_cache, kv_format, bs, indices.reshape(b * s_q, indices.shape[-1]),
                      topk_length, s_q)]
    if extra_k_cache is not None:
        srcs.append(KeySource(extra_k_cache, extra_fmt or kv_format, extra_bs,
                              extra_indices.reshape(b * s_q, extra_indices.shape[-1]),
                              extra_topk_length, s_q))
    return srcs


def dequantized_q(q, q_scale):
    """An e4m3 ``q``'s values: ``q.float() * q_scale`` (one value, or one per token and
    head); any other q as it is."""
    if q.dtype != torch.float8_e4m3fn or q_scale is None:
        return q
    s = q_scale.reshape(()) if q_scale.numel() == 1 else q_scale.unsqueeze(-1)
    return q.float() * s


def decode(q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices,
           extra_topk_length, attn_sink, scale, kv_format, bs, extra_bs, extra_fmt=None,
           q_scale=None):
    q = dequantized_q(q, q_scale)
    b, s_q, h, d = q.shape
    srcs = decode_sources(k_cache, indices, topk_length, extra_k_cache, extra_indices,
                          extra_topk_length, kv_format, bs, extra_bs, extra_fmt)
    o, l = sparse_attention_reference(q.reshape(b * s_q, h, d), srcs, attn_sink, scale)
    out.copy_(o.view(b, s_q, h, 512))
    lse.copy_(l.view(b, s_q, h).transpose(1, 2))


def prefill_source(kv, indices, topk_length):
    # dense kv [s_kv, 1, 512 or 576] is a "plain" cache of s_kv blocks of one row each
    return [KeySource(kv, "plain_bf16", 1, indices[:, 0, :], topk_length)]


def prefill(q, kv, indices, out, max_logits, lse, topk_length, attn_sink, scale):
    o, l, m = sparse_attention_reference(q, prefill_source(kv, indices, topk_length),
                                         attn_sink, scale, return_max_logits=True)
    out.copy_(o)
    lse.copy_(l)
    max_logits.copy_(m)
