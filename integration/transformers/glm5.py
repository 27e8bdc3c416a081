"""The ``"sparse_mla"`` attention function for HF transformers' GLM-5.3 (``glm5_next``) DSA layers.

What HF's ``Glm5NextTextAttention`` hands an attention function (transformers 5.17,
modeling_glm5_next.py): MLA *not* absorbed — query ``[B, H, S, qk]``, key ``[B, H, N, qk]``
(``kv_b_proj`` expanded per head, NoPE: qk = qk_nope_head_dim), value ``[B, H, N, v]``; the
additive mask ``[B, 1, S, N]`` (0 / ``finfo.min``) densified from the indexer's top-k (selected
pools + the tail), which already holds causality and padding; ``scaling`` = qk^-0.5; no sink.
The latent the kernels are built for (one shared 512-wide KV head) never reaches the
function, so each head is attended on its own: one 512-wide row per head and key holding
``[value | key | 0]`` and a query row ``[0 | query | 0]``. Scores over the row are the head's
q·k (the zeros add exact zeros) and the output's first ``v`` dims are the head's p·v, so
``sparse_mla::flashmla_sparse_prefill`` (one query head per row, each (batch, head) its own
stretch of keys) computes eager's attention over the mask's visible columns. Packing costs a
copy of the layer's keys and values per call, the order of eager's own read of every key.

fp32 models run the same lists through a gathered fp32 attention (the op is bf16 only).
A row with no visible key (only pad queries: the indexer always gives a real query its tail or
a pool, given the configs ``unsupported_reason`` lets through) comes out 0; eager's softmax over
an all-``finfo.min`` row averages every value instead. Pad queries' outputs reach no real token.
"""
from __future__ import annotations

import torch

from sparse_mla.integration.transformers import op_route
from sparse_mla.integration.transformers.index_lists import (refuse_rows,
                                                             visible_index_lists)
from sparse_mla.ops.common import checks

# the masks this route takes (refusals name them)
_TAKES = ("GLM-5.3's top-k masks of 0 / finfo.min entries")

MODEL_TYPES = ("glm5_next", "glm5_next_text")
ROW = 512                 # the kernels' key row (DeepSeek-V4's d_qk = d_v = 512)
_INT32 = 2 ** 31
_FP32_CHUNK_ELEMENTS = 1 << 26


def text_config(config):
    """The DSA layers' config: a ``glm5_next`` config's ``text_config``, else ``config``."""
    return getattr(config, "text_config", None) or config


def unsupported_reason(config) -> str | None:
    """Why GLM-5.3 ``config``'s DSA layers cannot use sparse_mla attention, or None."""
    if getattr(config, "model_type", None) == "glm5_next_vision":
        return ("GLM-5.3's vision tower attends densely; give sparse_mla to the text model "
                "only: attn_implementation={'text_config': 'sparse_mla', 'vision_config': "
                "'sdpa'}")
    cfg = text_config(config)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if qk + cfg.v_head_dim > ROW:
        return (f"its kernels hold a head's value and key in one {ROW}-wide row; this config "
                f"has v_head_dim {cfg.v_head_dim} + qk head dim {qk} > {ROW}")
    if not cfg.index_kpool_always_select_tail:
        return ("index_kpool_always_select_tail=False leaves a query whose visible tokens are "
                "fewer than a pool with no key, where eager averages every value (future "
                "tokens included); sparse attention gives such a row no output")
    if cfg.index_topk < cfg.index_kpool:
        return (f"index_topk {cfg.index_topk} < index_kpool {cfg.index_kpool} selects no pool: "
                "a query whose visible tokens fill whole pools would see no key")
    return None


def list_width(module, n_keys: int) -> int:
    """A width every query's visible-column count fits in: the indexer's ``index_topk``
    pooled tokens plus, with the tail, up to ``index_kpool - 1`` tail tokens."""
    cfg = module.config
    width = cfg.index_topk + (cfg.index_kpool - 1 if cfg.index_kpool_always_select_tail else 0)
    return min(n_keys, width)


