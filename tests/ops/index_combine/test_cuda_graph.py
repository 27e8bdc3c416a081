"""A decode-step index build (SWA window, C4A global top-k, C128A, TRTLLM-gen mixed rows)
captured in a CUDA graph and replayed on a new batch equals eager execution.

The same harness also runs eagerly wherever Triton runs (interpreter included), so the
harness itself is checked on CPU."""
import pytest
import torch

from sparse_mla.ops import index_combine as ic
from sparse_mla.tests.helpers import requires_cuda, triton_params
from sparse_mla.tests.ops.index_combine.batches import make_batch

I32 = torch.int32
W, K, SWA_BS, C_BS, RATIO = 128, 32, 64, 64, 4
SWA_COLS, C_COLS = 64, 16


def _batch(seed):
    b = make_batch(seed, n_decode=8, mtp=1, n_prefill=0, n_tail_pad=3, ratio=RATIO,
                   swa_bs=SWA_BS, comp_bs=C_BS, topk=K, max_ctx=3000, n_invalid_decode=2)
    x = dict(b.t)
    for name, cols in (("swa_bt", SWA_COLS), ("comp_bt", C_COLS)):
        bt = torch.zeros(x[name].shape[0], cols, dtype=I32)
        bt[:, :x[name].shape[1]] = x[name]
        x[name] = bt
    x["slot_mapping"] = x["slot_mapping"].to(I32)
    return b, x


class DecodeStep:
    """Persistent inputs and outputs (stable addresses) and the index build of one step."""

    INPUTS = ("query_start_loc", "seq_lens", "token_to_req", "is_valid", "slot_mapping",
              "positions", "swa_bt", "comp_bt", "topk")

    def __init__(self, device, impl):
        b, x = _batch(0)
        self.impl = impl
        self.Td = b.Td
        T = b.Td + b.n_tail_pad
        self.T = T
        self.inp = {k: x[k].to(device).clone() for k in self.INPUTS}
        e = lambda *s: torch.full(s, 12345, dtype=I32, device=device)  # noqa: E731
        self.out = dict(swa=e(T, W), swa_lens=e(T), topk=e(T, K), topk_lens=e(T),
                        c128a=e(T, 128), c128a_lens=e(T), c128a_pre=e(0, 128),
                        mixed=e(T, ic.mixed_width(W, K, K)), mixed_lens=e(T))
        self.no_prefill = torch.zeros(0, K, dtype=I32, device=device)

    def load(self, seed):
        _, x = _batch(seed)
        for k in self.INPUTS:
            self.inp[k].copy_(x[k])

    def __call__(self):
        i, o, impl = self.inp, self.out, self.impl
        ic.swa_indices_and_lens(i["query_start_loc"], i["seq_lens"], i["token_to_req"],
                                i["is_valid"], i["swa_bt"], o["swa"], o["swa_lens"], SWA_BS, W,
                                0, impl)
        ic.global_topk_indices_and_lens(i["topk"], i["token_to_req"], i["comp_bt"],
                                        i["is_valid"], o["topk"], o["topk_lens"], C_BS, impl)
        ic.c128a_indices_and_lens(i["positions"], i["slot_mapping"], i["token_to_req"],
                                  i["comp_bt"], o["c128a"], o["c128a_lens"], o["c128a_pre"],
                                  C_BS, RATIO, impl)
        ic.flashinfer_mixed_sparse_indices(
            o["swa"], i["topk"], None, self.no_prefill, i["query_start_loc"], i["seq_lens"],
            i["token_to_req"], i["swa_bt"], i["comp_bt"], i["is_valid"], o["mixed"],
            o["mixed_lens"], SWA_BS, C_BS, W, RATIO, K, True, None, None, impl)

    def snapshot(self):
        return {k: v.cpu().clone() for k, v in self.out.items()}


def _eager_reference(seed):
    step = DecodeStep("cpu", "reference")
    step.load(seed)
    step()
    return step.snapshot()


def _assert_same(got, want):
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs"
        assert not (got[k] == 12345).any(), f"{k} left a poisoned element"


@pytest.mark.parametrize("device", triton_params())
def test_decode_step_eager(device):
    step = DecodeStep(device, "triton")
    step()
    step.load(1)
    step()
    _assert_same(step.snapshot(), _eager_reference(1))
    assert (step.snapshot()["swa_lens"] > 0).any()


@requires_cuda
def test_cuda_graph_capture_replay():
    step = DecodeStep("cuda", "triton")
    # warm up (compiles the kernels) on a side stream, as torch.cuda.graphs asks
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (2, 3):
        step.load(seed)           # new values in the same buffers
        graph.replay()
        torch.cuda.synchronize()
        replayed = step.snapshot()
        _assert_same(replayed, _eager_reference(seed))
        for v in step.out.values():
            v.fill_(12345)
        step()                    # eager Triton on the same inputs
        torch.cuda.synchronize()
        _assert_same(step.snapshot(), replayed)
