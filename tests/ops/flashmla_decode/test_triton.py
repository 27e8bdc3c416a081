"""Triton decode / prefill vs the reference with docs/semantics.md §9's tolerances (FlashMLA's own).

CUDA runs the production-like grid; the Triton interpreter (CPU, *_interpret_test) runs a
few tiny shapes of the same code. The attention core's own routes (launch shapes, the sm_90
and cluster kernels, tiny launches, ...) are tested in tests/ops/attention/test_attention_core.py.
"""
import pytest
import torch

from sparse_mla.ops.attention import plan
from sparse_mla.ops.common.dispatch import last_choice
from sparse_mla.ops.common.triton_utils import soft_fp8_reason
from sparse_mla.ops.flashmla_decode import flash_mla_sparse_fwd, flash_mla_with_kvcache
from sparse_mla.tests.helpers import (force_tiny_launches, gapped, hopper_with_sm90,
                                      last_plan, naming, requires_cuda, split_kernel_name,
                                      triton_params)
from sparse_mla.tests.ops.flashmla_decode.cases import (V32_PREFILL_CLASSES, cache_view,
                                                        decode_case, out_of_cache_ids, plant,
                                                        prefill_case, v32_prefill_case)

DEVICES = triton_params()


def _check_infinite_then_close(got, want, rtol):
    """Infinite entries (rows without a valid key: lse +inf, max logit -inf) equal, sign
    included; the finite ones within ``rtol``."""
    inf = want.isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[inf])
    torch.testing.assert_close(got[~inf], want[~inf], atol=1e-6, rtol=rtol)


