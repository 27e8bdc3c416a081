"""DeepSeek-V4's Lightning indexer through ``sparse_mla::indexer_topk_prefill`` when a model
runs with ``attn_implementation="sparse_mla"`` (docs/semantics.md §11).

HF's ``DeepseekV4Indexer.forward`` materializes every score: [batch, tokens, heads, entries]
fp32 in ``DeepseekV4IndexerScorer``, then two more tensors of that size. The hook keeps all of
HF's forward up to the scorer (its compressor, the cache updates, RoPE of q and keys), stops
there, and selects with the op instead: chunked, memory O(chunk x entries). Eager and every
other implementation run HF's code untouched.

The op takes HF's tensors as they are where they are exact inputs for it: bf16 q and keys of
index_head_dim 128 (DeepSeek-V4's). Elsewhere (an fp32 model, a tiny test config with another
head dim) HF's own forward runs, so results never change by the hook's choice.

HF calls the indexer once per CSA layer per decode step with arguments that differ only in
values and in the entry count, so, as the attention call does (op_route.py), the first call of
a kind (device, q's shape and strides, the keys' layout, ratio, top-k, the dispatcher's
environment) runs the op itself (full validation, dispatch) and keeps its choice; later calls
run that choice through ``Dispatcher.run`` without the custom-op wrapper and the validation.
What those skip holds by construction: q and keys are the kind's, the starts and ``out`` are
built here for the entry count. With ``SPARSE_MLA_CHECK_VALUES`` on, every call runs the op.
"""
from __future__ import annotations

import functools

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

from sparse_mla.integration.transformers.op_route import dispatch_env
from sparse_mla.ops.common import checks, dispatch
from sparse_mla.ops.indexer import format as indexer_format
from sparse_mla.ops.indexer import indexer_topk_prefill

OP = "indexer_topk_prefill"
# kind -> (the op's choice for it, the op's dispatcher); see the module docstring
_ROUTES: dict = {}

NAME = "sparse_mla"


class _Scored(Exception):
    """Raised by the scorer inside a hooked forward, carrying the scorer's inputs."""


def _active(indexer) -> bool:
    config = getattr(indexer.rotary_emb, "config", None)
    return getattr(config, "_attn_implementation", None) == NAME


def _op_can_take(q, keys) -> bool:
    return (q.dtype == keys.dtype == torch.bfloat16 and q.shape[-1] == indexer_format.DIM
            and 1 <= q.shape[2] <= indexer_format.MAX_HEADS)


def _starts(b, n, dev):
    """0, n, 2n, .. b*n: the starts of b requests of n rows each (one launch)."""
    if n == 0:
        return torch.zeros(b + 1, dtype=torch.long, device=dev)
    return torch.arange(0, (b + 1) * n, n, device=dev)


def _kind(indexer, q, keys):
    return (q.device, tuple(q.shape), tuple(q.stride()), keys.stride()[1:],
            indexer.compress_rate, indexer.index_topk, dispatch_env())


def forget() -> None:
    """Drop the kept choices (tests)."""
    _ROUTES.clear()


def select(indexer, q, keys, hidden_states, position_ids):
    """``DeepseekV4Indexer``'s result from the scorer's inputs: [B, S, min(topk, T)] int64,
    request-local ids, -1 where there are fewer candidates (one op call, a request per
    batch row)."""
    b, s, h, d = q.shape
    t = keys.shape[1]
    k = min(indexer.index_topk, t)
    if k == 0:
        return torch.empty(b, s, 0, dtype=torch.long, device=q.device)
    scorer = indexer.scorer
    weights = scorer.weights_proj(hidden_states).float() * scorer.weights_scaling \
        * scorer.softmax_scale
    dev = q.device
    out = torch.empty(b * s, k, dtype=torch.int32, device=dev)
    # HF's positions of left padding may be negative; with ratio >= 2 position 0 selects
    # nothing either, so clamping keeps the result
    positions = position_ids.expand(b, s).reshape(-1).clamp_min(0)
    args = (q.reshape(b * s, h, d), weights.reshape(b * s, h), keys.reshape(b * t, d), None,
            _starts(b, s, dev), _starts(b, t, dev), positions)
    kind = _kind(indexer, q, keys)
    kept = _ROUTES.get(kind)
    if kept is None or checks.value_checks_enabled(q):
        indexer_topk_prefill(*args, out, indexer.compress_rate, 0, t)
        choice = dispatch.last_choice(OP)
        if choice is not None:
            _ROUTES[kind] = (choice, dispatch.dispatcher(OP))
    else:
        choice, dispatcher = kept
        # the op's own call of its dispatcher: ratio before out, then chunk and the width
        dispatcher.run(choice, *args, indexer.compress_rate, out, 0, t)
    return out.view(b, s, k).long()


def _hooked(original):
    @functools.wraps(original)
    def forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
        # while torch.compile traces, HF's own indexer runs: the hook swaps the scorer's
        # forward and escapes by an exception, neither of which dynamo can trace
        if not _active(self) or torch.compiler.is_compiling():
            return original(self, hidden_states, q_residual, position_ids, past_key_values,
                            layer_idx)
        scorer_forward = self.scorer.forward
        seen = {}

        def capture(q, compressed_kv, states):
            if not _op_can_take(q, compressed_kv):
                return scorer_forward(q, compressed_kv, states)
            seen.update(q=q, keys=compressed_kv, states=states)
            raise _Scored()
        self.scorer.forward = capture
        try:
            return original(self, hidden_states, q_residual, position_ids, past_key_values,
                            layer_idx)
        except _Scored:
            return select(self, seen["q"], seen["keys"], seen["states"], position_ids)
        finally:
            del self.scorer.forward
    forward._sparse_mla_indexer = True
    return forward


def install() -> None:
    """Hook ``DeepseekV4Indexer.forward`` (idempotent; inactive unless the model's
    attention implementation is sparse_mla)."""
    cls = dsv4.DeepseekV4Indexer
    if not getattr(cls.forward, "_sparse_mla_indexer", False):
        cls.forward = _hooked(cls.forward)
