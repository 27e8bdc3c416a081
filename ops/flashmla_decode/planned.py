"""Plan once, run many times: the FlashMLA-semantics ops split into a plan made once per kind of
call and a run per call, as FlashMLA's ``get_mla_metadata`` / FlashInfer's ``plan()`` / ``run()``.

``plan_decode`` / ``plan_prefill`` take one call's arguments (the public ones of
``flash_mla_with_kvcache`` / ``flash_mla_sparse_fwd``), validate them fully, choose the
implementation (``dispatch``: vendor, Triton or reference, and why not the others) and, for
Triton, the attention core's whole launch plan (kernel route, its file, splits). ``print(plan)``
says all of it before anything runs. ``run_decode`` / ``run_prefill`` then run that plan on any
call of the same kind — the same shapes, dtypes, device, formats, index widths and optional
arguments, which they check cheaply (ValueError naming the difference) — without the custom-op
wrapper, the full validation or the choice: a model step makes one plan per kind of layer and
every layer of that kind runs it. Values are not re-checked on a run (ids, lengths): those are
the caller's, as the ops document them. Under ``torch.compile`` call the ops themselves.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from sparse_mla.ops.common import dispatch
from sparse_mla.ops.flashmla_decode import ops, vendor


def _meta(t: Optional[torch.Tensor]):
    """What a run must share with the plan's call for one tensor argument."""
    if t is None:
        return None
    return tuple(t.shape), t.dtype, t.device


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A ``flash_mla_with_kvcache`` call planned: ``choice`` (``dispatch.Choice``: the
    implementation, why the others were not taken, and for Triton ``choice.plan``, the launch
    plan); ``args``: the dispatcher's static arguments (scale, formats, block sizes)."""
    choice: dispatch.Choice
    kinds: tuple
    scale: float
    kv_format: str
    block_size: int
    extra_block_size: Optional[int]
    extra_kv_format: str
    ran: dispatch.Choice      # ``choice`` as ``last_choice`` records a run of it

    def __str__(self):
        return str(self.choice)


def plan_decode(q, k_cache, indices, *, topk_length=None, attn_sink=None, extra_k_cache=None,
                extra_indices_in_kvcache=None, extra_topk_length=None, softmax_scale=None,
                kv_format="v4", block_size=None, extra_block_size=None, extra_kv_format=None,
                q_scale=None, impl="auto") -> DecodePlan:
    """The plan of ``flash_mla_with_kvcache`` on these arguments (see the module docstring)."""
    b, s_q, h = q.shape[:3]
    out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device).transpose(1, 2)
    bs, extra_bs = ops._validate_decode(
        q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices_in_kvcache,
        extra_topk_length, attn_sink, kv_format, block_size, extra_block_size, extra_kv_format,
        q_scale=q_scale)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    extra_fmt = ops._extra_format(kv_format, extra_kv_format)
    args = (q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices_in_kvcache,
            extra_topk_length, attn_sink, scale, kv_format, bs, extra_bs, extra_fmt, q_scale)
    choice = dispatch.dispatcher("flashmla_sparse_decode").explain(impl, *args)
    return DecodePlan(choice, _decode_kinds(q, k_cache, indices, topk_length, attn_sink,
                                            extra_k_cache, extra_indices_in_kvcache,
                                            extra_topk_length, q_scale),
                      scale, kv_format, bs, extra_bs, extra_fmt, _ran(choice))


def _decode_kinds(q, k_cache, indices, topk_length, attn_sink, extra_k_cache, extra_indices,
                  extra_topk_length, q_scale):
    return (_meta(q), tuple(k_cache.shape[1:]), k_cache.dtype, _meta(indices), _meta(topk_length),
            _meta(attn_sink), None if extra_k_cache is None else tuple(extra_k_cache.shape[1:]),
            _meta(extra_indices), _meta(extra_topk_length), _meta(q_scale))


def run_decode(plan: DecodePlan, q, k_cache, indices, *, topk_length=None, attn_sink=None,
               extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None,
               q_scale=None, out=None, lse=None):
    """``flash_mla_with_kvcache``'s ``(out, lse)`` for a call of ``plan``'s kind, by its plan
    (``out`` / ``lse``: persistent buffers for CUDA graphs, as the op takes them)."""
    got = _decode_kinds(q, k_cache, indices, topk_length, attn_sink, extra_k_cache,
                        extra_indices_in_kvcache, extra_topk_length, q_scale)
    _check_kind("decode", plan.kinds, got, _DECODE_NAMES)
    b, s_q, h = q.shape[:3]
    if out is None:
        out = torch.empty(b, s_q, h, 512, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device).transpose(1, 2)
    args = (q, k_cache, indices, out, lse, topk_length, extra_k_cache, extra_indices_in_kvcache,
            extra_topk_length, attn_sink, plan.scale, plan.kv_format, plan.block_size,
            plan.extra_block_size, plan.extra_kv_format, q_scale)
    _run(plan, "flashmla_sparse_decode", args)
    return out, lse


