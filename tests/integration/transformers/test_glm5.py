"""sparse_mla attention vs GLM-5.3's (``glm5_next``) own eager attention on the same weights.

A tiny random GLM-5.3 built through transformers' classes (glm5_models.py: qk_nope = v_head =
256 NoPE heads, a KDA layer and full / shared / full DSA layers, kpool 4 with top-8 and the
tail). fp32 must match eager tightly; bf16 must be about as close to the fp32 weights as eager
bf16 is. CPU runs the op's reference route; CUDA the Triton route.
"""
import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as glm

import sparse_mla.integration.transformers  # noqa: F401  (registers "sparse_mla")
from sparse_mla.integration.transformers import glm5, glm5_models, models
from sparse_mla.integration.transformers.attention import sparse_mla_attention_forward
from sparse_mla.ops.common.dispatch import last_choice
from sparse_mla.tests.helpers import CUDA
from sparse_mla.tests.integration.transformers.recording import record

DEVICES = ["cpu"] + ([pytest.param("cuda", id="cuda")] if CUDA else [])
PROMPT = 30
PAD = 9               # row 1 is left-padded by this many tokens: unequal lengths
SPARSE = glm5_models.text_only("sparse_mla")
EAGER = glm5_models.text_only("eager")


def _prompts(seed, batch=2, length=PROMPT, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        mask[1, :PAD] = 0
        ids[1, :PAD] = 0
    return ids.to(device), mask.to(device)


def _greedy(model, ids, mask, new_tokens, scores=False):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             output_scores=scores, return_dict_in_generate=True)
    if not scores:
        return out.sequences
    top2 = torch.stack(out.scores, 1).float().topk(2, dim=-1).values
    return out.sequences, top2[..., 0] - top2[..., 1]


def _record(model, run):
    return record(model, run, eager=glm.eager_attention_forward)


def _eager_fp32(call):
    out, _ = glm.eager_attention_forward(call.module, call.query.float(), call.key.float(),
                                         call.value.float(), call.mask.float(), **call.kwargs)
    return out


def _empty_rows(call):
    """[B, S] rows of the call's mask with no visible key (pad queries only)."""
    return (call.mask[:, 0] == 0).sum(-1) == 0


# -- what HF hands the attention function ------------------------------------------------

def test_fact_dsa_layers_call_the_interface_with_unabsorbed_heads_and_a_topk_mask():
    """The premises of glm5.py: only DSA layers call it (not KDA, and not the vision tower
    on text input); per-head q / k / v of 256 (MLA not absorbed, NoPE); an additive 0 /
    finfo.min mask of at most index_topk + kpool - 1 visible keys per row, causal."""
    model = glm5_models.random_model(glm5_models.tiny_config(), torch.float32, seed=0)
    ids, mask = _prompts(0)
    calls = _record(model, lambda: _greedy(model, ids, mask, new_tokens=2))
    cfg = model.config.text_config
    assert len(calls) == 3 * 2                      # 3 DSA layers x (prefill, one decode step)
    assert [c.module.layer_idx for c in calls[:3]] == [1, 2, 3]
    for c in calls:
        assert isinstance(c.module, glm.Glm5NextTextAttention)
        b, h, s, d = c.query.shape
        n = c.key.shape[2]
        assert (b, h, d) == (2, 4, 256) and c.key.shape == (b, h, n, 256)
        assert c.value.shape == (b, h, n, 256) and c.key.data_ptr() != c.value.data_ptr()
        assert c.mask.dtype == torch.float32 and c.mask.shape == (b, 1, s, n)
        assert set(c.mask.unique().tolist()) <= {0.0, torch.finfo(torch.float32).min}
        visible = c.mask[:, 0] == 0
        assert visible.sum(-1).max() <= cfg.index_topk + cfg.index_kpool - 1
        later = torch.arange(n) > (n - s + torch.arange(s))[:, None]
        assert not (visible & later).any()
        assert c.kwargs["scaling"] == 256 ** -0.5
    # real queries always see a key; rows without one are pad queries
    prefill = calls[0]
    assert torch.equal(_empty_rows(prefill), mask == 0)
    # the shared layer gets the previous layer's selection
    assert torch.equal(calls[1].mask, calls[0].mask)


# -- the attention function alone --------------------------------------------------------

class _Layer:
    """What the function reads of an attention module."""
    def __init__(self, index_topk=8, kpool=4, tail=True):
        self.layer_idx = 0
        self.num_key_value_groups = 1
        self.training = False
        self.config = glm5_models.tiny_config(
            index_topk=index_topk, index_kpool=kpool,
            index_kpool_always_select_tail=tail).text_config


