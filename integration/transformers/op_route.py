"""The bf16 attention call's op, with the per-shape work done once per kind of call.

HF's DeepSeek-V4 calls the attention function once per layer per decode step with arguments
that differ only in values and in the key count. Going through ``sparse_mla::
flashmla_sparse_prefill`` every time pays the custom-op wrapper, the op's validation and the
dispatcher's choice on every call, and the FlashMLA route then pads the index lists and copies
its three outputs into the op's buffers. So:

* the first call of a kind (``CallKind``: device, shapes and strides, the sink's presence,
  ``SPARSE_MLA_IMPL`` and ``SPARSE_MLA_SOFT_FP8``) runs the op itself: full validation and
  dispatch; the implementation it chose is kept for that kind;
* later calls of the kind run the kept choice directly: FlashMLA's own prefill on lists
  already built at its width (a multiple of 128, -1 past each row's length) with 64 or 128
  heads, its output used as it is (no padding, no copies); any other implementation through
  ``Dispatcher.run`` (no wrapper, no re-validation). What those skip holds by construction:
  kv is the checked key tensor flattened, the lists and lengths come from
  ``visible_index_lists`` (int32, ids in [0, b * n) or -1, lengths in [0, width]).

While torch.compile traces, the attention function puts the whole bf16 call (lists, route,
poison) into the graph as one custom op (attention.py, ``sparse_mla_hf::attend``), so the
compiled model pays the op's validation and dispatch once per kind too, not on every call.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import torch

from sparse_mla.ops.common import dispatch
from sparse_mla.ops.common.triton_utils import SOFT_FP8_ENV
from sparse_mla.ops.flashmla_decode import flash_mla_sparse_fwd

OP = "flashmla_sparse_prefill"
# FlashMLA's sparse prefill: head counts it runs without padding, and its list-width multiple
FLASH_MLA_HEADS = (64, 128)
FLASH_MLA_WIDTH = 128


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


@dataclasses.dataclass(frozen=True)
class Route:
    choice: dispatch.Choice
    direct_flash_mla: bool       # FlashMLA's prefill called as it is, lists at its width
    dispatcher: dispatch.Dispatcher


_ROUTES: dict = {}


def dispatch_env() -> tuple:
    """The environment variables a dispatcher's automatic choice reads: part of every kind
    whose choice is kept (here and in indexer.py)."""
    return os.environ.get(dispatch.ENV_VAR, ""), os.environ.get(SOFT_FP8_ENV, "")


def call_kind(q, kv, width, sink) -> CallKind:
    return CallKind(q.device, tuple(q.shape), tuple(q.stride()), kv.stride(-1),
                    sink is not None, width > 0, dispatch_env())


def tracing() -> bool:
    return torch.compiler.is_compiling()


def route_for(kind: CallKind) -> Optional[Route]:
    """The kept route of ``kind``, or None before its first call."""
    return _ROUTES.get(kind)


def list_width(route: Optional[Route], width: int) -> int:
    """The width to build the lists at: FlashMLA's multiple where it is called directly."""
    if route is not None and route.direct_flash_mla:
        return -(-width // FLASH_MLA_WIDTH) * FLASH_MLA_WIDTH
    return width


@functools.lru_cache(maxsize=1)
def _flash_mla():
    from sparse_mla.ops.flashmla_decode import vendor
    return vendor._flash_mla()[0]


def attend(kind: CallKind, route: Optional[Route], q, kv, indices, lengths, sink, scale):
    """``out [s_q, h, 512]`` bf16 of the prefill op on these arguments (``indices``
    ``[s_q, 1, width]`` at ``list_width(route, ..)``, ``lengths`` ``[s_q]``), by ``route``
    where the kind has one; the op itself otherwise, whose choice becomes the kind's route."""
    s_q, h = q.shape[:2]
    if route is None:
        out, _, _ = flash_mla_sparse_fwd(q, kv, indices, scale, attn_sink=sink,
                                         topk_length=lengths)
        choice = dispatch.last_choice(OP)
        if choice is not None:
            direct = (choice.impl == "vendor" and h in FLASH_MLA_HEADS
                      and _flash_mla() is not None)
            _ROUTES[kind] = Route(choice, direct, dispatch.dispatcher(OP))
        return out
    if route.direct_flash_mla:
        dispatch.record_choice(route.choice)
        return _flash_mla().flash_mla_sparse_fwd(q, kv, indices, scale, 512, sink, lengths,
                                                 use_legacy=True)[0]
    out = torch.empty(s_q, h, 512, dtype=torch.bfloat16, device=q.device)
    max_logits = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
    route.dispatcher.run(route.choice, q, kv, indices, out, max_logits, lse, lengths, sink,
                         scale)
    return out


def forget() -> None:
    """Drop the kept routes (tests; a changed environment is part of the kind already)."""
    _ROUTES.clear()
