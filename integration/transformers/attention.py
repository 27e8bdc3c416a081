"""The ``"sparse_mla"`` attention function for HF transformers' DeepSeek-V4.

DeepSeek-V4's attention layer hands every attention function the same things (transformers
>= 5.8.1): query ``[B, H, S_q, 512]``; key = value ``[B, 1, S_kv + T, 512]`` (the sliding
window's keys, then the compressor's T entries); the eager additive mask ``[B, 1, S_q,
S_kv + T]`` with the compressor's per-query ``block_bias`` concatenated on; ``s_aux`` = the
per-head sinks; ``scaling``. Eager attends over every column; here each query's visible
columns become an index list and sparse attention runs over exactly those keys with the sink
(softmax denominator + exp(sink)), so the result is eager's up to rounding.

Routes: bf16 models run ``sparse_mla::flashmla_sparse_prefill`` (reference on CPU, Triton or
FlashMLA on a GPU, chosen by the op's dispatcher): the first call of a kind (shapes but the
key count, device, sink, ``SPARSE_MLA_IMPL``) and list width makes the op's plan
(``flashmla_decode.plan_prefill``: validation, choice, launch plan) and later ones run it
(op_route.py: HF calls this function per layer per decode step, and the op's wrapper,
validation and dispatch cost more host time than the step's kernels). Per call stay
the checks of this function's own arguments, one launch for the index lists (into buffers
kept per shape at decode sizes) and the attention kernel; no host sync. That op is bf16 by
contract, so fp32
models run ``attend_fp32`` instead: the same index lists, keys gathered and attended in fp32
— serving them through the bf16 op would round q, k and the output to bf16 and lose the fp32
model's precision relative to its own eager attention.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from sparse_mla.integration.transformers import glm5, op_route
from sparse_mla.integration.transformers.index_lists import (refuse_rows,
                                                             visible_index_lists)
from sparse_mla.ops.common import checks

# the masks this route takes (refusals name them)
_TAKES = ("masks of 0 / -inf entries with DeepSeek-V4's sliding-window + compressed "
          "structure")

HEAD_DIM = 512
MAX_HEADS = 128
# Query rows per fp32 chunk: bounds the gathered keys ([B, rows, width, 512] fp32).
_FP32_CHUNK_ELEMENTS = 1 << 26


def list_width(module, n_keys: int, n_queries: int) -> int:
    """A width every query's visible-column count fits in, from shapes and the config alone.

    Window part: at most ``sliding_window`` keys (HF's window is ``q - window < k <= q``).
    Compressed part: its T entries are the key columns beyond the window part, which holds
    at least this call's ``n_queries`` tokens, so ``T <= n_keys - n_queries``; a CSA query
    sees at most ``index_topk`` of them (``block_bias`` has 0 at the top-k picks only)."""
    cfg = module.config
    extra = max(0, n_keys - n_queries)
    if module.layer_type == "sliding_attention":
        extra = 0
    elif module.layer_type == "compressed_sparse_attention":
        extra = min(extra, cfg.index_topk)
    return min(n_keys, cfg.sliding_window + extra)


def _check_inputs(module, query, key, value, attention_mask, dropout):
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            "sparse_mla attention needs DeepSeek-V4's additive attention mask (with the "
            "compressor's block_bias); got "
            f"{type(attention_mask).__name__}: register the mask function with "
            "sparse_mla.integration.transformers.register()")
    if query.dim() != 4 or query.shape[-1] != HEAD_DIM:
        raise ValueError(f"query must have shape [batch, heads, queries, {HEAD_DIM}], "
                         f"got {list(query.shape)}")
    b, h, s, _ = query.shape
    if key.dim() != 4 or key.shape[0] != b or key.shape[1] != 1 or key.shape[-1] != HEAD_DIM:
        raise ValueError(f"key must have shape [{b}, 1, keys, {HEAD_DIM}] (one shared KV "
                         f"head), got {list(key.shape)}")
    same = value is key or (value.data_ptr() == key.data_ptr() and value.shape == key.shape
                            and value.stride() == key.stride() and value.dtype == key.dtype)
    if not same:
        raise ValueError("value must be key (DeepSeek-V4 shares one tensor as K and V)")
    n = key.shape[2]
    if attention_mask.dim() != 4 or tuple(attention_mask.shape) != (b, 1, s, n):
        raise ValueError(f"attention_mask must have shape [{b}, 1, {s}, {n}], "
                         f"got {list(attention_mask.shape)}")
    if query.dtype not in (torch.bfloat16, torch.float32) or key.dtype != query.dtype:
        raise TypeError("sparse_mla attention serves bf16 and fp32 models; got query "
                        f"{query.dtype}, key {key.dtype}")
    if dropout:
        raise ValueError(f"sparse_mla attention has no dropout; got dropout={dropout} "
                         "(call model.eval() or set attention_dropout=0)")
    if not 1 <= h <= MAX_HEADS:
        raise ValueError(f"query has {h} heads; sparse_mla attention takes 1..{MAX_HEADS}")


# id(s_aux) -> (a weak reference to it, its version, device, the fp32 sinks): a bf16
# model's sinks would otherwise be converted (a launch) by every call; an in-place update
# bumps the version and is seen. (Keyed by id: tensors compare elementwise.)
_SINKS: dict = {}


def _sinks(s_aux, heads, device):
    if s_aux is None:
        return None
    if s_aux.numel() != heads:
        raise ValueError(f"s_aux must have one sink per head ({heads}), got {list(s_aux.shape)}")
    if op_route.tracing():
        return s_aux.detach().float().reshape(-1).to(device)
    key = id(s_aux)
    kept = _SINKS.get(key)
    if (kept is not None and kept[0]() is s_aux and kept[1] == s_aux._version
            and kept[2] == device):
        return kept[3]
    sink = s_aux.detach().float().reshape(-1).to(device).contiguous()
    ref = weakref.ref(s_aux, lambda _, key=key: _SINKS.pop(key, None))
    _SINKS[key] = (ref, s_aux._version, device, sink)
    return sink


def attend_fp32(query, key, indices, sink, scale):
    """fp32 sparse attention with a sink: ``[B, H, S, D]`` q, ``[B, N, D]`` keys (= values),
    ``[B, S, W]`` int32 column lists (-1 = none). Returns ``[B, S, H, D]`` fp32."""
    b, h, s, d = query.shape
    w = indices.shape[-1]
    out = query.new_zeros(b, s, h, d)
    rows = max(1, _FP32_CHUNK_ELEMENTS // max(1, b * w * d))
    batch = torch.arange(b, device=query.device)[:, None, None]
    for r0 in range(0, s, rows):
        idx = indices[:, r0:r0 + rows].long()
        # unused slots read key 0, which need not be finite (0 * NaN): zeroed
        k = key[batch, idx.clamp(min=0)].masked_fill((idx < 0).unsqueeze(-1), 0.0)
        logits = torch.einsum("bhrd,brwd->bhrw", query[:, :, r0:r0 + rows], k) * scale
        logits = logits.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
        if sink is not None:
            logits = torch.cat([logits, sink.view(1, h, 1, 1).expand(b, h, logits.shape[2], 1)],
                               dim=-1)
        # a row with no key and no sink has no softmax: its output is 0, like the kernels'
        m = logits.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
        p = torch.exp(logits - m)
        p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        out[:, r0:r0 + rows] = torch.einsum("bhrw,brwd->brhd", p[..., :w], k)
    return out


def _attend_bf16(q, kv, mask, width, sink, scale, layer="?", reuse=True):
    """``out [B * S_q, H, 512]`` bf16 over ``mask``'s (``[B, S_q, N]``) visible columns:
    the op's plan kept for this kind of call (op_route.py), the lists at its width. Rows
    the lists cannot reproduce are refused (value checks on) or come out NaN
    (loud, and no host sync to find them). ``reuse``: decode-sized lists in kept buffers
    (index_lists.py)."""
    b, s = mask.shape[:2]
    kind = op_route.call_kind(q, kv, width, sink)
    width = op_route.list_width(kind, width)
    # one flat batch, each list offset into its own batch's keys
    indices, lengths, bad = visible_index_lists(mask, width, flat=True, reuse=reuse)
    checkable = checks.value_checks_enabled(mask)
    if checkable:
        refuse_rows(bad, width, layer, _TAKES)
    out = op_route.attend(kind, q, kv, indices.view(b * s, 1, width), lengths.view(b * s),
                          sink, scale)
    if not checkable:
        out.masked_fill_(bad.view(b * s, 1, 1), float("nan"))
    return out


@torch.library.custom_op("sparse_mla_hf::attend", mutates_args=())
def attend_traced(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, width: int,
                  sink: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """``_attend_bf16`` as one opaque node of a torch.compile graph: lists, route and poison
    run when the graph runs. (With the lists' Triton kernel in the graph, inductor failed to
    schedule the model's prefill: KeyError in ``compute_ancestors``, torch 2.11, H200.) No
    kept list buffers: a compiled graph may run under CUDA-graph capture, whose allocations
    belong to the graph."""
    return _attend_bf16(q, kv, mask, width, sink, scale, reuse=False)


@attend_traced.register_fake
def _(q, kv, mask, width, sink, scale):
    return q.new_empty((q.shape[0], q.shape[1], HEAD_DIM))


@torch.library.custom_op("sparse_mla_hf::index_lists", mutates_args=())
def index_lists_traced(mask: torch.Tensor, width: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``visible_index_lists`` as one opaque node of a torch.compile graph (the fp32 path),
    for the same reason; its outputs laid out as the fake ones say."""
    indices, lengths, bad = visible_index_lists(mask, width)
    return indices.contiguous(), lengths, bad.clone()


@index_lists_traced.register_fake
def _(mask, width):
    b, s = mask.shape[:2]
    return (mask.new_empty((b, s, width), dtype=torch.int32),
            mask.new_empty((b, s), dtype=torch.int32), mask.new_empty((b, s), dtype=torch.bool))


def sparse_mla_attention_forward(module, query, key, value, attention_mask, scaling=None,
                                 dropout=0.0, s_aux=None, **kwargs):
    """HF attention function: returns ``(out [B, S_q, H, 512], None)`` (no weights).
    GLM-5.3's DSA layers (their own q / k / v and mask) go to ``glm5.attention_forward``."""
    if getattr(getattr(module, "config", None), "model_type", None) in glm5.MODEL_TYPES:
        return glm5.attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    _check_inputs(module, query, key, value, attention_mask, dropout)
    b, h, s, d = query.shape
    n = key.shape[2]
    scale = float(HEAD_DIM ** -0.5 if scaling is None else scaling)
    width = list_width(module, n, s)
    sink = _sinks(s_aux, h, query.device)
    keys = key.select(1, 0)                                            # [B, N, D]
    mask = attention_mask.select(1, 0)
    tracing = op_route.tracing()
    if query.dtype != torch.float32:
        # query rows b*S.., keys b*N..; one batch needs no copy of q (the op takes any
        # strides but the last)
        q = (query.select(0, 0).transpose(0, 1) if b == 1
             else query.transpose(1, 2).reshape(b * s, h, d))
        kv = keys.reshape(b * n, 1, d)
        out = (attend_traced(q, kv, mask, width, sink, scale) if tracing
               else _attend_bf16(q, kv, mask, width, sink, scale,
                                 getattr(module, "layer_idx", "?")))
        return out.view(b, s, h, d), None
    indices, lengths, bad = (index_lists_traced if tracing else visible_index_lists)(mask, width)
    checkable = not tracing and checks.value_checks_enabled(attention_mask)
    if checkable:
        refuse_rows(bad, width, getattr(module, "layer_idx", "?"), _TAKES)
    out = attend_fp32(query, keys, indices, sink, scale)
    if not checkable:
        out.masked_fill_(bad.view(b, s, 1, 1), float("nan"))
    return out, None
