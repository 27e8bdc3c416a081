"""The main job's model section: a small random-weight DeepSeek-V4 generates greedily with
eager attention and with ``attn_implementation="sparse_mla"``, and both times per token.

Model on CPU: ``models.greedy_config`` (head_dim 512; sliding, CSA and HCA layers, seed 3,
prompts of 30 and 21 tokens); on a GPU ``models.real_dims_config`` (the same layer types at
real attention dimensions, prompts of 256 and 192 tokens). bf16, batch 2, prefill + 20
decode steps. Passes when the tokens are the same, or first differ where eager's own top-2
logits are within bf16 rounding of each other (a random model has such near-ties; there
eager bf16 itself departs from its fp32 weights' tokens, so no bf16 implementation can be
held to eager's choice).
"""
from __future__ import annotations

import time

import torch

from sparse_mla.integration.transformers import models, registration

NEW_TOKENS = 20
# (config, seed, prompt length, padding of row 1) per device kind
CASES = {"cpu": (models.greedy_config, 3, 30, 9), "cuda": (models.real_dims_config, 0, 256, 64)}


def _generate(model, ids, mask, device, impl):
    model.set_attn_implementation(impl)
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = models.greedy(model, ids, mask, new_tokens=NEW_TOKENS)
    if device != "cpu":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run(device: str) -> bool:
    """Prints the section; True when both implementations generate the same tokens, or
    differ first where eager's own top-2 logits are within bf16 rounding (a near-tie)."""
    registration.register()
    config, seed, prompt, pad = CASES["cpu" if device == "cpu" else "cuda"]
    model = models.random_model(config(), torch.bfloat16, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (2, prompt), generator=g)
    mask = torch.ones(2, prompt, dtype=torch.long)
    ids[1, :pad], mask[1, :pad] = model.config.pad_token_id, 0
    ids, mask = ids.to(device), mask.to(device)
    print(f"\nmodel: random DeepSeek-V4, {model.config.layer_types}, "
          f"{model.config.num_attention_heads} heads x {model.config.head_dim}, bf16, batch 2 "
          f"(prompts {prompt} and {prompt - pad} tokens), greedy {NEW_TOKENS} tokens, "
          f"transformers {registration.installed_version()}", flush=True)
    eager, ours, divergences = models.compare_greedy(model, ids, mask, NEW_TOKENS)  # + warm-up
    for impl in ("eager", "sparse_mla"):
        _, t = _generate(model, ids, mask, device, impl)
        print(f"  {impl:<10}  {t / NEW_TOKENS * 1e3:8.2f} ms/token (prefill included)")
    print(f"  same greedy tokens: {torch.equal(eager, ours)}")
    ok = True
    for row, step, margin in divergences:
        near_tie = margin < models.NEAR_TIE
        ok &= near_tie
        print(f"  row {row} first differs at step {step}, where eager's top-2 logits are "
              f"{margin:.4f} apart: " + ("a near-tie bf16 rounding can flip" if near_tie
                                          else "NOT a near-tie: a real difference"))
    return ok