def _check_inputs(query, key, value, attention_mask, dropout):
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype == torch.bool:
        raise ValueError("sparse_mla attention needs GLM-5.3's additive top-k attention mask; "
                         f"got {type(attention_mask).__name__} "
                         f"{getattr(attention_mask, 'dtype', '')}".rstrip())
    if query.dim() != 4:
        raise ValueError(f"query must have shape [batch, heads, queries, qk_head_dim], "
                         f"got {list(query.shape)}")
    b, h, s, dqk = query.shape
    if key.dim() != 4 or tuple(key.shape[:2]) != (b, h) or key.shape[-1] != dqk:
        raise ValueError(f"key must have shape [{b}, {h}, keys, {dqk}] (one KV head per query "
                         f"head), got {list(key.shape)}")
    n = key.shape[2]
    if value.dim() != 4 or tuple(value.shape[:3]) != (b, h, n):
        raise ValueError(f"value must have shape [{b}, {h}, {n}, v_head_dim], "
                         f"got {list(value.shape)}")
    if dqk + value.shape[-1] > ROW:
        raise ValueError(f"qk head dim {dqk} + v head dim {value.shape[-1]} exceed the "
                         f"kernels' {ROW}-wide row")
    if attention_mask.dim() != 4 or tuple(attention_mask.shape) != (b, 1, s, n):
        raise ValueError(f"attention_mask must have shape [{b}, 1, {s}, {n}], "
                         f"got {list(attention_mask.shape)}")
    if query.dtype not in (torch.bfloat16, torch.float32) or not (
            key.dtype == value.dtype == query.dtype):
        raise TypeError("sparse_mla attention serves bf16 and fp32 models; got query "
                        f"{query.dtype}, key {key.dtype}, value {value.dtype}")
    if dropout:
        raise ValueError(f"sparse_mla attention has no dropout; got dropout={dropout} "
                         "(call model.eval() or set attention_dropout=0)")
    if b * h * n >= _INT32:
        raise ValueError(f"batch x heads x keys = {b * h * n} does not fit the kernels' int32 "
                         "key ids")


def _packed(query, key, value):
    """``q [B*H*S, 1, ROW]`` = [0 | query | 0], ``kv [B*H*N, 1, ROW]`` = [value | key | 0]."""
    b, h, s, dqk = query.shape
    n, dv = key.shape[2], value.shape[-1]
    kv = key.new_zeros(b, h, n, ROW)
    kv[..., :dv] = value
    kv[..., dv:dv + dqk] = key
    q = query.new_zeros(b, h, s, ROW)
    q[..., dv:dv + dqk] = query
    return q.view(b * h * s, 1, ROW), kv.view(b * h * n, 1, ROW)


def _head_lists(indices, lengths, heads, n_keys):
    """The (batch, query) lists ``[B, S, W]`` per head: ``[B*H*S, 1, W]`` into the packed
    keys, where (batch b, head h) owns keys ``(b*H + h)*N ..``; lengths ``[B*H*S]``."""
    b, s, w = indices.shape
    base = torch.arange(b * heads, dtype=torch.int32, device=indices.device).view(b, heads, 1, 1)
    local = indices.unsqueeze(1)
    flat = torch.where(local >= 0, local + base * n_keys, -1)
    return (flat.reshape(b * heads * s, 1, w),
            lengths.unsqueeze(1).expand(b, heads, s).reshape(b * heads * s))


