"""sparse_mla attention under torch.compile with inductor on a GPU (GPU-only: not in the CPU
Bazel target, where it could only skip; `bash tools/gpu_check.sh` runs it). The CUDA
parametrizations of test_compile.py run aot_eager; the indexer's compiled test
(test_indexer.py) lowers its graph with inductor too."""
import torch

from sparse_mla.integration.transformers import models
from sparse_mla.integration.transformers.attention import sparse_mla_attention_forward
from sparse_mla.tests.helpers import requires_cuda
from sparse_mla.tests.integration.transformers.recording import record
from sparse_mla.tests.integration.transformers.test_compile import _ids, _model


@requires_cuda
def test_attention_function_compiles_with_inductor_on_cuda():
    """What a user's ``torch.compile(model)`` does on a GPU: the attention function lowered
    by inductor (its lists' int8 -> bool view failed there once), the result the uncompiled
    function's."""
    model = _model("cuda")
    ids = _ids(model, "cuda")
    calls = record(model, lambda: models.greedy(model, ids, new_tokens=2))
    torch._dynamo.reset()
    compiled = torch.compile(sparse_mla_attention_forward, fullgraph=True, backend="inductor",
                             dynamic=True)
    for c in calls[:len(calls) // 2 + 1]:     # the prefill's layers and a decode step's
        with torch.no_grad():
            want = sparse_mla_attention_forward(c.module, c.query, c.key, c.value, c.mask,
                                                **c.kwargs)[0]
            got = compiled(c.module, c.query, c.key, c.value, c.mask, **c.kwargs)[0]
        assert torch.equal(got, want)
