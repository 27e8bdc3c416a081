"""The indexer op against HF transformers' own DeepSeek-V4 indexer (``DeepseekV4Indexer``:
its compressor, RoPE, ``DeepseekV4IndexerScorer`` and top-k) on a tiny random config at the
real index_head_dim 128: the scorer's inputs are recorded, the model's scales folded into the
weights as docs/semantics.md §11.2 says, and the op's top-k must select what HF's does (up
to swaps among scores that tie within rounding; HF orders equal scores arbitrarily)."""
import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

from sparse_mla.integration.transformers import models
from sparse_mla.ops.indexer import lightning_indexer_prefill
from sparse_mla.tests.helpers import CUDA
from sparse_mla.tests.ops.indexer import cases

ROUTES = [("reference", "cpu")] + ([("triton", "cuda")] if CUDA else [])


def _hf_indexer(seed, topk):
    config = models.tiny_config(index_head_dim=128, index_n_heads=16, index_topk=topk)
    torch.manual_seed(seed)
    indexer = dsv4.DeepseekV4Indexer(config)
    for p in indexer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return config, indexer.to(torch.bfloat16).eval()


@pytest.mark.parametrize("impl,device", ROUTES)
@pytest.mark.parametrize("seed,length,topk", [(0, 50, 4), (1, 61, 8), (2, 9, 8)])
def test_selects_what_hf_selects(impl, device, seed, length, topk):
    config, indexer = _hf_indexer(seed, topk)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, length, config.hidden_size, generator=g).to(torch.bfloat16)
    q_res = torch.randn(1, length, config.q_lora_rank, generator=g).to(torch.bfloat16)
    pos = torch.arange(length).unsqueeze(0)
    seen = {}
    hook = indexer.scorer.register_forward_hook(
        lambda mod, args, out: seen.update(args=args, out=out))
    with torch.no_grad():
        hf = indexer(hidden, q_res, pos, None, 0)[0]
        hook.remove()
        q, keys, h = seen["args"]
        scorer = indexer.scorer
        w = scorer.weights_proj(h).float()[0] * scorer.weights_scaling * scorer.softmax_scale
    q, keys = q[0], keys[0]
    assert q.dtype == keys.dtype == torch.bfloat16 and q.shape[-1] == 128
    c = keys.shape[0]
    got = lightning_indexer_prefill(
        q.to(device), w.to(device), keys.to(device), None, torch.tensor([0, length]).to(device),
        torch.tensor([0, c]).to(device), pos[0].to(device), topk=topk,
        ratio=config.compress_rates["compressed_sparse_attention"], impl=impl).cpu()
    want = torch.full((length, topk), -1, dtype=torch.int32)
    if c:
        # HF's rows: the top min(topk, c) with past-the-threshold picks as -1; ours are a
        # left-aligned prefix, so compare its valid ids in HF's (score) order
        valid = [[j for j in row.tolist() if j >= 0] for row in hf]
        want = torch.tensor([v + [-1] * (topk - len(v)) for v in valid], dtype=torch.int32)
    score_rows = [cases.scores(q[t], w[t], keys.double()) for t in range(length)]
    allowed = [torch.arange(c) < (t + 1) // 4 for t in range(length)]
    cases.assert_selection(got, want, score_rows, allowed, 1e-4)
    assert (got >= 0).sum() > 0 or c == 0
