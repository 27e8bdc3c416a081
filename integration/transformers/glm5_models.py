"""Random-weight GLM-5.3 (``glm5_next``) models for tests, through transformers' own classes.

HF's ``_init_weights`` zeroes the indexer's pool position bias (``index_kpool_compress_ape``)
and sets its gate to ones, so every pool would weigh its tokens alike; ``random_model``
fills both with random values so the pooling is exercised.
"""
from __future__ import annotations

import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

DSA = "deepseek_sparse_attention"


def tiny_config(**text_overrides) -> Glm5NextConfig:
    """GLM-5.3's attention dimensions (qk_nope = v_head = 256, NoPE) on a tiny model: a KDA
    layer, then DSA layers whose indexers run (full), reuse the previous top-k (shared) and
    run again; kpool 4 with top-8 (two pools) and the tail. Every token uses all 4 experts
    (a top-k router flips on bf16 rounding noise; see models.tiny_config). The vision tower is
    one small block: text-only inputs never run it."""
    text = dict(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=32, qk_rope_head_dim=0, qk_nope_head_dim=256, v_head_dim=256,
        n_routed_experts=4, num_experts_per_tok=4,
        layer_types=["linear_attention", DSA, DSA, DSA],
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        index_topk=8, index_head_dim=32, index_n_heads=8, index_kpool=4,
        linear_head_dim=16, linear_num_heads=2, hc_mult=2, hc_sinkhorn_iters=3,
        initializer_range=0.1, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    text.update(text_overrides)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32,
                  out_hidden_size=text["hidden_size"], projection_intermediate_size=32)
    return Glm5NextConfig(text_config=text, vision_config=vision)


def greedy_config(**text_overrides) -> Glm5NextConfig:
    """``tiny_config`` whose indexer keeps every pool of these runs (top-64 >= 50 tokens):
    for bf16 comparisons with eager, where a top-2 pool pick flips on the rounding of the
    layers below (in eager too), which would test HF's indexer, not attention."""
    kw = dict(index_topk=64)
    kw.update(text_overrides)
    return tiny_config(**kw)


def real_dims_config(**text_overrides) -> Glm5NextConfig:
    """GLM-5.3's attention dimensions at full width (64 heads of 256, kv_lora 512, the
    indexer's 32 heads x 128 with top-2048 over pools of 4) on ``tiny_config``'s four layers
    and a small model (hidden 1024): the GPU test's model."""
    kw = dict(hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256,
              num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512,
              q_lora_rank=512, index_topk=2048, index_head_dim=128, index_n_heads=32,
              linear_head_dim=128, linear_num_heads=8, initializer_range=0.02,
              max_position_embeddings=4096)
    kw.update(text_overrides)
    return tiny_config(**kw)


def random_model(config, dtype=torch.bfloat16, device="cpu", seed=0,
                 attn_implementation="eager") -> Glm5NextForConditionalGeneration:
    """``config``'s model with random weights (the indexer's pool bias and gate included),
    in eval mode on ``device``."""
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration._from_config(
        config, attn_implementation=attn_implementation, dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("index_kpool_compress_ape", "index_kpool_compress_gate")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.to(device).eval()


def text_only(implementation: str) -> dict:
    """``attn_implementation`` giving the text model ``implementation`` (the vision tower
    stays eager: sparse_mla serves the DSA layers only)."""
    return {"text_config": implementation, "vision_config": "eager"}