def decode_with_plans(plans: dict, q, k_cache, indices, out, lse, *, topk_length=None,
                      extra_k_cache=None, extra_indices=None, extra_topk_length=None,
                      attn_sink=None, softmax_scale=None, kv_format="v4", block_size=None,
                      extra_block_size=None, extra_kv_format=None, q_scale=None, impl="auto"):
    """``flashmla_sparse_decode`` (its arguments) by a plan kept in ``plans``: made by the
    first call of its kind, reused by every later one. A model step keeps one dict for the
    layers that share its index lists (the backends' ``StepPlanner.op_plans``, emptied each
    step), so only its first layer validates and chooses. Under torch.compile: the op."""
    if torch.compiler.is_compiling():
        ops.flashmla_sparse_decode(
            q, k_cache, indices, out, lse, topk_length=topk_length, extra_k_cache=extra_k_cache,
            extra_indices=extra_indices, extra_topk_length=extra_topk_length,
            attn_sink=attn_sink, softmax_scale=softmax_scale, kv_format=kv_format,
            block_size=block_size, extra_block_size=extra_block_size,
            extra_kv_format=extra_kv_format, q_scale=q_scale, impl=impl)
        return
    key = (_meta(q), tuple(k_cache.shape[1:]), k_cache.dtype, _meta(indices), kv_format,
           extra_kv_format, _meta(extra_indices), attn_sink is None, softmax_scale, impl)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = plan_decode(
            q, k_cache, indices, topk_length=topk_length, attn_sink=attn_sink,
            extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices,
            extra_topk_length=extra_topk_length, softmax_scale=softmax_scale,
            kv_format=kv_format, block_size=block_size, extra_block_size=extra_block_size,
            extra_kv_format=extra_kv_format, q_scale=q_scale, impl=impl)
    run_decode(plan, q, k_cache, indices, topk_length=topk_length, attn_sink=attn_sink,
               extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices,
               extra_topk_length=extra_topk_length, q_scale=q_scale, out=out, lse=lse)


_DECODE_NAMES = ("q", "k_cache (its blocks)", "k_cache dtype", "indices", "topk_length",
                 "attn_sink", "extra_k_cache (its blocks)", "extra_indices_in_kvcache",
                 "extra_topk_length", "q_scale")


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """A ``flash_mla_sparse_fwd`` call planned (as ``DecodePlan``). ``direct``: FlashMLA's own
    prefill is called as it is — its head counts (64, 128), index lists a multiple of
    ``vendor.PREFILL_WIDTH`` wide — with no padding and no copies."""
    choice: dispatch.Choice
    kinds: tuple
    scale: float
    direct: bool
    ran: dispatch.Choice      # ``choice`` as ``last_choice`` records a run of it

    def __str__(self):
        return str(self.choice) + ("; FlashMLA called directly" if self.direct else "")


def plan_prefill(q, kv, indices, sm_scale, *, attn_sink=None, topk_length=None,
                 impl="auto") -> PrefillPlan:
    """The plan of ``flash_mla_sparse_fwd`` on these arguments (see the module docstring)."""
    s_q, h = q.shape[:2]
    out = torch.empty(s_q, h, 512, dtype=torch.bfloat16, device=q.device)
    max_logits = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(max_logits)
    ops._validate_prefill(q, kv, indices, out, max_logits, lse, topk_length, attn_sink)
    args = (q, kv, indices, out, max_logits, lse, topk_length, attn_sink, float(sm_scale))
    choice = dispatch.dispatcher("flashmla_sparse_prefill").explain(impl, *args)
    direct = choice.impl == "vendor" and vendor.prefill_direct_fits(q, indices)
    return PrefillPlan(choice, _prefill_kinds(q, kv, indices, topk_length, attn_sink),
                       float(sm_scale), direct, _ran(choice))


def _prefill_kinds(q, kv, indices, topk_length, attn_sink):
    return (_meta(q), tuple(kv.shape[1:]), kv.dtype, kv.device, _meta(indices),
            _meta(topk_length), _meta(attn_sink))


_PREFILL_NAMES = ("q", "kv (a row)", "kv dtype", "kv device", "indices", "topk_length",
                  "attn_sink")


def run_prefill(plan: PrefillPlan, q, kv, indices, *, attn_sink=None, topk_length=None):
    """``flash_mla_sparse_fwd``'s ``out`` [s_q, h, 512] for a call of ``plan``'s kind, by its
    plan (FlashMLA's own output where ``plan.direct``)."""
    _check_kind("prefill", plan.kinds, _prefill_kinds(q, kv, indices, topk_length, attn_sink),
                _PREFILL_NAMES)
    if plan.direct:
        dispatch.record_choice(plan.ran)
        return vendor.prefill_direct(q, kv, indices, plan.scale, attn_sink, topk_length)
    s_q, h = q.shape[:2]
    out = torch.empty(s_q, h, 512, dtype=torch.bfloat16, device=q.device)
    max_logits = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
    lse = torch.empty_like(max_logits)
    _run(plan, "flashmla_sparse_prefill",
         (q, kv, indices, out, max_logits, lse, topk_length, attn_sink, plan.scale))
    return out


def _check_kind(what, want, got, names):
    for name, w, g in zip(names, want, got):
        if w != g:
            raise ValueError(f"this {what} plan was made for {name} {_show(w)}, the call has "
                             f"{_show(g)}")


def _show(meta):
    if meta is None:
        return "None"
    if isinstance(meta, tuple) and len(meta) == 3 and isinstance(meta[1], torch.dtype):
        return f"shape {list(meta[0])} {meta[1]} on {meta[2]}"
    return str(meta)


def _run(plan, op, args):
    """Run ``plan`` on the dispatcher arguments ``args``: the Triton route with its launch
    plan (checked against the call: ``LaunchPlan.check_fits``), the others as they are."""
    d = dispatch.dispatcher(op)
    if plan.choice.impl == "triton" and plan.choice.plan is not None:
        d.run(plan.ran, *args, plan=plan.choice.plan)
    else:
        d.run(plan.ran, *args)


def _ran(choice):
    """``choice`` as ``last_choice`` records a call of it (made once per plan)."""
    return dataclasses.replace(choice, ahead=False, plan=None)

