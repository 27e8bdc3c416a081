"""Random-weight DeepSeek-V4 models for tests, the main job and the benchmark.

HF's ``_init_weights`` zeroes the attention sinks, the compressors' position biases and the
hash router's token→expert table; that would leave the sink path and the hash routing
untested, so ``random_model`` fills them with random values too.
"""
from __future__ import annotations

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention",
               "heavily_compressed_attention")


def tiny_config(**overrides) -> DeepseekV4Config:
    """Every layer type at the kernels' head_dim 512 (rope 64), small everywhere else:
    window 12, CSA ratio 4 with top-4 of its entries, HCA ratio 8. 16 indexer heads: with
    few heads ReLU(q·k) ties make top-k pick differently in prefill and decode, even in eager.
    Every token uses all 4 experts: a top-2 router flips on bf16 rounding noise, after which
    eager bf16 and its own fp32 run already generate different tokens (measured), and a
    greedy comparison in bf16 would test the router, not attention.
    """
    kw = dict(
        vocab_size=64, hidden_size=64, num_hidden_layers=3, layer_types=list(LAYER_TYPES),
        mlp_layer_types=["hash_moe", "moe", "moe"], num_attention_heads=4, head_dim=512,
        partial_rotary_factor=64 / 512, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=4,
        n_shared_experts=1, compress_rates={"compressed_sparse_attention": 4,
                                            "heavily_compressed_attention": 8},
        sliding_window=12, index_n_heads=16, index_head_dim=64, index_topk=4, hc_mult=2,
        hc_sinkhorn_iters=3, max_position_embeddings=512, initializer_range=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def greedy_config(**overrides) -> DeepseekV4Config:
    """``tiny_config`` for bf16 greedy comparisons with eager: index_topk 16, more than the
    compressed entries these runs reach (at most 13 at ratio 4 over 50 tokens), so the indexer
    keeps every causal entry and makes no choice that rounding can flip. With top-4, the
    indexer's input (the layers below, whose attention rounds differently in bf16) already
    changes its picks in the prefill for 4 of 6 seeds, and a token then differs where eager's
    top-2 logits are 0.31 apart (torch 2.11 on CPU; lab/tools/diag_greedy.py shows it). That
    tests HF's indexer, not attention, as a top-2 router would (see ``tiny_config``)."""
    kw = dict(index_topk=16)
    kw.update(overrides)
    return tiny_config(**kw)


def bench_config(num_hidden_layers: int = 2, **overrides) -> DeepseekV4Config:
    """Real attention dimensions (64 heads, head_dim 512, window 128, CSA ratio 4 with top-k
    512 and 64 indexer heads, HCA ratio 128) on a small model (hidden 1024): CSA and HCA
    layers alternate."""
    kw = dict(
        vocab_size=4096, hidden_size=1024, num_hidden_layers=num_hidden_layers,
        layer_types=[LAYER_TYPES[1 + i % 2] for i in range(num_hidden_layers)],
        mlp_layer_types=["moe"] * num_hidden_layers, num_attention_heads=64, head_dim=512,
        partial_rotary_factor=64 / 512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        moe_intermediate_size=512, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, compress_rates={"compressed_sparse_attention": 4,
                                            "heavily_compressed_attention": 128},
        sliding_window=128, index_n_heads=64, index_head_dim=128, index_topk=512,
        max_position_embeddings=65536, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def real_dims_config(**overrides) -> DeepseekV4Config:
    """``bench_config``'s real attention dimensions with one layer of each type (sliding,
    CSA, HCA): the model section's and the GPU greedy test's model on a GPU."""
    kw = dict(num_hidden_layers=3, layer_types=list(LAYER_TYPES),
              mlp_layer_types=["moe"] * 3)
    kw.update(overrides)
    return bench_config(**kw)


def random_model(config, dtype=torch.bfloat16, device="cpu", seed=0,
                 attn_implementation="eager") -> DeepseekV4ForCausalLM:
    """``config``'s model with random weights (sinks, position biases and the hash table
    included), in eval mode on ``device``."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM._from_config(config, attn_implementation=attn_implementation,
                                               dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.randint(0, config.n_routed_experts, buf.shape, generator=gen))
    return model.to(device).eval()


def greedy(model, input_ids, attention_mask=None, new_tokens=20, streamer=None):
    """Greedy ``generate``: prompt + ``new_tokens`` tokens (no early stop at eos);
    ``streamer``: HF's streamer hook, given the prompt, then each token as it is made."""
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=model.config.pad_token_id, streamer=streamer)


# Largest top-1 minus top-2 logit gap that bf16 rounding can flip in these models. Eager
# bf16's and sparse_mla's logits each differ from the same weights' fp32 logits by up to
# about half of it (tiny model; test_bf16_forward_logits... prints it), so from each other
# by up to about all of it: a smaller gap can come out either way. Half of it was tried
# first and a GPU run flipped a gap between the two (lab/perf-log.md, "HF transformers:
# first measurements (superseded)").
NEAR_TIE = 0.1


def greedy_with_margins(model, input_ids, attention_mask=None, new_tokens=20):
    """Greedy tokens and, per generated step and row, the top-1 minus top-2 logit gap."""
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=model.config.pad_token_id, output_scores=True,
                             return_dict_in_generate=True)
    top2 = torch.stack(out.scores, 1).float().topk(2, dim=-1).values      # [B, steps, 2]
    return out.sequences, top2[..., 0] - top2[..., 1]


def compare_greedy(model, input_ids, attention_mask=None, new_tokens=20):
    """Greedy generation with eager and with sparse_mla attention (the model is left on
    sparse_mla). Returns ``(eager, ours, divergences)``: per row whose tokens differ,
    ``(row, step, eager's margin at that step)`` of the first differing token. Up to that
    step both saw the same tokens, so a divergence is explained by rounding only where
    eager's own margin there is below ``NEAR_TIE``."""
    model.set_attn_implementation("eager")
    eager, margins = greedy_with_margins(model, input_ids, attention_mask, new_tokens)
    model.set_attn_implementation("sparse_mla")
    ours, _ = greedy_with_margins(model, input_ids, attention_mask, new_tokens)
    prompt = input_ids.shape[1]
    divergences = []
    for row in range(eager.shape[0]):
        diff = (eager[row, prompt:] != ours[row, prompt:]).nonzero()
        if len(diff):
            step = int(diff[0])
            divergences.append((row, step, float(margins[row, step])))
    return eager, ours, divergences
