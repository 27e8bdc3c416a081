"""The Triton route of GLM-5.3's attention call (one query head per packed row) on CPU through
the interpreter (the transformers_glm5_interpret_test target)."""
import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as glm

import sparse_mla.integration.transformers  # noqa: F401  (registers "sparse_mla")
from sparse_mla.integration.transformers import op_route
from sparse_mla.integration.transformers.attention import sparse_mla_attention_forward
from sparse_mla.ops.common.dispatch import ENV_VAR, last_choice
from sparse_mla.tests.helpers import INTERPRETING
from sparse_mla.tests.integration.transformers.test_glm5 import _Layer, _random_call


@pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1 only (the "
                    "transformers_glm5_interpret_test target)")
@pytest.mark.parametrize("dims", [(64, 40), (256, 256)], ids=["qk64-v40", "qk256-v256"])
def test_triton_route_matches_eager(dims, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    op_route.forget()
    dqk, dv = dims
    q, k, v, mask = _random_call(torch.bfloat16, dqk=dqk, dv=dv)
    got, _ = sparse_mla_attention_forward(_Layer(), q, k, v, mask, scaling=dqk ** -0.5)
    assert last_choice("flashmla_sparse_prefill").impl == "triton"
    want, _ = glm.eager_attention_forward(_Layer(), q.float(), k.float(), v.float(),
                                          mask.float(), scaling=dqk ** -0.5)
    empty = (mask[:, 0] != 0).all(-1)
    want[empty] = 0
    err = (got.float() - want).abs()
    assert (err <= want.abs().amax(-1, keepdim=True) * 3 / 128 + 8e-4).all(), err.max()
    assert (got[empty] == 0).all()
