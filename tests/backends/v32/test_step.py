"""One DeepSeek-V3.2 attention step of a whole batch, each V3.2 backend against the dense step
oracle: mixed decode / prefill batches, MTP decodes, chunked prefills with context, graph
padding, head counts — on poisoned caches that must stay untouched outside the step's slots."""
from __future__ import annotations

import pytest
import torch

from sparse_mla.tests.backends import cases as v4_cases
from sparse_mla.tests.backends.v32.cases import LAYOUTS, Harness, config
from sparse_mla.tests.helpers import CUDA

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])

# (1) two prefills from position 0; (2) an MTP decode, a second chunk of a prefill with
# context and a new prefill, graph padding after; (3) MTP decodes of 1-3 tokens, padding.
SCRIPT = (
    dict(decodes=[], prefills=[(0, 150), (1, 90)]),
    dict(decodes=[(0, 2)], prefills=[(1, 60), (2, 100)], pad_tokens=3),
    dict(decodes=[(0, 1), (1, 3), (2, 1)], prefills=[], pad_tokens=2),
)


def run_script(h: Harness, script=SCRIPT):
    return v4_cases.run_script(h, script, padding_zero=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_steps_match_oracle(device, layout):
    run_script(Harness(layout, config(), device, seed=len(layout)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", (1, 8, 16, 64, 128))
def test_head_counts(device, layout, heads):
    script = (dict(decodes=[], prefills=[(0, 100)]),
              dict(decodes=[(0, 2)], prefills=[(1, 40)], pad_tokens=1))
    run_script(Harness(layout, config(heads=heads), device, seed=heads), script)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_chunks_split_by_workspace(device):
    """A workspace of 190 rows: requests of seq_len 120, 100, 90 gather their whole context,
    so they run as three chunks (two take 2 * their longer seq_len: 240, 200), same answer
    as the oracle."""
    h = Harness("flashmla_fp8_separate", config(prefill_workspace_rows=190), device, seed=3)
    st = h.sim.step([], [(0, 120), (1, 100), (2, 90)])
    chunks = h.backend.planner.prefill_chunks(st.batch)
    assert [(c.r0, c.r1, c.M) for c in chunks] == [(0, 1, 120), (1, 2, 100), (2, 3, 90)]
    h.check(h.run(st), st)
    wide = Harness("flashmla_fp8_separate", config(), device, seed=3)
    st = wide.sim.step([], [(0, 120), (1, 100), (2, 90)])
    assert [(c.r0, c.r1, c.M) for c in wide.backend.planner.prefill_chunks(st.batch)] == [
        (0, 3, 120)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_decode_requests(device, layout):
    """A decode batch padded with empty requests and padding tokens (a CUDA-graph batch)."""
    h = Harness(layout, config(), device, seed=5)
    h.step([], [(0, 70), (1, 30)])
    out, st = h.step([(0, 2), (1, 2)], [], pad_tokens=4, pad_reqs=2)
    h.check(out, st, "padded decode")
    assert torch.count_nonzero(out[4:]) == 0


@pytest.mark.parametrize("heads,mode", [(8, "mixed"), (16, "mixed"), (31, "mixed"),
                                        (32, "separate"), (128, "separate")])
def test_fp8_mode_follows_vllm_head_threshold(heads, mode):
    h = Harness("flashmla_fp8_separate", config(heads=heads), "cpu", fp8_mode="auto")
    assert h.backend.mode == mode


def test_explain_names_the_ops_of_each_mode():
    expect = {
        "flashmla_fp8_separate": {"quantize_insert_v32", "convert_req_index_to_global",
                                  "flashmla_sparse_decode", "gather_dequant",
                                  "flashmla_sparse_prefill"},
        "flashmla_fp8_mixed": {"quantize_insert_v32", "convert_req_index_to_global",
                               "flashmla_sparse_decode"},
        "flashmla_bf16": {"insert_plain", "convert_req_index_to_global",
                          "flashmla_sparse_prefill"},
        "trtllm_bf16": {"insert_plain", "convert_req_index_to_global", "trtllm_decode_v32"},
    }
    for layout, ops in expect.items():
        h = Harness(layout, config(), "cpu")
        h.step([], [(0, 20)])
        h.step([(0, 1)], [(1, 10)])
        ran = {op: c.impl for op, c in h.backend.explain().items()}
        assert set(ran) == ops, layout
        assert set(ran.values()) == {"reference"}


def test_check_catches_a_wrong_key():
    """The bound is tight enough: an oracle that drops each token's last selected key is
    rejected (so a backend that lost one key would be)."""
    import dataclasses
    from sparse_mla.tests.backends.cases import check_rows
    from sparse_mla.tests.backends.v32 import sim
    h = Harness("flashmla_bf16", config(), "cpu", seed=9)
    st = h.sim.step([], [(0, 120)])
    out = h.run(st)
    h.check(out, st)
    r = h.sim.requests[0]
    alt = torch.zeros_like(st.expected)
    for t in range(st.batch.num_tokens):
        sel = [int(i) for i in st.batch.topk_indices[t].cpu() if i >= 0]
        if len(sel) > 1:
            sel = sel[:-1]
        alt[t] = sim.attend(st.q[t].cpu().double(), torch.stack([r.rows[i] for i in sel]),
                            h.cfg.softmax_scale)
    with pytest.raises(AssertionError, match="relative L2 error"):
        check_rows(out, alt)
    assert dataclasses.is_dataclass(st)


@pytest.mark.parametrize("device", DEVICES)
def test_layers_share_one_step_plan(device):
    """Two V3.2 layers (FlashMLA fp8 and FlashInfer bf16) share a planner: planned once per
    step, each layer converts the top-k itself and matches the oracle."""
    cfg = config()
    first = Harness("flashmla_fp8_separate", cfg, device, seed=4)
    second = Harness("trtllm_bf16", cfg, device, seed=4, planner=first.backend.planner)
    for kw in SCRIPT:
        a, b = first.sim.step(**kw), second.sim.step(**kw)
        first.backend.plan(a.batch, a.q.shape[0])
        first.check(first.run(a, planned=True), a, "first layer")
        second.check(second.run(b, batch=a.batch, planned=True), b, "second layer")
    with pytest.raises(ValueError, match="cannot be shared"):
        Harness("flashmla_bf16", config(block_size=32), device, planner=first.backend.planner)


def test_write_then_attend_equals_forward():
    """The step in two pieces (an engine that splits it) gives forward's answer."""
    whole, split = (Harness("flashmla_fp8_separate", config(), "cpu", seed=8) for _ in range(2))
    for kw in SCRIPT:
        a, b = whole.sim.step(**kw), split.sim.step(**kw)
        out = whole.run(a)
        got = torch.full_like(out, float("nan"))
        q = split.backend.write(b.q, b.kv, split.caches, b.batch)
        assert q is b.q                       # V3.2's q arrives rotated: attend takes it as is
        split.backend.attend(q, split.caches, b.batch, out=got)
        split.written.update(b.slots)
        assert torch.equal(got, out)
        split.check(got, b)
