"""Triton == reference, element for element, on random mixed batches (decode, MTP, prefill,
graph padding, short positions), with poisoned output buffers.

Runs on CUDA when present and on CPU through Triton's interpreter in the *_interpret_test
target (tests/helpers.triton_params)."""
import pytest
import torch

from sparse_mla.ops import index_combine as ic
from sparse_mla.ops.common.dispatch import last_choice
from sparse_mla.tests.helpers import requires_cuda, triton_params
from sparse_mla.tests.ops.index_combine.cases import make_batch, poisoned

I32 = torch.int32
POISON = 12345
W = 128

# (ratio, swa block size, compressed block size): vLLM's (4, 64, 64) and (128, 64, 2), plus
# FlashMLA perf pages (SWA 256) and odd combinations.
CONFIGS = [(4, 64, 64), (128, 64, 2), (4, 256, 2), (128, 2, 256)]


def _batch(seed, ratio, swa_bs, comp_bs, **kw):
    kw.setdefault("max_ctx", 300 if ratio == 4 else 700)
    return make_batch(seed, ratio=ratio, swa_bs=swa_bs, comp_bs=comp_bs, mtp=3, **kw)


def _both(device, call, outs_fn):
    """Run ``call(tensors, outs, impl)`` with reference on CPU and triton on ``device``;
    return both output tuples (CPU)."""
    ref_outs = outs_fn("cpu")
    call("cpu", ref_outs, "reference")
    tri_outs = outs_fn(device)
    call(device, tri_outs, "triton")
    return ref_outs, tuple(o.cpu() for o in tri_outs)


def _assert_equal(ref_outs, tri_outs):
    for r, t in zip(ref_outs, tri_outs):
        assert not (r == POISON).any(), "reference left a poisoned element"
        assert not (t == POISON).any(), "triton left a poisoned element"
        mism = (r != t).nonzero()
        assert mism.numel() == 0, (f"{mism.shape[0]} mismatches, first at {mism[0].tolist()}: "
                                   f"ref {r[tuple(mism[0])]} triton {t[tuple(mism[0])]}")


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_global_topk(device, cfg, seed):
    b = _batch(seed, *cfg)
    T = b.Td + b.Tp + b.n_tail_pad
    K = b.t["K"]

    def call(dev, outs, impl):
        x = b.to(dev)
        ic.global_topk_indices_and_lens(x["topk"], x["token_to_req"], x["comp_bt"],
                                        x["is_valid"], outs[0], outs[1], x["comp_bs"], impl)
    ref, tri = _both(device, call, lambda d: (poisoned(T, K, device=d), poisoned(T, device=d)))
    assert last_choice("global_topk_indices_and_lens").impl == "triton"
    _assert_equal(ref, tri)
    assert (ref[1][~b.t["is_valid"]] == 0).all()


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("stride_rows", [None, 96])
@pytest.mark.parametrize("counts", [False, True])
@pytest.mark.parametrize("prefill_ws", [False, True])
def test_convert_v32(device, stride_rows, counts, prefill_ws):
    b = _batch(3, 4, 64, 64)
    T = b.Td + b.Tp
    g = torch.Generator().manual_seed(7)
    K = 40   # not a multiple of any tile: the kernel masks
    seq = b.t["seq_lens"].long()
    req = b.t["token_to_req"][:T].clone()
    # request-local token ids < seq_len (plus some beyond the table and -1)
    tok = (torch.rand(T, K, generator=g) * seq[req.clamp(0, len(seq) - 1).long()]
           .unsqueeze(1)).to(I32)
    tok[:, -3:] = -1
    tok[0, 0] = 10 ** 6
    pre_ids = starts = None
    if prefill_ws:
        pre = torch.full((T,), -1, dtype=I32)
        Rd = b.n_decode_reqs
        pre[b.Td:] = req[b.Td:] - Rd
        pre_ids = pre
        starts = torch.tensor([0] + b.seq_lens_l[Rd:-1], dtype=I32).cumsum(0).to(I32) + 5
    req[req >= len(seq)] = 0
    req[req < 0] = 0

    def call(dev, outs, impl):
        bt = b.t["swa_bt"].to(dev)
        ic.convert_req_index_to_global(
            req.to(dev), bt, tok.to(dev), outs[0], outs[1] if counts else None,
            None if pre_ids is None else pre_ids.to(dev),
            None if starts is None else starts.to(dev), 64, stride_rows, impl)
    ref, tri = _both(device, call, lambda d: (poisoned(T, K, device=d), poisoned(T, device=d)))
    if not counts:
        ref, tri = ref[:1], tri[:1]
    _assert_equal(ref, tri)
    assert ref[0][0, 0] == -1


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("three_d", [False, True])
def test_swa(device, cfg, seed, three_d):
    b = _batch(seed, *cfg)
    for offset, T in ((0, b.Td + b.Tp + b.n_tail_pad), (b.Td, b.Tp + b.n_tail_pad)):
        def call(dev, outs, impl, offset=offset):
            x = b.to(dev)
            ic.swa_indices_and_lens(x["query_start_loc"], x["seq_lens"], x["token_to_req"],
                                    x["is_valid"], x["swa_bt"], outs[0], outs[1], x["swa_bs"],
                                    W, offset, impl)

        def outputs(d, shape=(T, 1, W) if three_d else (T, W), T=T):
            return poisoned(*shape, device=d), poisoned(T, device=d)
        ref, tri = _both(device, call, outputs)
        _assert_equal(ref, tri)
        inv = ~b.t["is_valid"][offset:offset + T]
        assert (ref[1][inv] == 0).all() and (ref[0][inv] == -1).all()


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_c128a(device, cfg, seed):
    ratio, swa_bs, comp_bs = cfg
    b = _batch(seed, ratio, swa_bs, comp_bs)
    Td, Tp, width = b.Td, b.Tp, 128

    def call(dev, outs, impl):
        x = b.to(dev)
        ic.c128a_indices_and_lens(x["positions"], x["slot_mapping"], x["token_to_req"],
                                  x["comp_bt"], outs[0], outs[1], outs[2], x["comp_bs"], ratio,
                                  impl)
    ref, tri = _both(device, call, lambda d: (poisoned(Td, width, device=d),
                                              poisoned(Td, device=d),
                                              poisoned(Tp, width, device=d)))
    _assert_equal(ref, tri)


