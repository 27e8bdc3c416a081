"""Registering ``attn_implementation="sparse_mla"`` with HF transformers.

Three pieces, all idempotent:
- the attention function, with ``AttentionInterface``;
- eager's additive mask function, with ``AttentionMaskInterface``. Without a mask function
  the model's mask is None and DeepSeek-V4 drops its compressor's per-query ``block_bias``
  (every query would see every compressed entry); sdpa's boolean mask inverts the -inf / 0
  ``block_bias`` when it is concatenated on. eager's float mask keeps it exact.
- a support check run wherever transformers validates an implementation (``__init__`` via
  ``from_pretrained`` / ``_from_config``, and ``set_attn_implementation``): models the
  kernels cannot serve fail there, naming the reason, instead of computing wrong numbers.
"""
from __future__ import annotations

import functools
import importlib.metadata
import re

from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from sparse_mla.integration.transformers import glm5
from sparse_mla.integration.transformers.attention import (HEAD_DIM, MAX_HEADS,
                                                           sparse_mla_attention_forward)

NAME = "sparse_mla"
# The supported range, one statement for the code, the wheel and the docs (the wheel's pin in
# tools/bazel/versions.bzl must equal REQUIREMENT: tests/integration/transformers checks it).
# From the first release whose DeepSeek-V4 attention concatenates the compressor's block_bias
# onto the mask it passes to attention functions (and the first with DeepSeek-V4 at all), up
# to the next major release, whose attention interface nobody has run this against. Run here:
# 5.8.1, 5.17.0 and 5.24.0 (docs/integrations.md).
MIN_TRANSFORMERS = (5, 8, 1)
BELOW_TRANSFORMERS = (6,)
REQUIREMENT = (f"transformers>={'.'.join(map(str, MIN_TRANSFORMERS))},"
               f"<{'.'.join(map(str, BELOW_TRANSFORMERS))}")


def _version(text: str):
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def installed_version() -> str:
    return importlib.metadata.version("transformers")


def unsupported_reason(config) -> str | None:
    """Why ``config``'s model cannot use sparse_mla attention here, or None."""
    have = installed_version()
    if _version(have) < MIN_TRANSFORMERS:
        return (f"transformers {have} predates DeepSeek-V4's block_bias in the attention "
                f"mask (needs {REQUIREMENT})")
    if _version(have) >= BELOW_TRANSFORMERS:
        return (f"transformers {have} is a major release this integration was not written "
                f"for (needs {REQUIREMENT})")
    model_type = getattr(config, "model_type", None)
    if model_type in glm5.MODEL_TYPES + ("glm5_next_vision",):
        return glm5.unsupported_reason(config)
    if model_type != "deepseek_v4":
        return (f"it implements DeepSeek-V4 and GLM-5.3 (glm5_next) DSA attention only; this "
                f"model is {model_type!r}")
    head_dim = getattr(config, "head_dim", None)
    if head_dim != HEAD_DIM:
        return f"its kernels take head_dim {HEAD_DIM}; this config has head_dim {head_dim}"
    heads = config.num_attention_heads
    if not 1 <= heads <= MAX_HEADS:
        return f"its kernels take 1..{MAX_HEADS} attention heads; this config has {heads}"
    kv_heads = getattr(config, "num_key_value_heads", 1)
    if kv_heads != 1:
        return f"it needs one shared KV head; this config has {kv_heads}"
    return None


def _checked(original):
    @functools.wraps(original)
    def get_correct_attn_implementation(self, requested_attention, *args, **kwargs):
        if requested_attention == NAME:
            reason = unsupported_reason(self.config)
            if reason:
                raise ValueError(f'attn_implementation="{NAME}" cannot serve '
                                 f"{type(self).__name__}: {reason}")
        return original(self, requested_attention, *args, **kwargs)
    get_correct_attn_implementation._sparse_mla_checked = True
    return get_correct_attn_implementation


def register() -> None:
    """Make ``attn_implementation="sparse_mla"`` available (safe to call repeatedly)."""
    AttentionInterface.register(NAME, sparse_mla_attention_forward)
    AttentionMaskInterface.register(NAME, eager_mask)
    method = PreTrainedModel.get_correct_attn_implementation
    if not getattr(method, "_sparse_mla_checked", False):
        PreTrainedModel.get_correct_attn_implementation = _checked(method)