def cosine_diff(x, y):
    """FlashMLA's whole-tensor criterion: 1 - 2<x, y> / (|x|^2 + |y|^2), in float64."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def check_decode(ref, got, cosine=5e-6):
    """docs/semantics.md §9's decode tolerances (FlashMLA's tests): elementwise, then ``cosine`` on
    the whole output (None: not checked)."""
    (ro, rl), (o, l) = ref, got
    assert ro.float().abs().amax() > 0      # a comparison of all-zero outputs proves nothing
    assert not o.isnan().any()
    torch.testing.assert_close(o.float(), ro.float(), atol=1e-3, rtol=2 / 128)
    if cosine is not None:
        assert cosine_diff(o, ro) < cosine
    _check_infinite_then_close(l, rl, 8 / 65536)


def check_prefill(ref, got):
    (ro, rm, rl), (o, m, l) = ref, got
    assert ro.float().abs().amax() > 0
    assert not o.isnan().any()
    torch.testing.assert_close(o.float(), ro.float(), atol=8e-4, rtol=3 / 128)
    for g, want in ((m, rm), (l, rl)):
        _check_infinite_then_close(g, want, 2 / 65536)


def _run_decode(a, impl):
    a = dict(a)
    q, cache, idx = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    return flash_mla_with_kvcache(q, cache, idx, impl=impl, **a)


GPU_GRID = [  # (b, s_q, h, block sizes main/extra, topk, extra_topk, fmt)
    (1, 1, 64, 64, 2, 128, 512, "v4"), (4, 2, 128, 256, 64, 128, 1024, "v4"),
    (74, 1, 16, 53, 61, 128, 64, "v4"), (321, 3, 8, 61, 2, 64, 64, "v4"),
    (4, 3, 1, 2, 53, 64, 128, "v4"), (74, 2, 32, 64, 2, 128, 512, "v4"),
    (4, 2, 128, 64, None, 256, 0, "v32"), (2, 1, 64, 53, 2, 128, 64, "v32"),
    (5, 2, 16, 256, None, 192, 0, "v32"),
    # MTP drafts of 8: every token of a request reads its own rows
    (16, 8, 128, 64, 2, 256, 512, "v4"), (6, 8, 64, 64, None, 256, 0, "v32")]
# On sm_90 these GPU_GRID shapes are tiny launches that stay on the portable kernel (one head
# block, at most SM90_TINY's units and tiles); every other one runs the sm_90 kernel
SM90_PORTABLE_CASES = {0, 7}
CPU_GRID = [(2, 2, 3, 61, 2, 64, 32, "v4"), (1, 1, 16, 2, 53, 32, 0, "v4"),
            (2, 1, 5, 53, 2, 32, 16, "v32"), (1, 8, 4, 16, 2, 32, 16, "v4")]


def _grid(device):
    return CPU_GRID if device == "cpu" else GPU_GRID


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["auto", "portable"])
@pytest.mark.parametrize("case", range(len(GPU_GRID)))
def test_decode_matches_reference(device, route, case, monkeypatch):
    """Every grid shape through the automatic route and, on a GPU, through the portable
    kernel alone (``SPARSE_MLA_SM90=0``), asserting which split kernel ran."""
    grid = _grid(device)
    if case >= len(grid):
        pytest.skip(f"the {device} grid has {len(grid)} shapes")
    if route == "portable":
        if device == "cpu":
            pytest.skip("the interpreter runs the portable kernel on the automatic route")
        monkeypatch.setenv("SPARSE_MLA_SM90", "0")
    b, s_q, h, bs, ebs, topk, etopk, fmt = grid[case]
    a = decode_case(device, b=b, s_q=s_q, h=h, fmt=fmt, bs=bs, topk=topk, extra=bool(etopk),
                    extra_bs=ebs or 2, extra_topk=etopk or 64, seed=case,
                    noncontig_q=case % 2 == 1)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert last_choice("flashmla_sparse_decode").impl == "triton"
    if device == "cuda":
        sm90 = route == "auto" and hopper_with_sm90() and case not in SM90_PORTABLE_CASES
        assert split_kernel_name() == ("sm90_kernel" if sm90 else "_split_kernel")
    check_decode(ref, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gluon", ["1", "0"])
def test_last_choice_reports_the_kernel_route(device, gluon, monkeypatch, request):
    """After a call, ``last_choice`` says which kernel route ran and why (the launch plan the
    core returned): the sm_90 routes only where the Gluon kernel runs, with the reason for
    the portable kernel otherwise; the plan's kernel is the one that ran."""
    monkeypatch.setenv("SPARSE_MLA_SM90", gluon)
    force_tiny_launches(request, False)
    cuda = device == "cuda"
    a = decode_case(device, b=3 if cuda else 2, s_q=2 if cuda else 1, h=128 if cuda else 8,
                    bs=64, topk=256 if cuda else 32, extra=True, extra_topk=64 if cuda else 16,
                    extra_bs=64, seed=5)
    ref = _run_decode(a, "reference")
    assert last_choice("flashmla_sparse_decode").route == "reference"
    got = _run_decode(a, "triton")
    choice = last_choice("flashmla_sparse_decode")
    p = choice.plan
    assert choice.route == p.label and p is last_plan() and p.reason
    assert p.route in plan.ROUTES and p.label in str(choice) and p.reason in str(choice)
    # V4 keys: e4m3 decoded in software exactly where the interpreter or a GPU below sm_89
    # runs them, or where forced (SPARSE_MLA_SOFT_FP8=1), and the route says so
    soft = soft_fp8_reason(torch.device(device))
    assert p.soft_e4m3 == (soft or "")
    assert p.label == (f"{p.route}, software e4m3 ({soft})" if soft else p.route)
    assert p.phases and len(p.kernels) == len(p.phases)
    sm90 = gluon == "1" and hopper_with_sm90()
    assert (p.route in ("sm90", "sm90_cluster")) == sm90
    if sm90:    # V4 rows at 128 heads, 12 units of 5 tiles: the 2-CTA cluster
        assert p.route == "sm90_cluster" and split_kernel_name() == "sm90_kernel"
    else:
        assert p.route == "portable"
        if cuda:    # (the interpreter compiles nothing)
            assert split_kernel_name() == "_split_kernel"
        assert ("SPARSE_MLA_SM90=0" in p.reason) == (gluon == "0")
        if device == "cpu":
            assert gluon == "0" or "interpreter" in p.reason
    check_decode(ref, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_lengths,sink", [(False, None), (True, "random")])
def test_decode_without_lengths_or_sink(device, use_lengths, sink):
    a = decode_case(device, b=3, s_q=1, h=4, bs=61, topk=64, extra=True, extra_topk=32,
                    use_lengths=use_lengths, sink=sink, seed=11)
    check_decode(_run_decode(a, "reference"), _run_decode(a, "triton"))


def planted_out_of_cache_ids(a, bs=61, extra_bs=2):
    """``(a with out-of-cache ids planted in each list, a with -1 in their place)``."""
    bad, minus = dict(a), dict(a)
    for key, cache, block in (("indices", "k_cache", bs),
                              ("extra_indices_in_kvcache", "extra_k_cache", extra_bs)):
        if key in a:
            ids = out_of_cache_ids(a[cache].shape[0] * block)
            bad[key] = plant(a[key], ids)
            minus[key] = plant(a[key], [-1] * len(ids))
    return bad, minus


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["v4", "v32"])
def test_decode_skips_every_id_outside_the_cache(device, fmt):
    """Inside the lengths, every id outside [0, capacity) (-2, -64, INT_MAX, the capacity and
    past it) is an unused column like -1: the answer is the one with -1 in their place."""
    v4 = fmt == "v4"
    a = decode_case(device, b=3, s_q=2, h=4, fmt=fmt, bs=61, topk=64, extra=v4, extra_bs=2,
                    extra_topk=32, use_lengths=v4, seed=23)
    bad, minus = planted_out_of_cache_ids(a)
    want = _run_decode(minus, "reference")
    for impl in ("reference", "triton"):
        with naming(impl):
            check_decode(want, _run_decode(bad, impl))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view", ["4-D", "2-D", "float8_e4m3fn", "int8"])
