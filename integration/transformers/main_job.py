"""The main job's model section: a small random-weight DeepSeek-V4 generates greedily with
eager attention and with ``attn_implementation="sparse_mla"``; same tokens required.

Model on CPU: ``models.tiny_config`` (head_dim 512; sliding, CSA and HCA layers); on a GPU
``models.real_dims_config`` (the same layer types at real attention dimensions, 256-token
prompts). bf16, batch 2 with unequal prompt lengths, prefill + 20 decode steps. CPU seed 3: a case whose greedy choices are
all decidable in bf16 (each top-1 logit leads by more than bf16 noise in the fp32 model; most
seeds of a random tiny model have a near-tie somewhere, where eager bf16 itself departs from
its fp32 tokens: tests/integration/transformers/test_attention.py).
"""
from __future__ import annotations

import time

import torch

from sparse_mla.integration.transformers import models, registration

NEW_TOKENS = 20
# (config, seed, prompt length, padding of row 1) per device kind
CASES = {"cpu": (models.tiny_config, 3, 30, 9), "cuda": (models.real_dims_config, 0, 256, 64)}


def _generate(model, ids, mask, device):
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = models.greedy(model, ids, mask, new_tokens=NEW_TOKENS)
    if device != "cpu":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run(device: str) -> bool:
    """Prints the section; True when both implementations generate the same tokens."""
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
    tokens, rows = {}, []
    for impl in ("eager", "sparse_mla"):
        model.set_attn_implementation(impl)
        models.greedy(model, ids, mask, new_tokens=2)                     # warm-up
        tokens[impl], t = _generate(model, ids, mask, device)
        rows.append((impl, t))
    for impl, t in rows:
        print(f"  {impl:<10}  {t / NEW_TOKENS * 1e3:8.2f} ms/token (prefill included)")
    same = torch.equal(tokens["eager"], tokens["sparse_mla"])
    print(f"  same greedy tokens: {same}")
    return same