def _random_call(dtype, b=2, h=3, s=5, n=19, dqk=64, dv=40, width=11, seed=0):
    """HF-like inputs: q / k / v as strided views of projections, a random mask of up to
    ``width`` visible keys per row with some empty rows."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, dqk, generator=g).to(dtype).transpose(1, 2)
    kv = torch.randn(b, n, h, dqk + dv, generator=g).to(dtype).transpose(1, 2)
    k, v = kv[..., :dqk], kv[..., dqk:]
    keep = torch.rand(b, s, n, generator=g).argsort(-1) < torch.randint(
        0, width + 1, (b, s, 1), generator=g)
    keep[0, 0] = False                                   # an empty row
    keep[1, 1] = torch.arange(n) < width                 # a full one
    mask = torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype).unsqueeze(1)
    return q, k, v, mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(64, 40), (256, 256)], ids=["qk64-v40", "qk256-v256"])
def test_function_matches_eager_on_its_visible_keys(device, dtype, dims):
    """Strided inputs, odd sizes, empty and full rows, and NaN in every key / value no row
    sees: equal to eager (fp32) on the visible keys; empty rows come out 0."""
    dqk, dv = dims
    q, k, v, mask = _random_call(dtype, dqk=dqk, dv=dv)
    hidden = (mask[:, 0] != 0).all(1)                    # [B, N] keys no query sees
    k, v = k.clone(), v.clone()
    k.masked_fill_(hidden[:, None, :, None], float("nan"))
    v.masked_fill_(hidden[:, None, :, None], float("nan"))
    assert hidden.any()
    layer = _Layer()
    args = [t.to(device) for t in (q, k, v, mask)]
    got, weights = sparse_mla_attention_forward(layer, *args, scaling=dqk ** -0.5)
    assert weights is None and got.dtype == dtype and got.shape == (2, 5, 3, dv)
    clean = [t.float().nan_to_num(0.0) for t in (q, k, v)]
    want, _ = glm.eager_attention_forward(layer, *clean, mask.float(), scaling=dqk ** -0.5)
    empty = (mask[:, 0] != 0).all(-1)                    # [B, S]
    want[empty] = 0
    got = got.float().cpu()
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        scale = want.abs().amax(-1, keepdim=True)
        err = (got - want).abs()
        assert (err <= scale * 3 / 128 + 8e-4).all(), err.max()
    assert (got[empty] == 0).all()
    if device != "cpu" and dtype == torch.bfloat16:
        assert last_choice("flashmla_sparse_prefill").impl in ("triton", "vendor")


def test_function_refuses_what_it_cannot_serve():
    q, k, v, mask = _random_call(torch.float32)
    layer = _Layer()
    biased = mask.clone()
    biased[0, 0, 2, 3] = -1.0
    with pytest.raises(ValueError, match="finite nonzero bias"):
        sparse_mla_attention_forward(layer, q, k, v, biased)
    crowded = torch.zeros_like(mask)                      # 19 visible > width 11
    with pytest.raises(ValueError, match="more than 11 visible keys"):
        sparse_mla_attention_forward(layer, q, k, v, crowded)
    with pytest.raises(ValueError, match="additive top-k attention mask"):
        sparse_mla_attention_forward(layer, q, k, v, mask == 0)
    with pytest.raises(ValueError, match="value must have shape"):
        sparse_mla_attention_forward(layer, q, k, v[:, :, :4], mask)
    with pytest.raises(ValueError, match="key must have shape"):
        sparse_mla_attention_forward(layer, q, k[:, :1], v, mask)
    with pytest.raises(ValueError, match="exceed the kernels' 512-wide row"):
        sparse_mla_attention_forward(layer, q.repeat(1, 1, 1, 8), k.repeat(1, 1, 1, 8), v,
                                     mask)
    with pytest.raises(ValueError, match="no dropout"):
        sparse_mla_attention_forward(layer, q, k, v, mask, dropout=0.1)
    with pytest.raises(TypeError, match="serves bf16 and fp32 models"):
        sparse_mla_attention_forward(layer, q.half(), k.half(), v.half(), mask.half())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_it_cannot_reproduce_come_out_nan_without_value_checks(dtype, monkeypatch):
    """On a GPU (value checks off) a row with more visible keys than the width is poisoned,
    not raised (no host sync); the other rows are unchanged."""
    q, k, v, mask = _random_call(dtype)
    layer = _Layer()
    want, _ = sparse_mla_attention_forward(layer, q, k, v, mask)
    crowded = mask.clone()
    crowded[1, 0, 3] = 0.0                               # all 19 keys visible > width 11
    monkeypatch.setattr(glm5.checks, "value_checks_enabled", lambda *t: False)
    got, _ = sparse_mla_attention_forward(layer, q, k, v, crowded)
    assert torch.isnan(got[1, 3]).all()
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 3] = False
    assert torch.equal(got[keep], want[keep])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_attention_function_compiles_as_one_graph(device, dtype):
    """As DeepSeek-V4's (test_compile.py): one graph whose sparse_mla nodes are custom ops
    (the bf16 call whole, the fp32 path's lists), equal to the uncompiled function."""
    model = glm5_models.random_model(glm5_models.tiny_config(), dtype, device=device, seed=5)
    ids, mask = _prompts(5, device=device)
    calls = _record(model, lambda: _greedy(model, ids, mask, new_tokens=2))
    torch._dynamo.reset()
    targets = set()

    def backend(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    compiled = torch.compile(sparse_mla_attention_forward, fullgraph=True, backend=backend)
    for c in calls:
        with torch.no_grad():
            want = sparse_mla_attention_forward(c.module, c.query, c.key, c.value, c.mask,
                                                **c.kwargs)[0]
            got = compiled(c.module, c.query, c.key, c.value, c.mask, **c.kwargs)[0]
        assert torch.equal(got, want)
    ours = {t for t in targets if "sparse_mla_hf" in t}
    assert ours == ({"sparse_mla_hf.glm5_attend.default"} if dtype == torch.bfloat16
                    else {"sparse_mla_hf.index_lists.default"}), targets


# -- registration --------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, reason", [
    (dict(qk_nope_head_dim=384), r"v_head_dim 256 \+ qk head dim 384 > 512"),
    (dict(index_kpool_always_select_tail=False), "index_kpool_always_select_tail=False"),
    (dict(index_topk=0), "index_topk 0 < index_kpool 4 selects no pool"),
])
def test_unsupported_configs_are_refused_with_their_reason(overrides, reason):
    config = glm5_models.tiny_config(**overrides)
    with pytest.raises(ValueError, match=reason):
        glm.Glm5NextForConditionalGeneration._from_config(config, attn_implementation=SPARSE)
    model = glm5_models.random_model(config, torch.float32)
    with pytest.raises(ValueError, match=reason):
        model.set_attn_implementation(SPARSE)
    assert model.config.text_config._attn_implementation == "eager"