def attend_fp32(query, key, value, indices, scale):
    """fp32 sparse attention per head: ``[B, H, S, qk]`` q, ``[B, H, N, qk]`` keys, ``[B, H,
    N, v]`` values, ``[B, S, W]`` int32 column lists (-1 = none). Returns ``[B, S, H, v]``."""
    b, h, s, d = query.shape
    w, dv = indices.shape[-1], value.shape[-1]
    out = query.new_zeros(b, s, h, dv)
    rows = max(1, _FP32_CHUNK_ELEMENTS // max(1, b * h * w * max(d, dv)))
    bi = torch.arange(b, device=query.device).view(b, 1, 1, 1)
    hi = torch.arange(h, device=query.device).view(1, h, 1, 1)
    for r0 in range(0, s, rows):
        idx = indices[:, r0:r0 + rows].long()
        safe = idx.clamp(min=0).unsqueeze(1)                          # [B, 1, r, W]
        # unused slots read key 0, which need not be finite (0 * NaN): zeroed
        unused = (idx < 0).unsqueeze(1).unsqueeze(-1)
        k = key[bi, hi, safe].masked_fill(unused, 0.0)
        v = value[bi, hi, safe].masked_fill(unused, 0.0)
        logits = torch.einsum("bhrd,bhrwd->bhrw", query[:, :, r0:r0 + rows], k) * scale
        logits = logits.masked_fill(unused.squeeze(-1), float("-inf"))
        # a row with no key has no softmax: its output is 0, like the kernels'
        m = logits.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)
        p = torch.exp(logits - m)
        p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        out[:, r0:r0 + rows] = torch.einsum("bhrw,bhrwd->brhd", p, v)
    return out


def _attend_bf16(q, kv, mask, width, heads, scale, layer="?"):
    """``out [B*H*S, 1, ROW]`` of the packed rows over ``mask``'s (``[B, S, N]``) visible
    columns, by the op's plan kept for this kind of call (op_route.py). Rows the lists cannot
    reproduce are refused (value checks on) or come out NaN (no host sync to find them)."""
    b, s, n = mask.shape
    kind = op_route.call_kind(q, kv, width, None)
    width = op_route.list_width(kind, width)
    indices, lengths, bad = visible_index_lists(mask, width)
    checkable = checks.value_checks_enabled(mask)
    if checkable:
        refuse_rows(bad, width, layer, _TAKES)
    head_indices, head_lengths = _head_lists(indices, lengths, heads, n)
    out = op_route.attend(kind, q, kv, head_indices, head_lengths, None, scale)
    if not checkable:
        out.view(b, heads, s, ROW).masked_fill_(bad.view(b, 1, s, 1), float("nan"))
    return out


@torch.library.custom_op("sparse_mla_hf::glm5_attend", mutates_args=())
def attend_traced(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, width: int,
                  heads: int, scale: float) -> torch.Tensor:
    """``_attend_bf16`` as one opaque node of a torch.compile graph, as attention.py's
    ``sparse_mla_hf::attend`` and for the same reasons."""
    return _attend_bf16(q, kv, mask, width, heads, scale)


@attend_traced.register_fake
def _(q, kv, mask, width, heads, scale):
    return q.new_empty((q.shape[0], 1, ROW))


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """HF attention function for a GLM-5.3 DSA layer: ``(out [B, S, H, v], None)``."""
    _check_inputs(query, key, value, attention_mask, dropout)
    b, h, s, dqk = query.shape
    n, dv = key.shape[2], value.shape[-1]
    scale = float(dqk ** -0.5 if scaling is None else scaling)
    mask = attention_mask.select(1, 0)
    layer = getattr(module, "layer_idx", "?")
    width = list_width(module, n)
    tracing = op_route.tracing()
    if query.dtype == torch.float32:
        # attention.py registers the lists' custom op (imported before any call reaches here)
        lists = torch.ops.sparse_mla_hf.index_lists.default if tracing else visible_index_lists
        indices, lengths, bad = lists(mask, width)
        checkable = not tracing and checks.value_checks_enabled(attention_mask)
        if checkable:
            refuse_rows(bad, width, layer, _TAKES)
        out = attend_fp32(query, key, value, indices, scale)
        if not checkable:
            out.masked_fill_(bad.view(b, s, 1, 1), float("nan"))
        return out, None
    q, kv = _packed(query, key, value)
    out = (attend_traced(q, kv, mask, width, h, scale) if tracing
           else _attend_bf16(q, kv, mask, width, h, scale, layer))
    return out.view(b, h, s, ROW)[..., :dv].transpose(1, 2), None
