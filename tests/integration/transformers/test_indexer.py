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


# ---------------------------------------------------------------------------------------------
# the hook (integration/transformers/indexer.py)

def _module_run(indexer, config, impl_name, hidden, q_res, pos):
    config._attn_implementation = impl_name
    with torch.no_grad():
        return indexer(hidden, q_res, pos, None, 0)


@pytest.mark.parametrize("seed,length,topk", [(3, 57, 4), (4, 7, 8)])
def test_hooked_indexer_selects_what_eager_selects(seed, length, topk):
    """The same module under "sparse_mla" (the op) and "eager" (HF's code): the same
    selected sets per token (HF's order among equal scores is its own), batch of 2 rows."""
    import sparse_mla.integration.transformers  # noqa: F401  (installs the hook)
    from sparse_mla.ops.common.dispatch import last_choice
    config, indexer = _hf_indexer(seed, topk)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, length, config.hidden_size, generator=g).to(torch.bfloat16)
    q_res = torch.randn(2, length, config.q_lora_rank, generator=g).to(torch.bfloat16)
    pos = torch.arange(length).unsqueeze(0)
    eager = _module_run(indexer, config, "eager", hidden, q_res, pos)
    before = last_choice("indexer_topk_prefill")
    ours = _module_run(indexer, config, "sparse_mla", hidden, q_res, pos)
    assert last_choice("indexer_topk_prefill") is not before, "the op did not run"
    assert ours.shape == eager.shape and ours.dtype == eager.dtype
    for b in range(2):
        for t in range(length):
            assert sorted(x for x in ours[b, t].tolist() if x >= 0) == \
                sorted(x for x in eager[b, t].tolist() if x >= 0), (b, t)


def test_hook_leaves_models_it_cannot_serve_to_hf():
    """An index_head_dim the op does not take (the tiny config's 64): HF's own forward runs
    under "sparse_mla" too, with its own result."""
    import sparse_mla.integration.transformers  # noqa: F401
    config = models.tiny_config(index_topk=4)
    torch.manual_seed(0)
    indexer = dsv4.DeepseekV4Indexer(config).to(torch.bfloat16).eval()
    for p in indexer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 33, config.hidden_size, generator=g).to(torch.bfloat16)
    q_res = torch.randn(1, 33, config.q_lora_rank, generator=g).to(torch.bfloat16)
    pos = torch.arange(33).unsqueeze(0)
    eager = _module_run(indexer, config, "eager", hidden, q_res, pos)
    ours = _module_run(indexer, config, "sparse_mla", hidden, q_res, pos)
    assert torch.equal(ours, eager)