def test_the_vision_tower_is_refused_and_the_text_model_accepted(monkeypatch, tmp_path):
    model = glm5_models.random_model(glm5_models.tiny_config(), torch.float32)
    with pytest.raises(ValueError, match="Glm5NextVisionModel: GLM-5.3's vision tower"):
        model.set_attn_implementation("sparse_mla")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Glm5NextVisionModel: GLM-5.3's vision tower"):
        glm.Glm5NextForConditionalGeneration.from_pretrained(tmp_path,
                                                            attn_implementation="sparse_mla")
    loaded = glm.Glm5NextForConditionalGeneration.from_pretrained(
        tmp_path, attn_implementation={"text_config": "sparse_mla", "vision_config": "sdpa"})
    assert loaded.config.text_config._attn_implementation == "sparse_mla"
    assert loaded.config.vision_config._attn_implementation == "sdpa"
    model.set_attn_implementation(SPARSE)
    assert model.config.text_config._attn_implementation == "sparse_mla"
    assert model.config.vision_config._attn_implementation == "eager"
    ran = []
    real = glm5.attention_forward
    monkeypatch.setattr(glm5, "attention_forward",
                        lambda *a, **kw: ran.append(a[0].layer_idx) or real(*a, **kw))
    ids, mask = _prompts(0)
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(EAGER)
        eager = model(ids, attention_mask=mask).logits
    assert ran == [1, 2, 3]
    torch.testing.assert_close(ours[mask.bool()], eager[mask.bool()], rtol=1e-5, atol=1e-5)
    from_config = glm.Glm5NextForConditionalGeneration._from_config(
        glm5_models.tiny_config(), attn_implementation=SPARSE)
    assert from_config.config.text_config._attn_implementation == "sparse_mla"