def _combine_inputs(b, topk, ratio):
    """Prefill chunk = the prefill requests of ``b`` (query_start_loc not rebased)."""
    Rd = b.n_decode_reqs
    qsl = b.t["query_start_loc"][Rd:].clone()
    seq = b.t["seq_lens"][Rd:].clone()
    ql = (qsl[1:] - qsl[:-1]).long()
    gl = (ql + torch.clamp(seq.long() - ql, max=W - 1)).to(I32)
    N = max(int((seq // ratio).max()), 1)
    M = N + int(gl.max()) + 3
    rows = b.t["topk"][b.Td:b.Td + b.Tp, :topk]
    return qsl, seq, gl, M, N, rows


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("ratio,topk", [(4, 16), (4, 0), (128, 16)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("extra_rows", [0, 3])
def test_combine(device, ratio, topk, seed, extra_rows):
    b = _batch(seed, ratio, 64, 64, topk=max(topk, 1), n_decode=2, n_prefill=3)
    qsl, seq, gl, M, N, rows = _combine_inputs(b, topk, ratio)
    T = b.Tp + extra_rows
    rows = torch.cat([rows, torch.full((extra_rows, rows.shape[1]), -1, dtype=I32)])
    CT = ic.combined_width(topk, W)

    def call(dev, outs, impl):
        ic.combine_topk_swa_indices(rows.to(dev), qsl.to(dev), seq.to(dev), gl.to(dev),
                                    outs[0], outs[1], W, ratio, topk, M, N, impl)
    ref, tri = _both(device, call, lambda d: (poisoned(T, CT, device=d), poisoned(T, device=d)))
    _assert_equal(ref, tri)
    if extra_rows:
        assert (ref[1][b.Tp:] == 0).all() and (ref[0][b.Tp:] == -1).all()


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("decode_kind", ["local", "global_lens", "global", "none"])
@pytest.mark.parametrize("packed", [False, True])
def test_mixed(device, cfg, decode_kind, packed):
    ratio, swa_bs, comp_bs = cfg
    b = _batch(11, ratio, swa_bs, comp_bs, topk=10)
    Td, Tp = b.Td, b.Tp
    x = b.t
    topk = 10
    # decode SWA rows as the SWA op makes them
    dswa = torch.empty(Td, W, dtype=I32)
    ic.swa_indices_and_lens(x["query_start_loc"], x["seq_lens"], x["token_to_req"],
                            x["is_valid"], x["swa_bt"], dswa, torch.empty(Td, dtype=I32),
                            swa_bs, W, 0)
    dcomp = dlens = dvalid = None
    if decode_kind == "local":
        dcomp = x["topk"][:Td].clone()
        dvalid = x["is_valid"][:Td].clone()
        # invalid tokens carry junk; keep it inside int range but beyond tables
    elif decode_kind.startswith("global"):
        dcomp = torch.randint(-1, 5000, (Td, 7), dtype=I32,
                              generator=torch.Generator().manual_seed(5))
        if decode_kind == "global_lens":
            dlens = torch.randint(0, 8, (Td + 2,), dtype=I32,
                                  generator=torch.Generator().manual_seed(6))
    ptopk = x["topk"][Td:Td + Tp].clone()
    spans = (swa_bs + 3, comp_bs * 2) if packed else (None, None)
    Kd = 0 if dcomp is None else dcomp.shape[1]
    width = ic.mixed_width(W, topk, Kd)

    def call(dev, outs, impl):
        y = b.to(dev)
        mv = lambda t: None if t is None else t.to(dev)  # noqa: E731
        ic.flashinfer_mixed_sparse_indices(
            dswa.to(dev), mv(dcomp), mv(dlens), ptopk.to(dev), y["query_start_loc"],
            y["seq_lens"], y["token_to_req"], y["swa_bt"], y["comp_bt"], mv(dvalid), outs[0],
            outs[1], swa_bs, comp_bs, W, ratio, topk, decode_kind == "local", spans[0],
            spans[1], impl)
    ref, tri = _both(device, call, lambda d: (poisoned(Td + Tp, width, device=d),
                                              poisoned(Td + Tp, device=d)))
    _assert_equal(ref, tri)
    assert (ref[1] >= W).all()


@pytest.mark.parametrize("device", triton_params())
def test_empty_batches(device):
    """Zero tokens: nothing launched, nothing raised."""
    e = torch.zeros(0, dtype=I32, device=device)
    bt = torch.zeros(1, 4, dtype=I32, device=device)
    out = torch.zeros(0, 8, dtype=I32, device=device)
    ic.global_topk_indices_and_lens(out, e, bt, e.bool(), out.clone(), e.clone(), 4,
                                    impl="triton")
    ic.swa_indices_and_lens(torch.zeros(1, dtype=I32, device=device), e, e, e.bool(), bt,
                            torch.zeros(0, W, dtype=I32, device=device), e.clone(), 64,
                            impl="triton")
    assert last_choice("swa_indices_and_lens").impl == "triton"


# ---- CUDA graphs
# A decode-step index build (SWA window, C4A global top-k, C128A, TRTLLM-gen mixed rows)
# captured in a CUDA graph and replayed on a new batch equals eager execution.
#
# The same harness also runs eagerly wherever Triton runs (interpreter included), so the
# harness itself is checked on CPU.

K, SWA_BS, C_BS, RATIO = 32, 64, 64, 4       # W = 128, as above
SWA_COLS, C_COLS = 64, 16


def _step_batch(seed):
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
        b, x = _step_batch(0)
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
        _, x = _step_batch(seed)
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
