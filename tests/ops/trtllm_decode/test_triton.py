"""Triton == reference on random mixed batches (varlen MTP + single tokens, partial windows,
lens 128..TOPK, -1 holes), h in {8, 16, 32, 64, 128}, bf16 and fp8, pools whose unreferenced
rows are NaN (an over-read poisons the output).

Runs on CUDA when present and on CPU through Triton's interpreter in the
trtllm_decode_interpret_test target (tests/helpers.triton_params). Needs the shared Triton core
(ops/attention/launch.py)."""
import pytest
import torch

from sparse_mla.ops import trtllm_decode as td
from sparse_mla.ops.trtllm_decode import reference
from sparse_mla.ops.attention import plan
from sparse_mla.ops.common.dispatch import last_choice
from sparse_mla.tests.helpers import (INTERPRETING, cuda_params, fake_device,
                                      force_tiny_launches, gapped, hopper_with_sm90, last_plan,
                                      naming, record_results, seeded, split_kernel_name,
                                      triton_params, use_policy)
from sparse_mla.tests.ops.trtllm_decode.cases import I32, fill, poisoned_pool

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
# Both sides round the same fp32 result to bf16; accumulation order differs (online softmax vs
# one-shot), so allow one bf16 ulp at |x| ~ 1 (2/128 relative) plus 1e-2 absolute for values
# near zero. FlashMLA's tests use abs 1e-3 / rel 2/128 on outputs of smaller magnitude.
TOL = dict(atol=1e-2, rtol=2 / 128)
HEADS = [8, 16, 32, 64, 128]
if INTERPRETING:
    HEADS = [8, 16]      # the interpreter is slow; the GPU run covers every head count


