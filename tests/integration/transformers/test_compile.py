"""sparse_mla attention under torch.compile: the attention function traces as one graph (its
index lists and op as custom ops through their fake implementations, no host reads), and
``model.generate`` with a compiled ``model.forward`` (HF's DeepSeek-V4 cannot compile generate
itself: no static cache) gives the tokens of the uncompiled model. aot_eager on CPU (no C++
toolchain needed); inductor on CUDA: test_compile_cuda.py (and tools/bench_hf.py --compile)."""
import pytest
import torch

import sparse_mla.integration.transformers  # noqa: F401  (registers "sparse_mla")
from sparse_mla.integration.transformers import indexer as indexer_hook
from sparse_mla.integration.transformers import models, op_route
from sparse_mla.integration.transformers.attention import sparse_mla_attention_forward
from sparse_mla.tests.helpers import CUDA
from sparse_mla.tests.integration.transformers.recording import record

DEVICES = ["cpu"] + ([pytest.param("cuda", id="cuda")] if CUDA else [])


def _model(device, dtype=torch.bfloat16):
    # index_head_dim 128: the indexer hook takes part (its prefill op in the graph)
    return models.random_model(models.greedy_config(index_head_dim=128), dtype, device=device,
                               seed=7)


def _ids(model, device, length=16):
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, model.config.vocab_size, (1, length), generator=g).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("device", DEVICES)
def test_attention_function_compiles_as_one_graph(device, dtype):
    """One graph whose sparse_mla nodes are custom ops: the bf16 call whole, the fp32 path's
    index lists (each runs its eager code when the graph runs)."""
    model = _model(device, dtype)
    ids = _ids(model, device)
    calls = record(model, lambda: models.greedy(model, ids, new_tokens=2))
    torch._dynamo.reset()
    targets = set()

    def backend(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    compiled = torch.compile(sparse_mla_attention_forward, fullgraph=True, backend=backend)
    for c in calls[:len(calls) // 2 + 1]:     # the prefill's layers and a decode step's
        with torch.no_grad():
            want = sparse_mla_attention_forward(c.module, c.query, c.key, c.value, c.mask,
                                                **c.kwargs)[0]
            got = compiled(c.module, c.query, c.key, c.value, c.mask, **c.kwargs)[0]
        assert torch.equal(got, want)
    ours = {t for t in targets if "sparse_mla_hf" in t}
    assert ours == ({"sparse_mla_hf.attend.default"} if dtype == torch.bfloat16
                    else {"sparse_mla_hf.index_lists.default"}), targets
    # the lists are built inside the op, not traced into the graph
    assert not any("cumsum" in t or "triton" in t for t in targets), targets


@pytest.mark.parametrize("device", DEVICES)
def test_generate_with_compiled_forward_gives_the_same_tokens(device):
    model = _model(device)
    ids = _ids(model, device)
    model.set_attn_implementation("sparse_mla")
    want = models.greedy(model, ids, new_tokens=3)
    torch._dynamo.reset()
    op_route.forget()
    indexer_hook.forget()
    forward = model.forward
    model.forward = torch.compile(forward, backend="aot_eager", dynamic=True)
    try:
        got = models.greedy(model, ids, new_tokens=3)
    finally:
        model.forward = forward
    assert torch.equal(got, want)
    # the graph's sparse_mla_hf::attend kept plans as it ran (the op planned once per kind), and
    # its indexer_pick_scores ran the indexer op in the prefill
    assert op_route._PLANS
    assert indexer_hook._ROUTES
