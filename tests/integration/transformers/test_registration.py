"""Registration, switching implementations, the mask facts it relies on, and refusals."""
import pathlib
import re

import pytest
import torch
import transformers
from transformers import (AttentionInterface, DeepseekV4ForCausalLM, LlamaConfig,
                          LlamaForCausalLM)
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

import sparse_mla
import sparse_mla.integration.transformers as hf
from sparse_mla.integration.transformers import models
from sparse_mla.integration.transformers.attention import sparse_mla_attention_forward
from sparse_mla.tests.integration.transformers.recording import record


def _ids(config, batch=2, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (batch, length), generator=g)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_import_registers_and_register_is_idempotent():
    assert AttentionInterface._global_mapping["sparse_mla"] is sparse_mla_attention_forward
    assert AttentionMaskInterface._global_mapping["sparse_mla"] is eager_mask
    check = transformers.PreTrainedModel.get_correct_attn_implementation
    hf.register()
    hf.register()
    assert transformers.PreTrainedModel.get_correct_attn_implementation is check


# -- the mask facts (transformers 5.17.0 here; the issue measured them on 5.17-5.23) ----------

def _compressed_part(call):
    """The mask columns of the compressed entries (no cache: the window part is S_q wide)."""
    return call.mask[..., call.query.shape[2]:]


def test_fact_without_a_mask_function_the_block_bias_is_dropped():
    model = models.random_model(models.tiny_config(), torch.float32)
    ids = _ids(model.config)
    calls = record(model, lambda: model(ids, use_cache=False), mask_function=None)
    assert calls and all(c.mask is None for c in calls)


def test_fact_a_boolean_mask_inverts_the_block_bias_and_eager_keeps_it():
    model = models.random_model(models.tiny_config(), torch.float32)
    ids = _ids(model.config)
    run = lambda: model(ids, use_cache=False)  # noqa: E731
    eager = record(model, run)
    boolean = record(model, run, mask_function=sdpa_mask)
    compressed = [(e, b) for e, b in zip(eager, boolean)
                  if e.module.layer_type != "sliding_attention"]
    assert len(compressed) == 2
    for e, b in compressed:
        visible = _compressed_part(e) == 0               # eager: 0 visible, -inf hidden
        assert b.mask.dtype == torch.bool and visible.any() and (~visible).any()
        assert torch.equal(_compressed_part(b), ~visible)  # sdpa: True would mean visible


# -- switching --------------------------------------------------------------------------------

def test_from_config_from_pretrained_and_switching_back_and_forth(tmp_path):
    config = models.tiny_config()
    models.random_model(config, torch.float32, seed=5).save_pretrained(tmp_path)
    ids = _ids(config)
    eager = DeepseekV4ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                  dtype=torch.float32).eval()
    ours = DeepseekV4ForCausalLM.from_pretrained(tmp_path, attn_implementation="sparse_mla",
                                                 dtype=torch.float32).eval()
    assert ours.config._attn_implementation == "sparse_mla"
    want = _logits(eager, ids)
    torch.testing.assert_close(_logits(ours, ids), want, rtol=1e-5, atol=1e-5)
    for impl in ("eager", "sparse_mla", "eager", "sparse_mla"):
        ours.set_attn_implementation(impl)
        assert ours.config._attn_implementation == impl
        torch.testing.assert_close(_logits(ours, ids), want, rtol=1e-5, atol=1e-5)

    built = DeepseekV4ForCausalLM._from_config(config, attn_implementation="sparse_mla")
    assert built.config._attn_implementation == "sparse_mla"


def test_the_sparse_path_really_runs(monkeypatch):
    """Switching is observable: the attention function runs once per layer."""
    from sparse_mla.integration.transformers import attention
    model = models.random_model(models.tiny_config(), torch.float32)
    model.set_attn_implementation("sparse_mla")
    seen = []
    real = attention.visible_index_lists
    monkeypatch.setattr(attention, "visible_index_lists",
                        lambda mask, width, **kw: seen.append(width) or real(mask, width, **kw))
    _logits(model, _ids(model.config))
    assert len(seen) == 3
    model.set_attn_implementation("eager")
    _logits(model, _ids(model.config))
    assert len(seen) == 3