def test_decode_takes_every_cache_view(device, view):
    """Both caches as FlashMLA's 4-D view, as 2-D [blocks, bytes] views with block sizes, or
    typed as e4m3 / int8 bytes: the answer of the uint8 [blocks, block_size, 584] views."""
    a = decode_case(device, b=2, s_q=2, h=4, bs=61, topk=64, extra=True, extra_bs=2,
                    extra_topk=32, seed=29)
    v = dict(a, k_cache=cache_view(a["k_cache"], view, 61),
             extra_k_cache=cache_view(a["extra_k_cache"], view, 2))
    if view == "2-D":
        v.update(block_size=61, extra_block_size=2)
    runs = {}
    for impl in ("reference", "triton"):
        with naming(impl):
            runs[impl] = _run_decode(a, impl)
            got = _run_decode(v, impl)
            assert all(torch.equal(x, y) for x, y in zip(runs[impl], got))
    check_decode(runs["reference"], runs["triton"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_row_lengths_are_shared_by_the_rows_tokens(device, impl):
    """topk_length is per batch row (the kernels read lengths[t // s_q], no per-token copy):
    the answer must equal the same tokens sent as s_q = 1 rows with the lengths repeated."""
    b, s_q, h = 3, 3, 4
    a = decode_case(device, b=b, s_q=s_q, h=h, topk=64, extra=True, extra_topk=32, seed=13)
    flat = dict(a)
    flat["q"] = a["q"].reshape(b * s_q, 1, h, 512)
    flat["indices"] = a["indices"].reshape(b * s_q, 1, -1)
    flat["extra_indices_in_kvcache"] = a["extra_indices_in_kvcache"].reshape(b * s_q, 1, -1)
    for key in ("topk_length", "extra_topk_length"):
        flat[key] = a[key].repeat_interleave(s_q)
    assert a["topk_length"].unique().numel() > 1       # rows really differ
    o, l = _run_decode(a, impl)
    fo, fl = _run_decode(flat, impl)
    assert torch.equal(o.reshape(b * s_q, 1, h, 512), fo)
    assert torch.equal(l.transpose(1, 2).reshape(b * s_q, h), fl.transpose(1, 2).reshape(-1, h))


def given_buffers(device, b, s_q, h, layout):
    """NaN-filled ``(out, lse)`` for the ``out=`` / ``lse=`` call. "flashmla": the layouts
    FlashMLA returns (lse a transposed view of [b, s_q, h]). "own": a contiguous [b, h, s_q]
    lse and an out stored s_q-major: neither flattens to token rows without a copy."""
    if layout == "flashmla":
        return (torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device=device),
                torch.full((b, s_q, h), float("nan"), device=device).transpose(1, 2))
    return (torch.full((s_q, b, h, 512), float("nan"), dtype=torch.bfloat16,
                       device=device).transpose(0, 1),
            torch.full((b, h, s_q), float("nan"), device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("layout", ["flashmla", "own"])
def test_decode_writes_into_given_buffers(device, impl, layout):
    a = decode_case(device, b=3, s_q=2, h=8, topk=64, extra=False, seed=5)
    out, lse = given_buffers(device, 3, 2, 8, layout)
    ref = _run_decode(a, "reference")
    q, cache, idx = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    o, l = flash_mla_with_kvcache(q, cache, idx, out=out, lse=lse, impl=impl, **a)
    assert o is out and l is lse
    check_decode(ref, (out, lse))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_prefill_writes_into_given_buffers(device, impl):
    a = prefill_case(device, s_q=5, h=4, s_kv=64, topk=64, seed=3)
    ref = flash_mla_sparse_fwd(impl="reference", **a)
    bufs = dict(out=torch.full((5, 4, 512), float("nan"), dtype=torch.bfloat16, device=device),
                max_logits=torch.full((5, 4), float("nan"), device=device),
                lse=torch.full((5, 4), float("nan"), device=device))
    got = flash_mla_sparse_fwd(impl=impl, **a, **bufs)
    assert all(g.data_ptr() == b.data_ptr() for g, b in zip(got, bufs.values()))
    check_prefill(ref, tuple(bufs.values()))


def empty_decode_case(device, empty):
    """A decode case with ``empty`` (b / s_q / topk / extra_topk) at 0."""
    a = decode_case(device, b=3, s_q=2, h=8, topk=64, bs=61, extra=True, extra_topk=64,
                    extra_bs=2, seed=23)
    if empty in ("b", "s_q"):
        dim = 0 if empty == "b" else 1
        for k in ("q", "indices", "extra_indices_in_kvcache"):
            a[k] = a[k].narrow(dim, 0, 0)
        if empty == "b":
            for k in ("topk_length", "extra_topk_length"):
                a[k] = a[k][:0]
    else:
        key, lens = (("indices", "topk_length") if empty == "topk" else
                     ("extra_indices_in_kvcache", "extra_topk_length"))
        a[key] = a[key][:, :, :0]
        a[lens] = torch.zeros_like(a[lens])
    return a


def check_same(ref, got):
    """Equal shapes; then check_decode / check_prefill, or equality where nothing is finite
    or there is nothing at all (those checks need a nonzero output)."""
    assert [t.shape for t in got] == [t.shape for t in ref]
    if ref[0].numel() and ref[0].float().abs().amax() > 0:
        (check_decode if len(ref) == 2 else check_prefill)(ref, got)
    else:
        assert all(torch.equal(g, r) for g, r in zip(got, ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", ["b", "s_q", "topk", "extra_topk"])
@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_decode_of_empty_batches_and_lists(device, empty, impl):
    """An empty batch returns empty outputs; an empty key list is a list with no valid key.
    On an SM90 GPU with the wheel "auto" may take FlashMLA, which rejects empty batches."""
    a = empty_decode_case(device, empty)
    check_same(_run_decode(a, "reference"), _run_decode(a, impl))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", ["s_q", "topk", "s_kv"])
@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_prefill_of_empty_queries_keys_and_lists(device, empty, impl):
    """FlashMLA's prefill asserts s_q > 0 and topk > 0: the automatic choice must not send
    it those."""
    a = prefill_case(device, s_q=5, h=8, s_kv=64, topk=64, seed=29)
    if empty == "s_q":
        a.update(q=a["q"][:0], indices=a["indices"][:0], topk_length=a["topk_length"][:0])
    elif empty == "topk":
        a.update(indices=a["indices"][:, :, :0], topk_length=torch.zeros_like(a["topk_length"]))
    else:
        a["kv"] = a["kv"][:0]
    check_same(flash_mla_sparse_fwd(impl="reference", **a), flash_mla_sparse_fwd(impl=impl, **a))


# what lies between a strided argument's elements: a real row's slot id, length 1, NaN sink
GAP_FILL = {"indices": 0, "extra_indices_in_kvcache": 0, "topk_length": 1,
            "extra_topk_length": 1, "attn_sink": float("nan")}


def strided_decode_args(device, fmt, h=4):
    """(case, [(argument name, the case with that argument as a strided view)])."""
    a = decode_case(device, b=2, s_q=2, h=h, fmt=fmt, bs=61, topk=64, extra=fmt == "v4",
                    extra_topk=32, use_lengths=fmt == "v4", seed=17)
    return a, [(k, {**a, k: gapped(a[k], GAP_FILL[k])}) for k in GAP_FILL if k in a]


def strided_prefill_args(device, h):
    a = prefill_case(device, s_q=6, h=h, s_kv=64, topk=128, seed=19)
    return a, [(k, {**a, k: gapped(a[k], GAP_FILL[k])})
               for k in ("indices", "topk_length", "attn_sink")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["v4", "v32"])
def test_decode_takes_strided_lists_lengths_and_sink(device, fmt):
    """Every index list, length list and the sink given as a view with gaps: the kernels
    take them by base pointer, so the op must not hand them the view as it is."""
    a, cases = strided_decode_args(device, fmt)
    ref = _run_decode(a, "reference")
    for name, b in cases:
        with naming(name):
            check_decode(ref, _run_decode(b, "reference"))
            check_decode(ref, _run_decode(b, "triton"))


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_takes_strided_lists_lengths_and_sink(device):
    a, cases = strided_prefill_args(device, 4)
    ref = flash_mla_sparse_fwd(impl="reference", **a)
    for name, b in cases:
        with naming(name):
            check_prefill(ref, flash_mla_sparse_fwd(impl="reference", **b))
            check_prefill(ref, flash_mla_sparse_fwd(impl="triton", **b))


@requires_cuda
def test_lengths_past_the_index_width_read_no_further():
    """With value checks off (CUDA's default) lengths past the indices' width are not
    rejected; they must act as the full width, never reading past the index rows."""
    a = decode_case("cuda", b=3, s_q=2, h=16, topk=64, extra_topk=64, use_lengths=False,
                    seed=8)
    full = dict(a, topk_length=torch.full((3,), 64, dtype=torch.int32, device="cuda"),
                extra_topk_length=torch.full((3,), 64, dtype=torch.int32, device="cuda"))
    over = dict(full, topk_length=full["topk_length"] + 1000,
                extra_topk_length=full["extra_topk_length"] + 2 ** 20)
    want = _run_decode(full, "triton")
    got = _run_decode(over, "triton")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    check_decode(_run_decode(full, "reference"), got)


def captured_replay(b, h, impl):
    """One decode call (s_q 2, window 128 + 512) captured into a CUDA graph with ``out=`` /
    ``lse=``, then every input changed in place (q, both caches, ids, lengths, sinks) and the
    graph replayed: ``(the new inputs, (out, lse))``."""
    shape = dict(b=b, s_q=2, h=h, bs=256, topk=128, extra_bs=64, extra_topk=512)
    a = decode_case("cuda", **shape, seed=40)
    new = decode_case("cuda", **shape, seed=41)
    args = {k: v for k, v in a.items() if k not in ("q", "k_cache", "indices")}
    out = torch.empty(b, 2, h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, 2, h, device="cuda").transpose(1, 2)

    def call():
        flash_mla_with_kvcache(a["q"], a["k_cache"], a["indices"], out=out, lse=lse,
                               impl=impl, **args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()                                      # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for k, v in new.items():
        if isinstance(v, torch.Tensor):
            a[k].copy_(v)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return new, (out, lse)


@requires_cuda
@pytest.mark.parametrize("route", ["default", "split", "portable"])
def test_decode_replays_under_cuda_graph(route, monkeypatch):
    """The replay must answer for the new inputs (nothing host-side baked in). Routes: the
    default tiny launch (batch 2); a split launch with its combine (batch 4, h128: the sm_90
    kernel where it runs); the portable kernel forced."""
    if route == "portable":
        monkeypatch.setenv("SPARSE_MLA_SM90", "0")
    new, got = captured_replay(*((2, 64) if route == "default" else (4, 128)), "triton")
    if route == "split":    # what the captured launch ran
        assert last_plan().combined
        assert split_kernel_name() == ("sm90_kernel" if hopper_with_sm90() else "_split_kernel")
    elif route == "portable":
        assert split_kernel_name() == "_split_kernel"
    check_decode(_run_decode(new, "reference"), got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(3))
def test_prefill_matches_reference(device, case):
    s_q, h, s_kv, topk = [(7, 4, 40, 128), (64, 128, 300, 256), (33, 16, 2048, 128)][case]
    if device == "cpu":
        s_q, h, s_kv, topk = min(s_q, 5), min(h, 4), min(s_kv, 64), 64
    a = prefill_case(device, s_q=s_q, h=h, s_kv=s_kv, topk=topk, seed=case)
    ro, rm, rl = flash_mla_sparse_fwd(impl="reference", **a)
    o, m, l = flash_mla_sparse_fwd(impl="triton", **a)
    check_prefill((ro, rm, rl), (o, m, l))


# V3.2 (d_qk 576) prefill: FlashMLA's case classes on CUDA, a tiny one in the interpreter.
V32_VARIANTS = {"plain": {}, "out_of_range": dict(out_of_range=True),
                "invalid_rows": dict(invalid_rows=3, out_of_range=True),
                "no_lengths": dict(lengths=False)}


def v32_prefill_params():
    """(class, variant) pairs: every class plain, the variants on two classes (budget)."""
    out = [(c[0], "plain") for c in V32_PREFILL_CLASSES]
    out += [(c, v) for c in ("irregular_skv", "sq1024_h64") for v in V32_VARIANTS if
            v != "plain"]
    out += [("sq1", "out_of_range")]
    return out


def v32_prefill_args(device, name, variant, seed=0):
    if device == "cpu":
        shape = dict(s_q=4, h=2, s_kv=80, topk=64)
        v = dict(V32_VARIANTS[variant])
        if "invalid_rows" in v:
            v["invalid_rows"] = 1
    else:
        c = next(c for c in V32_PREFILL_CLASSES if c[0] == name)
        shape = dict(zip(("s_q", "h", "s_kv", "topk"), c[1:]))
        v = V32_VARIANTS[variant]
    return v32_prefill_case(device, seed=seed, **shape, **v)


def _v32_triton_params():
    """CUDA devices run every (class, variant); the interpreter (CPU) two tiny ones."""
    out = []
    for d in DEVICES:
        dev = d.values[0]
        pairs = v32_prefill_params() if dev != "cpu" else [("regular", "plain"),
                                                           ("irregular_skv", "invalid_rows")]
        out += [pytest.param(dev, n, v, id=f"{d.id}-{n}-{v}", marks=d.marks) for n, v in pairs]
    return out


@pytest.mark.parametrize("device,name,variant", _v32_triton_params())
def test_v32_prefill_576_matches_reference(device, name, variant):
    a = v32_prefill_args(device, name, variant)
    ref = flash_mla_sparse_fwd(impl="reference", **a)
    got = flash_mla_sparse_fwd(impl="triton", **a)
    check_prefill(ref, got)
    if "invalid_rows" in variant:
        n = 3 if device != "cpu" else 1
        assert got[0][:n].eq(0).all() and got[2][:n].isinf().all() and (got[2][:n] > 0).all()
