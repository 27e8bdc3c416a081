"""GLM-5.3's attention calls on a GPU (GPU-only: not in the CPU Bazel target, where it could
only skip; `bash tools/gpu_check.sh` runs it): no host sync in any call."""
import torch

import sparse_mla.integration.transformers  # noqa: F401  (registers "sparse_mla")
from sparse_mla.integration.transformers import glm5_models, op_route
from sparse_mla.integration.transformers.attention import sparse_mla_attention_forward
from sparse_mla.tests.helpers import requires_cuda
from sparse_mla.tests.integration.transformers.test_glm5 import _greedy, _prompts, _record


@requires_cuda
def test_no_host_sync_in_any_call_on_cuda():
    """Every bf16 DSA call of a prefill and decode steps, first calls (the op plans) and kept
    routes alike, runs without a host synchronization."""
    model = glm5_models.random_model(glm5_models.tiny_config(), torch.bfloat16, device="cuda",
                                     seed=2)
    ids, mask = _prompts(2, device="cuda")
    calls = _record(model, lambda: _greedy(model, ids, mask, new_tokens=2))

    def run(c):
        return sparse_mla_attention_forward(c.module, c.query, c.key, c.value, c.mask,
                                            **c.kwargs)
    with torch.no_grad():
        for c in calls:
            run(c)                               # Triton compiles
        torch.cuda.synchronize()
        op_route.forget()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for c in calls + calls:
                run(c)
        finally:
            torch.cuda.set_sync_debug_mode(0)