def test_bf16_greedy_tokens_with_the_hooked_indexer():
    """A tiny bf16 model at index_head_dim 128 whose indexer keeps every entry (top-16, as
    models.greedy_config): the op runs in every CSA layer and the greedy tokens equal eager's
    up to near-ties (test_attention's criterion)."""
    from sparse_mla.ops.common.dispatch import last_choice
    model = models.random_model(models.greedy_config(index_head_dim=128), torch.bfloat16,
                                seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    before = last_choice("indexer_topk_prefill")
    eager, ours, divergences = models.compare_greedy(model, ids, mask)
    assert last_choice("indexer_topk_prefill") is not before, "the op did not run"
    assert ours.shape == eager.shape
    for row, step, margin in divergences:
        assert margin < models.NEAR_TIE, (row, step, margin)


def test_later_calls_of_a_kind_skip_the_op_wrapper(monkeypatch):
    """The hook's kept choice (integration/transformers/indexer.py): the first call of a kind
    runs the op (wrapper, validation, dispatch), later ones of that kind, whose entry count
    changes as a decode step's does, run the kept implementation directly and select what the
    op selects. With value checks on (always on the CPU; here switched off so that the kept
    path runs) every call would run the op."""
    from sparse_mla.integration.transformers import indexer as hook
    config, indexer = _hf_indexer(5, 8)
    monkeypatch.setattr(hook.checks, "value_checks_enabled", lambda *t: False)
    hook.forget()
    wrapper_calls = []
    real = hook.indexer_topk_prefill

    def counting(*a, **k):
        wrapper_calls.append(a[2].shape[0] // b)   # the call's entry count
        return real(*a, **k)
    monkeypatch.setattr(hook, "indexer_topk_prefill", counting)
    g = torch.Generator().manual_seed(5)
    b, s, h = 2, 3, config.index_n_heads
    q = torch.randn(b, s, h, 128, generator=g).to(torch.bfloat16)
    hidden = torch.randn(b, s, config.hidden_size, generator=g).to(torch.bfloat16)
    pos = torch.arange(60, 60 + s).unsqueeze(0)
    with torch.no_grad():
        for t in (11, 5, 14, 9):
            keys = torch.randn(b, t, 128, generator=g).to(torch.bfloat16)
            got = hook.select(indexer, q, keys, hidden, pos)
            want = torch.empty(b * s, min(8, t), dtype=torch.int32)
            w = indexer.scorer.weights_proj(hidden).float() * indexer.scorer.weights_scaling \
                * indexer.scorer.softmax_scale
            real(q.reshape(b * s, h, 128), w.reshape(b * s, h), keys.reshape(b * t, 128), None,
                 torch.tensor([0, s, 2 * s]), torch.tensor([0, t, 2 * t]),
                 pos.expand(b, s).reshape(-1), want, indexer.compress_rate, 0, t)
            assert torch.equal(got, want.view(b, s, -1).long()), t
            assert (got >= 0).any()
    # the test's own reference calls go through the real op, not the counted name
    assert wrapper_calls == [11], "the op's wrapper runs on the first call of the kind only"
    hook.forget()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_compiled_indexer_selects_with_the_op(device, monkeypatch):
    """Under torch.compile (fullgraph) the hooked forward traces, the op as one custom op
    whose 0 / 1 scores HF's own mask and top-k turn into the op's picks: exactly the sets
    the op picked on the graph's inputs. Against the uncompiled hook: the same sets on the
    CPU (no inductor: the same inputs; HF's eager sets too). CUDA is lowered by inductor,
    whose fused bf16 math (compressor, RoPE, weights) rounds the op's inputs its own way:
    those stay within bf16 rounding of the uncompiled ones, and a row may then differ only
    by swaps among the uncompiled scores' near-ties (seen on the H200: one row in 114)."""
    import sparse_mla.integration.transformers  # noqa: F401  (installs the hook)
    from sparse_mla.integration.transformers import indexer as hook
    config, indexer = _hf_indexer(3, 4)
    indexer = indexer.to(device)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 57, config.hidden_size, generator=g).to(torch.bfloat16).to(device)
    q_res = torch.randn(2, 57, config.q_lora_rank, generator=g).to(torch.bfloat16).to(device)
    pos = torch.arange(57, device=device).unsqueeze(0)
    calls = []
    real = hook._picks

    def recording_picks(q, keys, weights, *rest):
        calls.append((q, keys, weights, real(q, keys, weights, *rest)))
        return calls[-1][-1]
    monkeypatch.setattr(hook, "_picks", recording_picks)
    eager = _module_run(indexer, config, "eager", hidden, q_res, pos)
    hooked = _module_run(indexer, config, "sparse_mla", hidden, q_res, pos)
    targets = set()

    def recording(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward if device == "cpu" else torch._inductor.compile(gm, example_inputs)
    torch._dynamo.reset()
    config._attn_implementation = "sparse_mla"
    with torch.no_grad():
        got = torch.compile(indexer, fullgraph=True, backend=recording)(hidden, q_res, pos,
                                                                       None, 0)
    assert {t for t in targets if "sparse_mla_hf" in t} == \
        {"sparse_mla_hf.indexer_pick_scores.default"}, targets
    assert len(calls) == 2, "the op ran once uncompiled and once in the graph"
    assert got.shape == eager.shape and got.dtype == eager.dtype
    assert (got >= 0).any()
    picked = lambda rows, b, t: sorted(x for x in rows[b, t].tolist() if x >= 0)  # noqa: E731
    graph_picks = calls[1][3].view(2, 57, -1)
    (q0, k0, w0, _), (q1, k1, w1, _) = calls
    swaps = 0
    for b in range(2):
        for t in range(57):
            assert picked(got, b, t) == picked(graph_picks, b, t), (b, t)
            if device == "cpu":
                assert picked(got, b, t) == picked(hooked, b, t) == picked(eager, b, t), (b, t)
                continue
            mine, theirs = set(picked(got, b, t)), set(picked(hooked, b, t))
            if mine == theirs:
                continue
            swaps += 1
            s = cases.scores(q0[b, t], w0[b, t], k0[b].double())
            threshold = min(float(s[j]) for j in theirs)
            for j in mine ^ theirs:
                assert abs(float(s[j]) - threshold) <= 1e-2 * float(s.abs().max()), \
                    (b, t, j, float(s[j]), threshold)
    if device == "cuda":
        for x, y in ((q0, q1), (k0, k1), (w0, w1)):
            torch.testing.assert_close(y.float(), x.float(), rtol=2 ** -7, atol=1e-2)
        assert swaps <= 3, swaps


def test_traced_scorer_keeps_hf_scores_for_one_query_per_row():
    """The scorer a compiled graph gets: HF's own scores at one query per row (a decode
    step: a small fused kernel in the graph), the op's 0 / 1 picks over prefill rows (1 at
    exactly the op's picks)."""
    from sparse_mla.integration.transformers import indexer as hook
    config, indexer = _hf_indexer(6, 4)
    g = torch.Generator().manual_seed(6)
    b, s, h, t = 2, 5, config.index_n_heads, 12
    q = torch.randn(b, s, h, 128, generator=g).to(torch.bfloat16)
    keys = torch.randn(b, t, 128, generator=g).to(torch.bfloat16)
    hidden = torch.randn(b, s, config.hidden_size, generator=g).to(torch.bfloat16)
    pos = torch.arange(40, 40 + s).unsqueeze(0)
    with torch.no_grad():
        one = hook._Scoring(indexer, pos[:, :1]).scorer(q[:, :1], keys, hidden[:, :1])
        assert torch.equal(one, indexer.scorer(q[:, :1], keys, hidden[:, :1]))
        rows = hook._Scoring(indexer, pos).scorer(q, keys, hidden)
        picks = hook.select(indexer, q, keys, hidden, pos)
    assert rows.shape == (b, s, t) and set(rows.unique().tolist()) == {0.0, 1.0}
    for i in range(b):
        for j in range(s):
            assert set(rows[i, j].nonzero().view(-1).tolist()) == \
                {x for x in picks[i, j].tolist() if x >= 0}, (i, j)
