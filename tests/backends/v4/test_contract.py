"""One backend contract: every backend, DeepSeek-V4's and DeepSeek-V3.2's, takes the same
parameters in validate / write / attend / forward / plan / explain (the base class's), and
refuses what its model does not have by naming it."""
from __future__ import annotations

import inspect

import pytest
import torch

from sparse_mla.backends.v4 import LayerKind
from sparse_mla.backends.common.base import Backend
from sparse_mla.backends.v4 import FlashMLABackend
from sparse_mla.backends.v4 import TrtllmBackend
from sparse_mla.backends.v32 import V32FlashMLABackend, V32TrtllmBackend
from sparse_mla.tests.backends.cases import Harness, config

BACKENDS = (FlashMLABackend, TrtllmBackend, V32FlashMLABackend, V32TrtllmBackend)
CONTRACT = ("validate", "write", "attend", "forward", "plan", "explain")


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", CONTRACT)
def test_same_signature_as_the_base(cls, method):
    assert inspect.signature(getattr(cls, method)) == inspect.signature(
        getattr(Backend, method)), f"{cls.__name__}.{method} left the contract"


def test_v4_refuses_a_step_without_its_model_inputs():
    h = Harness("flashmla", config(LayerKind.C4A, max_num_tokens=64), "cpu", seed=6)
    st = h.sim.step([], [(0, 20)])
    out = torch.zeros(st.q.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cos_sin_cache is required"):
        h.backend.forward(st.q, st.kv, h.caches, st.batch, None, h.sink, out, st.compressed_kv)
    with pytest.raises(ValueError, match=r"attn_sink is required: .* float32 \[8\]"):
        h.backend.forward(st.q, st.kv, h.caches, st.batch, h.cos_sin, None, out,
                          st.compressed_kv)
    with pytest.raises(TypeError, match="out is required"):
        h.backend.forward(st.q, st.kv, h.caches, st.batch, h.cos_sin, h.sink,
                          compressed_kv=st.compressed_kv)
    h.check_untouched()


def test_a_planner_of_another_model_is_refused():
    from sparse_mla.tests.backends.v32.cases import config as v32_config
    v4 = FlashMLABackend(config(LayerKind.C4A))
    with pytest.raises(ValueError, match="cannot be shared"):
        V32TrtllmBackend(v32_config(), planner=v4.planner)
    with pytest.raises(TypeError, match="config must be a LayerConfig"):
        FlashMLABackend(v32_config())