def _batch(seed, H, dtype, topk=136, page=16, q_lens=(3, 1, 2, 1), seq=(5, 200, 129, 1)):
    """A varlen batch; default windows: partial, full, edge, first-token."""
    g = seeded(seed)
    cu = [0]
    for ql in q_lens:
        cu.append(cu[-1] + ql)
    T = cu[-1]
    swa = poisoned_pool(-(-T * 128 // page) + 1, page, 512)
    cmp = poisoned_pool(8, page, 512)
    idx = torch.full((T, topk), -1, dtype=I32)
    lens = torch.randint(128, topk + 1, (T,), generator=g, dtype=I32)
    lens[0] = 128
    lens[1] = topk
    swa_used, cmp_used = set(), set()
    for r, ql in enumerate(q_lens):
        for i in range(ql):
            t = cu[r] + i
            vis = min(seq[r] - ql + i + 1, 128)
            cols = torch.arange(128) + t * 128
            idx[t, :128] = cols.to(I32)
            swa_used.update(cols[:vis].tolist())   # beyond the window: NaN rows
            n = int(lens[t]) - 128
            c = torch.randperm(8 * page, generator=g)[:topk - 128].to(I32)
            c[torch.rand(topk - 128, generator=g) < 0.2] = -1
            idx[t, 128:] = c
            cmp_used.update(x for x in c[:n].tolist() if x >= 0)
    fill(swa, sorted(swa_used), g, dtype)
    fill(cmp, sorted(cmp_used), g, dtype)
    x = dict(query=torch.randn(T, H, 512, generator=g).to(dtype), swa_kv_cache=swa.to(dtype),
             sparse_indices=idx, compressed_kv_cache=cmp.to(dtype), sparse_topk_lens=lens,
             seq_lens=torch.tensor(seq, dtype=I32), sinks=torch.randn(H, generator=g),
             cum_seq_lens_q=torch.tensor(cu, dtype=I32), max_q_len=max(q_lens))
    return x


def _dense(x, B, Q):
    """The same tokens as a dense [B, Q, H, 512] batch (no cum_seq_lens_q)."""
    x = dict(x)
    del x["cum_seq_lens_q"], x["max_q_len"]
    x["query"] = x["query"].reshape(B, Q, *x["query"].shape[1:])
    return x


def _run(x, device, impl):
    y = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    q, swa = y.pop("query"), y.pop("swa_kv_cache")
    out = torch.full((*q.shape[:-1], 512), float("nan"), dtype=BF16, device=device)
    td.trtllm_batch_decode_sparse_mla_dsv4(q, swa, None, out=out, bmm1_scale=512 ** -0.5,
                                           bmm2_scale=0.75, impl=impl, **y)
    assert last_choice("trtllm_decode_dsv4").impl == impl
    return out.cpu()


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("dtype", [BF16, E4M3], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tiny", [True, False], ids=["tiny-launch", "full-launch"])
def test_dsv4_triton_matches_reference(device, H, dtype, tiny, monkeypatch, request):
    """``tiny`` forces the launch shape used for a handful of (token, head block) units
    (output-dim split; an fp8 q decoded in the kernel) or the general one (fp8 q decoded to
    bf16 before the launch; on sm_90 the warp-specialized kernel), whatever this batch would
    pick."""
    force_tiny_launches(request, tiny)
    x = _batch(H, H, dtype)
    ref = _run(x, "cpu", "reference")
    tri = _run(x, device, "triton")
    if device == "cuda" and not tiny and hopper_with_sm90():
        assert split_kernel_name() == "sm90_kernel"
    assert torch.isfinite(ref.float()).all()
    torch.testing.assert_close(tri.float(), ref.float(), **TOL)


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("dtype,block", [(BF16, 16), (E4M3, 64)], ids=["bf16", "fp8"])
def test_dsv4_tiny_launch_head_block_on_sm90(device, dtype, block, monkeypatch, request):
    """Tiny launches on sm_90 run e4m3 rows in 64-row head blocks at any head count and keep
    plain bf16 rows at 8 heads in a 16-row block (``Policy.tiny_head_block_sm90``); either agrees
    with the reference on a poisoned varlen batch. CPU runs force the sm_90 choice."""
    force_tiny_launches(request, True)
    fake_device(monkeypatch, capability=(9, 0))
    blocks = record_results(monkeypatch, plan, "head_block")
    x = _batch(7, 8, dtype)
    ref = _run(x, "cpu", "reference")
    tri = _run(x, device, "triton")
    assert blocks == [block]
    torch.testing.assert_close(tri.float(), ref.float(), **TOL)


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("H", [16] if INTERPRETING else [16, 128])
@pytest.mark.parametrize("dtype", [BF16, E4M3], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tiny", [True, False], ids=["tiny-launch", "full-launch"])
def test_dsv4_dense_batch_triton_matches_reference(device, H, dtype, tiny, monkeypatch, request):
    """A dense batch (one query length) hands seq_lens / sparse_topk_lens to the kernels as
    they are: each token's window (seq_len - Q + i + 1, partial for the first request) and
    compressed count are derived in-kernel, with no lengths launch."""
    from sparse_mla.ops.trtllm_decode import triton_impl

    def no_launch(*args):
        raise AssertionError("a dense batch must not launch the lengths kernel")
    force_tiny_launches(request, tiny)
    monkeypatch.setattr(triton_impl, "dsv4_lengths", no_launch)
    x = _dense(_batch(H + 1, H, dtype, q_lens=(3, 3, 3), seq=(3, 130, 200)), 3, 3)
    ref = _run(x, "cpu", "reference")
    tri = _run(x, device, "triton")
    assert torch.isfinite(ref.float()).all()
    torch.testing.assert_close(tri.float(), ref.float(), **TOL)


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("dense", [False, True], ids=["varlen", "dense"])
@pytest.mark.parametrize("dtype", [BF16, E4M3], ids=["bf16", "fp8"])
def test_dsv4_mtp_8_matches_reference(device, dense, dtype):
    """Drafts of 8 tokens: a request whose first tokens precede its window's start (seq 8),
    one whose window slides across the draft (seq 130), one a single token among them
    (varlen); each token's window and compressed count are its own."""
    if dense:
        x = _dense(_batch(31, 8, dtype, q_lens=(8, 8), seq=(8, 130)), 2, 8)
    else:
        x = _batch(32, 8, dtype, q_lens=(8, 1, 8), seq=(8, 200, 130))
    ref = _run(x, "cpu", "reference")
    tri = _run(x, device, "triton")
    assert torch.isfinite(ref.float()).all()
    torch.testing.assert_close(tri.float(), ref.float(), **TOL)


# what lies between a strided argument's elements (tests/helpers.gapped)
GAP_FILL = {"sparse_indices": 0, "sparse_topk_lens": 200, "seq_lens": 1, "sinks": float("nan"),
            "cum_seq_lens_q": 0, "block_tables": 0}


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("dense", [False, True], ids=["varlen", "dense"])
def test_dsv4_takes_strided_lists_lengths_and_sinks(device, dense):
    """Each index, length and sink argument as a view with gaps, made on the device (a
    host-to-device copy would make it contiguous): the attention and lengths kernels take
    them by base pointer, so the op must not hand them the view as it is."""
    x = _batch(21, 16, BF16)
    if dense:
        x = _dense(_batch(22, 16, BF16, q_lens=(2, 2, 2, 2), seq=(5, 200, 129, 2)), 4, 2)
    ref = _run(x, "cpu", "reference")
    y = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    for name in [k for k in GAP_FILL if k in y]:
        with naming(name):
            tri = _run({**y, name: gapped(y[name], GAP_FILL[name])}, device, "triton")
            torch.testing.assert_close(tri.float(), ref.float(), **TOL)


def _v32_outputs(device, H, dtype, T=5, K=16, pages=4, check=None, gap=None):
    """Reference and Triton outputs of the V3.2 op on one poisoned pool; ``check`` runs right
    after the Triton launch (which kernel ran)."""
    g = seeded(99 + H)
    cache = poisoned_pool(pages, 32, 576)
    bt = torch.randint(0, pages * 32, (T, K), generator=g, dtype=I32)
    bt[bt % 7 == 0] = -1
    counts = torch.randint(0, K + 5, (T,), generator=g, dtype=I32)
    counts[:3] = torch.tensor([K, 3, 0])
    used = {int(s) for t in range(T) for s in bt[t, :min(int(counts[t]), K)] if s >= 0}
    fill(cache, sorted(used), g, dtype)
    q = torch.randn(T, H, 576, generator=g).to(dtype)
    outs = []
    for dev, impl in (("cpu", "reference"), (device, "triton")):
        out = torch.full((T, H, 512), float("nan"), dtype=BF16, device=dev)
        lists = {"block_tables": bt.to(dev), "seq_lens": counts.to(dev)}
        if impl == "triton" and gap is not None:
            lists[gap] = gapped(lists[gap], GAP_FILL[gap])
        td.trtllm_batch_decode_with_kv_cache_mla(
            q.to(dev), cache.to(dtype).to(dev), None, 128, 512, 64, lists["block_tables"],
            lists["seq_lens"], K, K, out=out, bmm1_scale=576 ** -0.5, impl=impl)
        if impl == "triton" and check is not None:
            check()
        outs.append(out.cpu().float())
    assert torch.isfinite(outs[0]).all()
    return outs


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("gap", [None, "block_tables", "seq_lens"])
def test_v32_triton_matches_reference(device, gap):
    """``gap``: that argument is a strided view (tests/helpers.gapped)."""
    ref, tri = _v32_outputs(device, 16, BF16, gap=gap)
    torch.testing.assert_close(tri, ref, **TOL)


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("dtype", [BF16, E4M3], ids=["bf16", "fp8"])
def test_v32_warp_specialized_kernel_matches_reference(H, dtype, monkeypatch, request):
    """576-wide plain rows through the sm_90 kernel (the 64 RoPE dims scored from their own
    shared-memory stage, not used as values), bf16 and e4m3 pools and queries, more tokens
    than one split's worth of keys, a token with no keys."""
    force_tiny_launches(request, False)
    ran = []
    ref, tri = _v32_outputs("cuda", H, dtype, T=9, K=200, pages=16,
                            check=lambda: ran.append(split_kernel_name()))
    assert ran == ["sm90_kernel"]
    torch.testing.assert_close(tri, ref, **TOL)


def _run_scales(x, device, impl, b1, b2, out=None):
    y = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in x.items()}
    q, swa = y.pop("query"), y.pop("swa_kv_cache")
    if out is None:
        out = torch.full((q.shape[0], q.shape[1], 512), float("nan"), dtype=BF16, device=device)
    td.trtllm_batch_decode_sparse_mla_dsv4(q, swa, None, out=out, bmm1_scale=b1, bmm2_scale=b2,
                                           impl=impl, **y)
    return out


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("tiny", [True, False], ids=["tiny-launch", "full-launch"])
def test_dsv4_tensor_scales_match_reference(device, tiny, monkeypatch, request):
    """bmm1/bmm2 scales given as one-element device tensors: the Triton path reads them in
    the kernels (no host sync) and must equal the reference, which reads them on the host."""
    force_tiny_launches(request, tiny)
    x = _batch(7, 16, E4M3)
    t1, t2 = torch.tensor([0.03]), torch.tensor([0.6])
    ref = _run_scales(x, "cpu", "reference", t1, t2)
    tri = _run_scales(x, device, "triton", t1.to(device), t2.to(device)).cpu()
    torch.testing.assert_close(tri.float(), ref.float(), **TOL)
    floats = _run_scales(x, device, "triton", 0.03, 0.6).cpu()
    torch.testing.assert_close(tri.float(), floats.float(), atol=1e-3, rtol=2 / 256)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a GPU")
@pytest.mark.parametrize("launch", ["warp-specialized", "portable", "portable-tiny"])
def test_dsv4_fp8_dot_operand_type(launch, monkeypatch, request):
    """e4m3 pools and queries: both kernels run their dots on fp16 operands (e4m3 is exact in
    fp16 too, and converts in one instruction per two bytes; the tiny launch decodes q in the
    kernel, the others before it); the compiled kernel must be that one, and agree with the
    reference."""
    if launch == "warp-specialized" and not hopper_with_sm90():
        pytest.skip("the warp-specialized kernel is sm_90 only")
    if launch != "warp-specialized":
        monkeypatch.setenv("SPARSE_MLA_SM90", "0")
    force_tiny_launches(request, launch == "portable-tiny")
    x = _batch(31, 128, E4M3)
    ref = _run(x, "cpu", "reference")
    tri = _run(x, "cuda", "triton")
    assert split_kernel_name() == ("sm90_kernel" if launch == "warp-specialized"
                                   else "_split_kernel")
    ptx = last_plan().kernel.asm["ptx"]
    assert "f32.f16.f16" in ptx and "f32.bf16.bf16" not in ptx
    torch.testing.assert_close(tri.float(), ref.float(), **TOL)


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("dtype", [BF16, E4M3], ids=["bf16", "fp8"])
def test_dsv4_single_split_epilogue_matches_reference(dtype, monkeypatch, request):
    """One split per token: the sm_90 kernel applies the sink and bmm2 scale (a device
    tensor, read in the kernel) and writes bf16 out itself, no combine launch."""
    force_tiny_launches(request, False)
    use_policy(request, splits=1)
    x = _batch(24, 64, dtype)
    t1, t2 = torch.tensor([0.03]), torch.tensor([0.6])
    ref = _run_scales(x, "cpu", "reference", t1, t2)
    tri = _run_scales(x, "cuda", "triton", t1.cuda(), t2.cuda()).cpu()
    assert split_kernel_name() == "sm90_kernel" and last_plan().combined is False
    torch.testing.assert_close(tri.float(), ref.float(), **TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_dsv4_tensor_scales_under_cuda_graph():
    """Captured once, replayed after the scale tensors change: the replay must use the new
    values (a host-side read would have baked the old ones in, or failed to capture)."""
    x = {k: v.cuda() if isinstance(v, torch.Tensor) else v
         for k, v in _batch(8, 32, E4M3).items()}            # no host copies inside the capture
    t1 = torch.tensor([0.03], device="cuda")
    t2 = torch.tensor([0.6], device="cuda")
    out = torch.empty(x["query"].shape[0], 32, 512, dtype=BF16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _run_scales(x, "cuda", "triton", t1, t2, out)           # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run_scales(x, "cuda", "triton", t1, t2, out)
    t1.fill_(0.05)
    t2.fill_(0.25)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = _run_scales(x, "cuda", "triton", torch.tensor([0.05], device="cuda"),
                       torch.tensor([0.25], device="cuda"))        # eager, new values
    torch.testing.assert_close(out.float(), want.float(), atol=0, rtol=0)
    want = _run_scales(x, "cpu", "reference", torch.tensor([0.05]), torch.tensor([0.25]))
    torch.testing.assert_close(out.cpu().float(), want.float(), **TOL)


# The one-launch Triton length kernel (varlen batches) gives exactly the PyTorch definition's
# counts (reference.py).

def _varlen(g, B, max_q):
    q_lens = torch.randint(0, max_q + 1, (B,), generator=g)
    cu = torch.zeros(B + 1, dtype=torch.long)
    cu[1:] = q_lens.cumsum(0)
    return cu.to(I32), int(q_lens.max()) if B else 1


CASES = [  # (B, Q, varlen, extra rows beyond the last request)
    (1, 1, False, 0), (3, 2, False, 0), (70, 3, False, 0), (5, 4, True, 0), (130, 2, True, 3),
    (1, 3, True, 2)]


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("B,Q,varlen,extra", CASES)
def test_triton_lengths_equal_torch_definition(device, B, Q, varlen, extra):
    from sparse_mla.ops.trtllm_decode import triton_impl
    g = torch.Generator().manual_seed(B * 10 + Q)
    topk = 128 + 64
    if varlen:
        cu, Q = _varlen(g, B, Q)
        T = int(cu[-1]) + extra
    else:
        cu, T = None, B * Q
    seq_lens = torch.randint(-2, 300, (B,), generator=g, dtype=I32)   # < q_len and < 0 too
    topk_lens = torch.randint(100, topk + 40, (T,), generator=g, dtype=I32)   # out of range too
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    want = reference.dsv4_lengths(T, B, Q, dev(topk_lens), dev(seq_lens), dev(cu), topk)
    got = triton_impl.dsv4_lengths(T, B, Q, dev(topk_lens), dev(seq_lens), dev(cu), topk)
    for w, x in zip(want, got):
        assert x.dtype == I32 and torch.equal(x.cpu(), w.cpu())
    want = reference.v32_lengths(T, B, Q, dev(seq_lens), dev(cu), 200)
    got = triton_impl.v32_lengths(T, B, Q, dev(seq_lens), dev(cu), 200)
    assert torch.equal(got.cpu(), want.cpu())
    assert (want > 0).any()          # the case is not trivially all-zero


@pytest.mark.skipif(INTERPRETING, reason="interpreted kernels always take the software route")
@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("tiny", [True, False], ids=["tiny-launch", "full-launch"])
def test_software_e4m3_route_matches_reference(device, tiny, monkeypatch, request):
    """The route GPUs below sm_89 take, forced on this GPU (``SPARSE_MLA_SOFT_FP8=1``): plain
    e4m3 rows and an e4m3 q (decoded in the kernel on tiny launches, fp16 dots otherwise)
    through the portable kernel, which the route names, against the reference."""
    monkeypatch.setenv("SPARSE_MLA_SOFT_FP8", "1")
    for H in (16, 128):
        test_dsv4_triton_matches_reference(device, H, E4M3, tiny, monkeypatch, request)
        route = "tiny" if tiny else "portable"
        assert last_choice("trtllm_decode_dsv4").route == f"{route}, software e4m3 (forced)"
        assert split_kernel_name() == "_split_kernel"
    ref, tri = _v32_outputs(device, 64, E4M3)
    torch.testing.assert_close(tri, ref, **TOL)


@pytest.mark.parametrize("device", triton_params())
@pytest.mark.parametrize("dtype", [BF16, E4M3], ids=["bf16", "fp8"])
def test_low_shared_memory_launch_matches_reference(device, dtype, monkeypatch, request):
    """GPUs with less shared memory per block than sm_90 (sm_80, 86, 89, 120) get one key
    stage and plain bf16 rows loaded 64 dims at a time (``Policy.low_shared``); the
    same inputs give the reference's outputs through that shape too (512- and 576-wide
    rows)."""
    monkeypatch.setenv("SPARSE_MLA_SM90", "0")
    fake_device(monkeypatch, shared=99 * 1024)
    force_tiny_launches(request, False)
    test_dsv4_triton_matches_reference(device, 16, dtype, False, monkeypatch, request)
    ref, tri = _v32_outputs(device, 16, dtype)
    torch.testing.assert_close(tri, ref, **TOL)
