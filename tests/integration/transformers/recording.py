"""Test helpers: what DeepSeek-V4's attention layers hand an attention function."""
from __future__ import annotations

import dataclasses
import itertools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

_NAMES = itertools.count()


@dataclasses.dataclass
class Call:
    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: object
    kwargs: dict


def record(model, run, mask_function=eager_mask, eager=dsv4.eager_attention_forward):
    """Run ``run()`` with ``model`` on a recording implementation (``eager``: the model's
    eager attention, with ``mask_function`` registered, or none when None); returns the
    calls in order and restores the model's implementation."""
    calls = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append(Call(module, query, key, value, attention_mask, kwargs))
        mask = attention_mask
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            # computed as an sdpa-style mask means (True = attend), so layers before the
            # one inspected see the same window masks as under eager
            mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, float("-inf"))
        return eager(module, query, key, value, mask, **kwargs)

    name = f"_sparse_mla_test_recording_{next(_NAMES)}"
    AttentionInterface.register(name, recording)
    if mask_function is not None:
        AttentionMaskInterface.register(name, mask_function)
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            run()
    finally:
        model.set_attn_implementation(before)
    return calls


def eager_fp32(call: Call):
    """Eager's attention on the call's inputs in fp32 (sinks, mask included): the truth
    against which bf16 results are measured."""
    class Module:
        num_key_value_groups = call.module.num_key_value_groups
        sinks = call.module.sinks.detach().float()
        training = False
    mask = None if call.mask is None else call.mask.float()
    kwargs = {**call.kwargs, "s_aux": Module.sinks}
    out, _ = dsv4.eager_attention_forward(Module, call.query.float(), call.key.float(),
                                          call.value.float(), mask, **kwargs)
    return out
