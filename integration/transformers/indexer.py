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

While torch.compile traces, the scorer swap and the exception cannot be traced: HF's forward
runs on a view of the indexer whose scorer is ``sparse_mla_hf::indexer_pick_scores`` (one
custom op: 1 at the op's picks, 0 elsewhere, which HF's own causal mask and top-k turn into
the picks; [B, S, T] fp32 instead of HF's [B, S, H, T]) over prefill rows, and HF's scorer at
one query per row (a small fused kernel in the graph).
"""
from __future__ import annotations

import functools

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

from sparse_mla.integration.transformers.op_route import dispatch_env, tracing
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


def _kind(q, keys, ratio, topk):
    return (q.device, tuple(q.shape), tuple(q.stride()), keys.stride()[1:], ratio, topk,
            dispatch_env())


def forget() -> None:
    """Drop the kept choices (tests)."""
    _ROUTES.clear()


def _weights(scorer, hidden_states):
    """The scorer's per-head weights with its two scales folded in (docs/semantics.md §11.2)."""
    return scorer.weights_proj(hidden_states).float() * scorer.weights_scaling \
        * scorer.softmax_scale


def _picks(q, keys, weights, position_ids, ratio, topk):
    """[B * S, min(topk, T)] int32 request-local ids, -1 where there are fewer candidates:
    one op call, a request per batch row."""
    b, s, h, d = q.shape
    t = keys.shape[1]
    k = min(topk, t)
    dev = q.device
    out = torch.empty(b * s, k, dtype=torch.int32, device=dev)
    if k == 0:
        return out
    # HF's positions of left padding may be negative; with ratio >= 2 position 0 selects
    # nothing either, so clamping keeps the result
    positions = position_ids.expand(b, s).reshape(-1).clamp_min(0)
    args = (q.reshape(b * s, h, d), weights.reshape(b * s, h), keys.reshape(b * t, d), None,
            _starts(b, s, dev), _starts(b, t, dev), positions)
    kind = _kind(q, keys, ratio, topk)
    kept = _ROUTES.get(kind)
    if kept is None or checks.value_checks_enabled(q):
        indexer_topk_prefill(*args, out, ratio, 0, t)
        choice = dispatch.last_choice(OP)
        if choice is not None:
            _ROUTES[kind] = (choice, dispatch.dispatcher(OP))
    else:
        choice, dispatcher = kept
        # the op's own call of its dispatcher: ratio before out, then chunk and the width
        dispatcher.run(choice, *args, ratio, out, 0, t)
    return out


def select(indexer, q, keys, hidden_states, position_ids):
    """``DeepseekV4Indexer``'s result from the scorer's inputs: [B, S, min(topk, T)] int64,
    request-local ids, -1 where there are fewer candidates."""
    b, s = q.shape[:2]
    out = _picks(q, keys, _weights(indexer.scorer, hidden_states), position_ids,
                 indexer.compress_rate, indexer.index_topk)
    return out.view(b, s, out.shape[1]).long()


@torch.library.custom_op("sparse_mla_hf::indexer_pick_scores", mutates_args=())
def pick_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                position_ids: torch.Tensor, ratio: int, topk: int) -> torch.Tensor:
    """[B, S, T] fp32: 1 at the op's picks of each query, 0 elsewhere: in place of the
    scorer's scores in a torch.compile graph, where HF's own causal mask and top-k that
    follow turn it into those picks (all causal entries are picks wherever there are fewer
    than top-k, so HF's fill-ins are its own -1s)."""
    b, s = q.shape[:2]
    scores = torch.zeros(b, s, keys.shape[1], dtype=torch.float32, device=q.device)
    picks = _picks(q, keys, weights, position_ids, ratio, topk)
    if picks.numel():
        picks = picks.view(b, s, -1).long()
        # -1s add 0 at entry 0, which a pick there keeps
        scores.scatter_add_(2, picks.clamp_min(0), (picks >= 0).float())
    return scores


@pick_scores.register_fake
def _(q, keys, weights, position_ids, ratio, topk):
    return q.new_empty((q.shape[0], q.shape[1], keys.shape[1]), dtype=torch.float32)


class _Scoring:
    """The indexer as HF's forward reads it, with another scorer: how a torch.compile trace
    gets the op (the eager hook's scorer swap and exception cannot be traced). Prefill rows
    only: at one query per row HF's scorer is a small fused kernel in the graph, where the
    op would be an opaque call with its own host time."""

    def __init__(self, indexer, position_ids):
        self._indexer = indexer
        self._positions = position_ids

    def __getattr__(self, name):
        return getattr(self._indexer, name)

    def scorer(self, q, compressed_kv, hidden_states):
        indexer = self._indexer
        if q.shape[1] == 1 or not _op_can_take(q, compressed_kv):
            return indexer.scorer(q, compressed_kv, hidden_states)
        return pick_scores(q, compressed_kv, _weights(indexer.scorer, hidden_states),
                           self._positions, indexer.compress_rate, indexer.index_topk)


def _hooked(original):
    @functools.wraps(original)
    def forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
        if not _active(self):
            return original(self, hidden_states, q_residual, position_ids, past_key_values,
                            layer_idx)
        if tracing():
            return original(_Scoring(self, position_ids), hidden_states, q_residual,
                            position_ids, past_key_values, layer_idx)
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