# -- refusals ---------------------------------------------------------------------------------

def _head_dim_32():
    return models.tiny_config(head_dim=32, partial_rotary_factor=0.5)


def test_head_dim_other_than_512_is_refused_everywhere(tmp_path):
    config = _head_dim_32()
    with pytest.raises(ValueError, match="head_dim 512; this config has head_dim 32"):
        DeepseekV4ForCausalLM._from_config(config, attn_implementation="sparse_mla")
    model = models.random_model(config, torch.float32)
    with pytest.raises(ValueError, match="head_dim 512; this config has head_dim 32"):
        model.set_attn_implementation("sparse_mla")
    assert model.config._attn_implementation == "eager"
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="head_dim 512; this config has head_dim 32"):
        DeepseekV4ForCausalLM.from_pretrained(tmp_path, attn_implementation="sparse_mla")


def test_transformers_without_block_bias_is_refused(monkeypatch):
    """(Simulated: transformers < 5.8.1 has no DeepSeek-V4 to build.)"""
    from sparse_mla.integration.transformers import registration
    assert registration.installed_version() == transformers.__version__
    monkeypatch.setattr(registration, "installed_version", lambda: "5.8.0")
    with pytest.raises(ValueError, match=r"5\.8\.0 predates DeepSeek-V4's block_bias.*5\.8\.1"):
        DeepseekV4ForCausalLM._from_config(models.tiny_config(),
                                           attn_implementation="sparse_mla")


def test_next_major_transformers_is_refused(monkeypatch):
    """(Simulated: no transformers 6 exists to run against.)"""
    from sparse_mla.integration.transformers import registration
    monkeypatch.setattr(registration, "installed_version", lambda: "6.0.0")
    with pytest.raises(ValueError, match=r"6\.0\.0 is a major release .*<6"):
        DeepseekV4ForCausalLM._from_config(models.tiny_config(),
                                           attn_implementation="sparse_mla")
    monkeypatch.setattr(registration, "installed_version", lambda: "5.99.0")
    assert registration.unsupported_reason(models.tiny_config()) is None


def test_wheel_requires_the_range_the_code_accepts():
    """The HF wheel's transformers pin (tools/bazel/versions.bzl) is the code's gate."""
    from sparse_mla.integration.transformers import registration
    bzl = (pathlib.Path(sparse_mla.__file__).parent / "tools/bazel/versions.bzl").read_text()
    pin = re.search(r'"transformers":\s*"([^"]+)"', bzl).group(1)
    assert pin == registration.REQUIREMENT == "transformers>=5.8.1,<6"


def test_other_models_are_refused():
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, head_dim=512)
    model = LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="DeepSeek-V4 and GLM-5.3 .glm5_next. DSA attention "
                                         "only; this model is 'llama'"):
        model.set_attn_implementation("sparse_mla")


def test_masks_it_cannot_reproduce_are_refused_on_cpu():
    model = models.random_model(models.tiny_config(), torch.float32)
    ids = _ids(model.config, batch=1, length=16)
    (call, *_) = record(model, lambda: model(ids, use_cache=False))
    args = (call.module, call.query, call.key, call.value)
    biased = call.mask.clone()
    biased[0, 0, 5, 2] = -1.0                     # a finite bias on a hidden key
    with pytest.raises(ValueError, match="finite nonzero bias"):
        sparse_mla_attention_forward(*args, biased, **call.kwargs)
    with pytest.raises(ValueError, match="needs DeepSeek-V4's additive attention mask"):
        sparse_mla_attention_forward(*args, None, **call.kwargs)
    with pytest.raises(ValueError, match="value must be key"):
        sparse_mla_attention_forward(call.module, call.query, call.key, call.key.clone(),
                                     call.mask, **call.kwargs)
    with pytest.raises(ValueError, match="no dropout"):
        sparse_mla_attention_forward(*args, call.mask, **{**call.kwargs, "dropout": 0.1})
    half = call.key.half()
    with pytest.raises(TypeError, match="serves bf16 and fp32 models"):
        sparse_mla_attention_forward(call.module, call.query.half(), half, half, call.mask,
                                     **call.kwargs)
