"""The bf16 attention call's op, planned once per kind of call (``flashmla_decode.plan_prefill``).

HF's DeepSeek-V4 calls the attention function once per layer per decode step with arguments
that differ only in values and in the key count. Going through ``sparse_mla::
flashmla_sparse_prefill`` every time pays the custom-op wrapper, the op's validation and the
dispatcher's choice on every call, and the FlashMLA route then pads the index lists and copies
its three outputs into the op's buffers. So each kind of call (``CallKind``: device, shapes and
strides, the sink's presence, ``SPARSE_MLA_IMPL`` and ``SPARSE_MLA_SOFT_FP8``) at each list
width gets one ``PrefillPlan`` (full validation, the dispatcher's choice, for Triton the launch
plan), made by its first call and run by every later one (``run_prefill``: its cheap kind
check, no wrapper, no re-validation, no choice): in a decode step, every layer of a kind runs
the plan its first layer made. Once a kind's plan calls FlashMLA directly
(``PrefillPlan.direct``: its head counts), its lists are built at FlashMLA's width multiple, so
its output is used as it is. What a run skips holds by construction: kv is the checked key
tensor flattened, the lists and lengths come from ``visible_index_lists`` (int32, ids in
[0, b * n) or -1, lengths in [0, width]).

While torch.compile traces, the attention function puts the whole bf16 call (lists, route,
poison) into the graph as one custom op (attention.py, ``sparse_mla_hf::attend``), so the
compiled model pays the op's validation and dispatch once per kind too, not on every call.
"""
from __future__ import annotations

import collections
import dataclasses
import os

import torch

from sparse_mla.ops import flashmla_decode as fd
from sparse_mla.ops.common import dispatch
from sparse_mla.ops.common.triton_utils import SOFT_FP8_ENV
from sparse_mla.ops.flashmla_decode import vendor

OP = "flashmla_sparse_prefill"
# plans kept: one per kind and list width, the newest (a decode step's widths grow by one)
MAX_PLANS = 64


@dataclasses.dataclass(frozen=True)
class CallKind:
    """What the op's validation and the dispatcher's choice depend on, other than the key
    count and the list width (both checked by construction)."""
    device: torch.device
    q_shape: tuple
    q_stride: tuple
    kv_last_stride: int
    has_sink: bool
    has_keys: bool
    env: tuple          # the variables the dispatcher's choice reads


_PLANS: "collections.OrderedDict" = collections.OrderedDict()
_DIRECT: set = set()        # kinds whose plans call FlashMLA directly


def dispatch_env() -> tuple:
    """The environment variables a dispatcher's automatic choice reads: part of every kind
    whose choice is kept (here and in indexer.py)."""
    return os.environ.get(dispatch.ENV_VAR, ""), os.environ.get(SOFT_FP8_ENV, "")


def call_kind(q, kv, width, sink) -> CallKind:
    return CallKind(q.device, tuple(q.shape), tuple(q.stride()), kv.stride(-1),
                    sink is not None, width > 0, dispatch_env())


def tracing() -> bool:
    return torch.compiler.is_compiling()


def list_width(kind: CallKind, width: int) -> int:
    """The width to build the lists at: FlashMLA's multiple where its plans call it
    directly."""
    if kind in _DIRECT:
        return -(-width // vendor.PREFILL_WIDTH) * vendor.PREFILL_WIDTH
    return width


def attend(kind: CallKind, q, kv, indices, lengths, sink, scale):
    """``out [s_q, h, 512]`` bf16 of the prefill op on these arguments (``indices``
    ``[s_q, 1, width]`` at ``list_width(kind, ..)``, ``lengths`` ``[s_q]``), by the plan of
    this kind and width (made now by its first call)."""
    key = (kind, indices.shape[-1])
    plan = _PLANS.get(key)
    if plan is None:
        plan = fd.plan_prefill(q, kv, indices, scale, attn_sink=sink, topk_length=lengths)
        _PLANS[key] = plan
        if len(_PLANS) > MAX_PLANS:
            _PLANS.popitem(last=False)
        if plan.choice.impl == "vendor" and q.shape[1] in vendor.PREFILL_HEADS:
            _DIRECT.add(kind)
    else:
        _PLANS.move_to_end(key)
    if plan.scale != scale:     # the scale is the plan's
        plan = dataclasses.replace(plan, scale=float(scale))
    return fd.run_prefill(plan, q, kv, indices, attn_sink=sink, topk_length=lengths)


def plan_of(kind: CallKind, width: int):
    """The kept plan of ``kind`` at list ``width`` (None before its first call)."""
    return _PLANS.get((kind, width))


def forget() -> None:
    """Drop the kept plans (tests; a changed environment is part of the kind already)."""
    _PLANS.clear()
    _DIRECT.clear()