# -- the model ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_every_call_is_as_close_to_fp32_as_eager_bf16(device):
    """Each DSA call of a prefill and of decode steps, bf16, with the indexer picking 2 of
    up to 10 pools: within bf16 rounding of eager's fp32 result on the same inputs and no
    farther from it than eager's own bf16 result, up to one output rounding (pad queries, which
    see no key, aside)."""
    model = glm5_models.random_model(glm5_models.tiny_config(), torch.bfloat16,
                                     device=device, seed=3)
    ids, mask = _prompts(3, length=40, device=device)
    calls = _record(model, lambda: _greedy(model, ids, mask, new_tokens=3))
    assert len(calls) == 3 * 3
    for c in calls:
        with torch.no_grad():
            got, _ = sparse_mla_attention_forward(c.module, c.query, c.key, c.value, c.mask,
                                                  **c.kwargs)
            want = _eager_fp32(c)
            eager_bf16, _ = glm.eager_attention_forward(c.module, c.query, c.key, c.value,
                                                        c.mask, **c.kwargs)
        real = ~_empty_rows(c)
        assert got.shape == want.shape
        got, want, eager_bf16 = got.float()[real], want[real], eager_bf16.float()[real]
        err = (got - want).abs()
        scale = want.abs().amax(-1, keepdim=True)
        assert (err <= scale * 3 / 128 + 8e-4).all(), err.max()
        # plus half a bf16 step of the largest element: our output is rounded to bf16
        # once more than eager's is compared here (FlashMLA on an H200: 0.0045 vs eager 0.0040)
        assert err.max() <= (eager_bf16 - want).abs().max() + scale.max() * 2 ** -9
    if device != "cpu":
        assert last_choice("flashmla_sparse_prefill").impl in ("triton", "vendor")


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_forward_logits_match_eager_tightly(device):
    model = glm5_models.random_model(glm5_models.tiny_config(), torch.float32,
                                     device=device, seed=1)
    ids, mask = _prompts(1, length=40, device=device)
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
        model.set_attn_implementation(SPARSE)
        ours = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], eager[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device, config, length", [
    ("cpu", glm5_models.greedy_config, 40),
    *([pytest.param("cuda", glm5_models.greedy_config, 40, id="cuda"),
       pytest.param("cuda", glm5_models.real_dims_config, 256, id="cuda-real-dims")]
      if CUDA else [])])
def test_bf16_forward_logits_match_eager_within_its_own_rounding(device, config, length):
    """As test_attention.py's DeepSeek-V4 test: sparse_mla about as close to the fp32 weights
    as eager bf16 is. ``greedy_config``: its indexer keeps every pool (bf16 rounding flips
    top-2 pool picks in eager itself; the per-call test covers picks); on a GPU also the
    64-head real dimensions (top-2048 keeps every pool of 256 tokens)."""
    model = glm5_models.random_model(config(), torch.bfloat16, device=device, seed=1)
    twin = glm5_models.random_model(model.config, torch.float32, device=device)
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ids, mask = _prompts(1, length=length, device=device)
    with torch.no_grad():
        truth = twin(ids, attention_mask=mask).logits
        eager = model(ids, attention_mask=mask).logits.float()
        model.set_attn_implementation(SPARSE)
        ours = model(ids, attention_mask=mask).logits.float()
    real = mask.bool()
    e, o = (eager - truth)[real].abs(), (ours - truth)[real].abs()
    print(f"vs fp32: eager bf16 max {e.max():.4f} mean {e.mean():.5f}; sparse_mla max "
          f"{o.max():.4f} mean {o.mean():.5f}")
    assert 0 < e.max() < 0.05 * truth.abs().max()
    assert o.max() <= 1.5 * e.max() and o.mean() <= 1.2 * e.mean()
    assert (ours - eager)[real].abs().max() <= 2.5 * e.max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1])
def test_fp32_greedy_tokens_equal_eager(device, seed):
    """Prefill + 12 decode steps with the indexer picking, batch 2 with unequal lengths."""
    model = glm5_models.random_model(glm5_models.tiny_config(), torch.float32,
                                     device=device, seed=seed)
    ids, mask = _prompts(seed, device=device)
    eager = _greedy(model, ids, mask, 12)
    model.set_attn_implementation(SPARSE)
    ours = _greedy(model, ids, mask, 12)
    assert ours.shape == (2, PROMPT + 12)
    assert torch.equal(ours, eager)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_greedy_tokens_equal_eager_up_to_near_ties(device):
    """Prefill + 12 decode steps, batch 2, bf16, 4 seeds of ``greedy_config``: tokens equal
    eager's up to the first step where eager's top-2 logits are within models.NEAR_TIE
    (bf16 rounding alone flips those), and most sequences identical throughout."""
    identical, near_ties = 0, []
    for seed in range(4):
        model = glm5_models.random_model(glm5_models.greedy_config(), torch.bfloat16,
                                         device=device, seed=seed)
        ids, mask = _prompts(seed, device=device)
        model.set_attn_implementation(EAGER)
        eager, margins = _greedy(model, ids, mask, 12, scores=True)
        model.set_attn_implementation(SPARSE)
        ours = _greedy(model, ids, mask, 12)
        for row in range(2):
            diff = (eager[row, PROMPT:] != ours[row, PROMPT:]).nonzero()
            if len(diff):
                step = int(diff[0])
                assert margins[row, step] < models.NEAR_TIE, (seed, row, step)
                near_ties.append((seed, row, step))
            else:
                identical += 1
    print(f"bf16 greedy: {identical} of 8 identical; near-tie departures {near_ties}")
    assert identical > 4

