"""Triton decode / prefill vs the reference with SPEC §9's tolerances (FlashMLA's own).

CUDA runs the production-like grid; the Triton interpreter (CPU, *_interpret_test) runs a
few tiny shapes of the same code.
"""
import pytest
import torch

from sparse_mla.ops.common import attention_plan as plan
from sparse_mla.ops.common import formats
from sparse_mla.ops.common.dispatch import last_choice
from sparse_mla.ops.flashmla_decode import flash_mla_sparse_fwd, flash_mla_with_kvcache
from sparse_mla.tests.helpers import (force_tiny_launches, gapped, hopper_with_gluon,
                                      last_plan, naming, record_results, requires_cuda,
                                      split_kernel_name, triton_params)
from sparse_mla.tests.ops.flashmla_decode.cases import (cache_view, decode_case,
                                                        out_of_cache_ids, plant, prefill_case)

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
    """SPEC §9's decode tolerances (FlashMLA's tests): elementwise, then ``cosine`` on the
    whole output (None: not checked)."""
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
    (5, 2, 16, 256, None, 192, 0, "v32")]
# On sm_90 these GPU_GRID shapes are tiny launches that stay on the portable kernel (one head
# block, at most WS_TINY's units and tiles); every other one runs the sm_90 kernel
SM90_PORTABLE_CASES = {0, 7}
CPU_GRID = [(2, 2, 3, 61, 2, 64, 32, "v4"), (1, 1, 16, 2, 53, 32, 0, "v4"),
            (2, 1, 5, 53, 2, 32, 16, "v32")]


def _grid(device):
    return CPU_GRID if device == "cpu" else GPU_GRID


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["auto", "portable"])
@pytest.mark.parametrize("case", range(len(GPU_GRID)))
def test_decode_matches_reference(device, route, case, monkeypatch):
    """Every grid shape through the automatic route and, on a GPU, through the portable
    kernel alone (``SPARSE_MLA_GLUON=0``), asserting which split kernel ran."""
    grid = _grid(device)
    if case >= len(grid):
        pytest.skip(f"the {device} grid has {len(grid)} shapes")
    if route == "portable":
        if device == "cpu":
            pytest.skip("the interpreter runs the portable kernel on the automatic route")
        monkeypatch.setenv("SPARSE_MLA_GLUON", "0")
    b, s_q, h, bs, ebs, topk, etopk, fmt = grid[case]
    a = decode_case(device, b=b, s_q=s_q, h=h, fmt=fmt, bs=bs, topk=topk, extra=bool(etopk),
                    extra_bs=ebs or 2, extra_topk=etopk or 64, seed=case,
                    noncontig_q=case % 2 == 1)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert last_choice("flashmla_sparse_decode").impl == "triton"
    if device == "cuda":
        sm90 = route == "auto" and hopper_with_gluon() and case not in SM90_PORTABLE_CASES
        assert split_kernel_name() == ("_ws_kernel" if sm90 else "_split_kernel")
    check_decode(ref, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gluon", ["1", "0"])
def test_last_choice_reports_the_kernel_route(device, gluon, monkeypatch):
    """After a call, ``last_choice`` says which kernel route ran and why (the launch plan the
    core returned): the sm_90 routes only where the Gluon kernel runs, with the reason for
    the portable kernel otherwise; the plan's kernel is the one that ran."""
    monkeypatch.setenv("SPARSE_MLA_GLUON", gluon)
    force_tiny_launches(monkeypatch, False)
    cuda = device == "cuda"
    a = decode_case(device, b=3 if cuda else 2, s_q=2 if cuda else 1, h=128 if cuda else 8,
                    bs=64, topk=128 if cuda else 32, extra=True, extra_topk=64 if cuda else 16,
                    extra_bs=64, seed=5)
    ref = _run_decode(a, "reference")
    assert last_choice("flashmla_sparse_decode").route == "reference"
    got = _run_decode(a, "triton")
    choice = last_choice("flashmla_sparse_decode")
    p = choice.plan
    assert choice.route == p.route and p is last_plan() and p.reason
    assert p.route in plan.ROUTES and p.route in str(choice) and p.reason in str(choice)
    assert p.phases and len(p.kernels) == len(p.phases)
    sm90 = gluon == "1" and hopper_with_gluon()
    assert (p.route in ("sm90", "sm90_cluster")) == sm90
    if sm90:    # V4 rows at 128 heads, 12 units: the 2-CTA cluster
        assert p.route == "sm90_cluster" and split_kernel_name() == "_ws_kernel"
    else:
        assert p.route == "portable"
        if cuda:    # (the interpreter compiles nothing)
            assert split_kernel_name() == "_split_kernel"
        assert ("SPARSE_MLA_GLUON=0" in p.reason) == (gluon == "0")
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
        monkeypatch.setenv("SPARSE_MLA_GLUON", "0")
    new, got = captured_replay(*((2, 64) if route == "default" else (4, 128)), "triton")
    if route == "split":    # what the captured launch ran
        assert last_plan().combined
        assert split_kernel_name() == ("_ws_kernel" if hopper_with_gluon() else "_split_kernel")
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["v4", "v32"])
@pytest.mark.parametrize("n_splits,block_n,dv", [(1, 64, 1), (3, 64, 1), (7, 32, 1), (1, 32, 2),
                                                 (5, 32, 2), (40, 32, 2)])
def test_forced_launch_shapes_match_reference(device, fmt, n_splits, block_n, dv, monkeypatch):
    """The launch picks its split count from a cost model and the output-dim split for tiny
    launches only; force 1, 3, 5, 7 and 40 splits (more than some tokens have tiles: empty
    splits; 40 is past the 32 the model allows tiny launches, where the combine kernel's
    one-step load spills) with and without the output-dim split, on ragged per-token
    lengths, so every way of cutting a token's two-source key list is checked whatever the
    model picks."""
    monkeypatch.setattr(plan, "choose_splits", lambda *args: n_splits)
    force_tiny_launches(monkeypatch, False)
    monkeypatch.setitem(plan.CONFIG, "block_n", block_n)
    monkeypatch.setitem(plan.CONFIG, "dv", dv)
    a = decode_case(device, b=3, s_q=2, h=24, topk=150, extra=True, extra_topk=70, seed=21,
                    fmt=fmt)
    check_decode(_run_decode(a, "reference"), _run_decode(a, "triton"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pad_bytes,aligned", [(0, True), (576 + 8, True), (4, False), (12, False)])
def test_padded_block_strides_match_reference(device, pad_bytes, aligned):
    """V4 scale bytes are read as one int64 per row only when every block starts 8-byte
    aligned; page paddings of 4 or 12 bytes (strides stay 4-byte aligned, as the op requires)
    take the byte-wise path. Both must agree with the reference (the poisoned padding is
    never read)."""
    from sparse_mla.ops.common import sparse_attention_triton as core
    from sparse_mla.ops.flashmla_decode.ops import _decode_sources
    a = decode_case(device, b=2, s_q=2, h=16, bs=53, topk=96, extra_bs=61, extra_topk=40,
                    seed=5, pad_bytes=pad_bytes)
    srcs = _decode_sources(a["k_cache"], a["indices"], a["topk_length"], a["extra_k_cache"],
                           a["extra_indices_in_kvcache"], a["extra_topk_length"], "v4", 53, 61)
    assert all(core._scales_aligned(s) for s in srcs) == aligned
    check_decode(_run_decode(a, "reference"), _run_decode(a, "triton"))


@pytest.mark.skipif(not hopper_with_gluon(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("b,s_q,h,bs,topk,etopk,n_splits,fmt", [
    (3, 2, 24, 53, 150, 70, 1, "v4"), (3, 2, 24, 53, 150, 70, 3, "v4"),
    (2, 1, 128, 61, 256, 512, 7, "v4"), (5, 3, 1, 2, 64, 0, 2, "v4"),
    (4, 1, 64, 64, 128, 1024, None, "v4"), (80, 2, 64, 256, 128, 512, None, "v4"),
    (3, 2, 24, 53, 150, 70, 1, "v32"), (3, 2, 24, 53, 150, 70, 3, "v32"),
    (2, 1, 128, 61, 256, 512, 7, "v32"), (5, 3, 1, 2, 64, 0, 2, "v32"),
    (4, 2, 128, 64, 2048, 0, None, "v32")])
def test_warp_specialized_kernel_matches_reference(b, s_q, h, bs, topk, etopk, n_splits, fmt,
                                                   monkeypatch):
    """The sm_90 Gluon kernel (V4 and V3.2 caches) on poisoned caches, ragged lengths, ±inf
    sinks, forced and modelled split counts (some splits empty), every head count class, one
    and two sources; it must be what ran, and agree with the reference and the portable
    kernel."""
    force_tiny_launches(monkeypatch, False)
    if n_splits is not None:
        monkeypatch.setattr(plan, "choose_splits", lambda *args: n_splits)
    a = decode_case("cuda", b=b, s_q=s_q, h=h, fmt=fmt, bs=bs, topk=topk, extra=bool(etopk),
                    extra_topk=etopk or 64, extra_bs=64, seed=b + h, noncontig_q=h == 24)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == "_ws_kernel"
    if n_splits is not None:    # one split: the kernel's own epilogue, no combine launch
        assert last_plan().combined == (n_splits > 1)
    check_decode(ref, got)
    monkeypatch.setenv("SPARSE_MLA_GLUON", "0")
    portable = _run_decode(a, "triton")
    assert split_kernel_name() == "_split_kernel"
    check_decode(ref, portable)


@pytest.mark.skipif(not hopper_with_gluon(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("h", [128, 72])
@pytest.mark.parametrize("n_splits", [1, 3, 7])
@pytest.mark.parametrize("fmt", ["v4", "v32"])
def test_cluster_kernel_matches_one_cta_per_head_block(h, n_splits, fmt, monkeypatch):
    """V4 and V3.2 rows at 65-128 heads run as 2-CTA clusters, each CTA dequantizing half of
    every tile for both: on poisoned caches, ragged lengths (some splits empty) and a head
    count that leaves most of the second block masked, the output must agree with the
    reference and be bit-identical to one CTA per head block (the same arithmetic)."""
    from sparse_mla.ops.common import sparse_attention_gluon as g
    force_tiny_launches(monkeypatch, False)
    monkeypatch.setattr(plan, "choose_splits", lambda *args: n_splits)
    a = decode_case("cuda", b=5, s_q=2, h=h, fmt=fmt, bs=64, topk=192, extra_bs=64,
                    extra_topk=512, seed=h + n_splits)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == "_ws_kernel"
    assert last_plan().kernel.packed_metadata[1] == 2       # launched as clusters of two
    check_decode(ref, got)
    monkeypatch.setattr(g, "CLUSTER_V4" if fmt == "v4" else "CLUSTER_V32", False)
    one = _run_decode(a, "triton")
    assert last_plan().kernel.packed_metadata[1] == 1
    assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])


@pytest.mark.skipif(not hopper_with_gluon(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("h,cluster,fmt", [(128, True, "v4"), (128, False, "v4"),
                                           (64, False, "v4"), (128, True, "v32")])
@pytest.mark.parametrize("pdl", [True, False])
def test_two_launch_plan_matches_reference(h, cluster, fmt, pdl, monkeypatch):
    """``plan_phases``' two launches: the first tokens one program per unit (the kernel's own
    epilogue), the rest split, their partial rows numbered from their first token and merged
    by a combine launch for those tokens only; with and without clusters and PDL."""
    from sparse_mla.ops.common import sparse_attention_gluon as g
    from sparse_mla.ops.common import sparse_attention_triton as core
    force_tiny_launches(monkeypatch, False)
    monkeypatch.setattr(core, "PDL", pdl)
    monkeypatch.setattr(g, "CLUSTER_V4", cluster)
    monkeypatch.setattr(g, "CLUSTER_V32", cluster)
    monkeypatch.setattr(plan, "plan_phases", lambda T, *args: [(0, 3, 1), (3, T, 3)])
    a = decode_case("cuda", b=5, s_q=2, h=h, fmt=fmt, bs=64, topk=192, extra_bs=64,
                    extra_topk=512, seed=h + pdl)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == "_ws_kernel" and last_plan().combined
    check_decode(ref, got)


@pytest.mark.skipif(not hopper_with_gluon(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("pad_bytes,kernel", [(0, "_ws_kernel"), (16, "_ws_kernel"),
                                              (4, "_split_kernel"), (8, "_split_kernel")])
def test_v32_block_alignment_routes_the_kernel(pad_bytes, kernel, monkeypatch):
    """The sm_90 kernel copies V3.2's RoPE dims with 16-byte cp.async, so it serves only caches
    whose blocks all start 16-byte aligned; 4- and 8-byte-aligned paddings take the portable
    kernel. Both read through the padded strides (the poisoned padding is never read)."""
    force_tiny_launches(monkeypatch, False)
    a = decode_case("cuda", b=3, s_q=2, h=64, fmt="v32", bs=53, topk=96, extra_bs=61,
                    extra_topk=40, seed=7, pad_bytes=pad_bytes)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == kernel
    check_decode(ref, got)


@pytest.mark.skipif(not hopper_with_gluon(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("bs,pad_bytes,extra_pad_bytes,staged", [
    (64, 0, 0, True), (53, 0, 0, True), (64, 16, 16, True), (64, 8, 8, False),
    (53, 8, 8, False), (64, 0, 8, False)])
def test_v4_block_alignment_picks_the_producer(bs, pad_bytes, extra_pad_bytes, staged,
                                               monkeypatch):
    """The sm_90 kernel gathers V4 rows by 16-byte cp.async through a staging buffer when
    every block of both caches starts 16-byte aligned (vLLM's pages are multiples of 576
    bytes), and by register loads when some block is only 8-byte aligned (8-byte paddings,
    one cache enough). Both producers must agree with the reference on poisoned, padded
    caches."""
    force_tiny_launches(monkeypatch, False)
    a = decode_case("cuda", b=3, s_q=2, h=64, bs=bs, topk=96, extra_bs=61, extra_topk=40,
                    seed=bs + pad_bytes, pad_bytes=pad_bytes, extra_pad_bytes=extra_pad_bytes)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == "_ws_kernel"
    assert ("cp.async" in last_plan().kernel.asm["ptx"]) == staged
    check_decode(ref, got)


# UE8M0 scale bytes, seven per row (one per 64-dim group), from the bottom of the range
# (2^-127, a bf16 subnormal) to the largest that cannot overflow (246: 448 · 2^119 < bf16
# max); the last row's overflow to inf (247-254) or are inf (255)
EXTREME_SCALES = [0, 1, 2, 3, 6, 7, 8, 9, 10, 100, 117, 118, 119, 120, 126, 127, 128, 134,
                  135, 136, 140, 141, 160, 180, 200, 220, 240, 127, 241, 242, 243, 244, 245,
                  246, 1, 247, 248, 250, 252, 253, 254, 255]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["ws_staged", "ws_registers", "portable"])
def test_v4_extreme_scale_bytes_dequantize_exactly(device, route, monkeypatch):
    """With q = 0 and one usable key, the output is that key's dequantized row bit for bit
    (p = 1), so every finite e4m3 value times every scale 2^(s - 127) must round to bf16
    exactly as the reference's fp32 product does, subnormal results included. A row whose
    dequantized values overflow to ±inf (or are scaled by 255, inf) scores 0 · inf = NaN,
    so its token's output is NaN in both (a saturated finite value would score 0 and give
    a finite mean of the token's two rows). Each route's own
    dequantization: the sm_90 kernel's staged and register producers (bf16x2 multiply) and
    the portable kernel (fp32 multiply)."""
    ws = route.startswith("ws")
    if ws and not hopper_with_gluon():
        pytest.skip("the warp-specialized kernel is sm_90 only")
    if ws:
        force_tiny_launches(monkeypatch, False)
    else:
        monkeypatch.setenv("SPARSE_MLA_GLUON", "0")
    b, s_q, h, bs, topk = 2, 3, 64, 16, 64
    a = decode_case(device, b=b, s_q=s_q, h=h, bs=bs, topk=topk, extra=False,
                    use_lengths=False, sink="none", seed=7,
                    pad_bytes=8 if route == "ws_registers" else 0)
    a["q"].zero_()
    tokens = b * s_q
    rows = torch.arange(5, 5 + 3 * tokens, 3, dtype=torch.int32)      # one row per token
    idx = torch.full((tokens, topk), -1, dtype=torch.int32)
    idx[torch.arange(tokens), torch.arange(tokens) * 13 % topk] = rows
    # the overflowing row's token also sees token 0's finite row, so its NaN comes from the
    # inf values alone (with no finite score the kernels read the row as empty: see note)
    idx[-1, 0] = rows[0]
    a["indices"] = idx.view(b, s_q, topk).to(device)
    cache, fmt = a["k_cache"], formats.get_format("v4")
    page = cache.view(torch.uint8).view(cache.shape[0], -1)
    g = torch.Generator().manual_seed(3)
    finite = torch.tensor([v for v in range(256) if v & 0x7F != 0x7F], dtype=torch.uint8)
    scales = torch.tensor(EXTREME_SCALES, dtype=torch.uint8).view(tokens, 7)
    for t, r in enumerate(rows.tolist()):
        blk, off = divmod(r, bs)
        d0 = fmt.token_data_addr(bs, off)
        page[blk, d0:d0 + 448] = finite[torch.randint(0, len(finite), (448,), generator=g)].to(
            device)
        s0 = fmt.token_scale_addr(bs, off)
        page[blk, s0:s0 + 7] = scales[t].to(device)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    if ws:
        assert split_kernel_name() == "_ws_kernel"
        assert ("cp.async" in last_plan().kernel.asm["ptx"]) == (route == "ws_staged")
    elif device == "cuda":
        assert split_kernel_name() == "_split_kernel"
    (ro, rl), (o, l) = ref, got
    sub = ro[:, :, :, :448].abs()
    assert ((sub > 0) & (sub < 2.0 ** -126)).any()      # subnormal results were exercised
    nan = ro.isnan()
    assert nan[-1, -1].all() and not nan[:, :-1].any() and not nan[0].any()
    assert torch.equal(o.isnan(), nan)
    assert torch.equal(o[~nan].float(), ro[~nan].float())     # exact (-0 == +0)
    torch.testing.assert_close(l, rl, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["v4", "v32"])
@pytest.mark.parametrize("n_splits,one_tile", [(12, True), (8, True), (7, False)])
def test_one_tile_form_matches_the_loop(device, fmt, n_splits, one_tile, monkeypatch):
    """Splits of at most one key tile run the split kernel without its key loop
    (``ONE_TILE``): 8 tiles of 32 keys per token in 12 splits (some of them empty) or 8, and
    in 7 (some splits two tiles: the loop). With the form allowed and forbidden, both agree
    with the reference (NaN-poisoned rows, ragged lengths, sinks) and with each other bit
    for bit: the same arithmetic in the same order."""
    monkeypatch.setattr(plan, "choose_splits", lambda *args: n_splits)
    force_tiny_launches(monkeypatch, True)
    a = decode_case(device, b=2, s_q=2, h=24, topk=150, extra=True, extra_topk=70, seed=23,
                    fmt=fmt)
    ref = _run_decode(a, "reference")
    forms = record_results(monkeypatch, plan, "one_tile")
    outs = []
    for allowed in (True, False):
        monkeypatch.setattr(plan, "ONE_TILE_FORM", allowed)
        forms.clear()
        outs.append(_run_decode(a, "triton"))
        assert forms == [allowed and one_tile]
        if device == "cuda":
            assert split_kernel_name() == "_split_kernel"
        check_decode(ref, outs[-1])
    for x, y in zip(*outs):
        assert torch.equal(x, y)


@pytest.mark.skipif(not hopper_with_gluon(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("b,s_q,h,extra_topk,kernel", [
    (2, 2, 128, 512, "_ws_kernel"), (1, 1, 72, 512, "_ws_kernel"),
    (1, 2, 64, 512, "_split_kernel"), (2, 2, 64, 512, "_ws_kernel"),
    (1, 2, 64, 896, "_split_kernel"), (1, 1, 64, 960, "_ws_kernel"),
    (1, 1, 64, 1024, "_ws_kernel")])
def test_tiny_launches_route_by_head_blocks(b, s_q, h, extra_topk, kernel, pdl, monkeypatch):
    """Batch-1/2-sized launches: two head blocks go to the sm_90 kernel, one head block keeps
    the portable output-dim split only up to ``WS_TINY`` (2 units of at most 16 key tiles;
    the H200 measurements behind it), both through the combine kernel launched with and
    without programmatic dependent launch."""
    from sparse_mla.ops.common import sparse_attention_triton as core
    monkeypatch.setattr(core, "PDL", pdl)
    a = decode_case("cuda", b=b, s_q=s_q, h=h, bs=64, topk=128, extra=True,
                    extra_topk=extra_topk, extra_bs=64, seed=h + s_q)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == kernel and last_plan().combined
    check_decode(ref, got)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the combine is launched early (PDL) from sm_90 on")
@pytest.mark.parametrize("b,s_q,h,extra_topk", [(2, 2, 128, 1024), (2, 1, 64, 512)])
def test_capped_combine_matches_uncapped(b, s_q, h, extra_topk, monkeypatch):
    """Small early-launched combines run with at most ceil(CTAs / SMs) CTAs per SM
    (``COMBINE_SPREAD``): the same kernel and arithmetic as uncapped, so bit-identical
    outputs, both within tolerance of the reference."""
    from sparse_mla.ops.common import sparse_attention_triton as core
    caps = []
    real = core.launch_capped
    monkeypatch.setattr(core, "launch_capped", lambda *args: caps.append(args[-1]) or real(*args))
    a = decode_case("cuda", b=b, s_q=s_q, h=h, bs=64, topk=128, extra=True,
                    extra_topk=extra_topk, extra_bs=64, seed=b + h)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert last_plan().combined and caps == [-(-b * s_q * h // sms)]
    check_decode(ref, got)
    monkeypatch.setattr(core, "COMBINE_SPREAD", None)
    caps.clear()
    plain = _run_decode(a, "triton")
    assert caps == [] and last_plan().combined
    for x, y in zip(got, plain):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("h", [5, 24])
def test_tiny_launches_on_sm90_take_a_64_row_head_block(device, h, monkeypatch):
    """Tiny portable launches of V4 rows run 64 q rows per program on sm_90 whatever the
    head count (``SMALL_HEAD_BLOCK_SM90``, rows past h masked), elsewhere the smallest power
    of two that holds the heads; both blocks agree with the reference (NaN-poisoned rows,
    ragged lengths, sinks). CPU runs force the sm_90 choice to run it interpreted. (Plain
    bf16 rows keep 16-row blocks: tests/ops/trtllm_decode.)"""
    force_tiny_launches(monkeypatch, True)
    a = decode_case(device, b=2, s_q=2, h=h, bs=53, topk=96, extra=True, extra_topk=40,
                    extra_bs=61, seed=30 + h)
    ref = _run_decode(a, "reference")
    blocks = record_results(monkeypatch, plan, "head_block")
    here = device != "cpu" and torch.cuda.get_device_capability(device)[0] == 9
    for sm90 in (None, False, True):    # None: this device's own answer
        if sm90 is not None:
            monkeypatch.setattr(plan, "_wgmma_device", lambda dev, sm90=sm90: sm90)
        blocks.clear()
        got = _run_decode(a, "triton")
        assert blocks == [64 if (here if sm90 is None else sm90) else (16 if h <= 16 else 32)]
        if device == "cuda":
            assert split_kernel_name() == "_split_kernel"
        check_decode(ref, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["portable", "ws"])
@pytest.mark.parametrize("n_splits", [1, 3])
def test_split_partials_bf16_by_default(device, route, n_splits, monkeypatch):
    """Tokens cut into several splits pass their partial rows to the combine kernel as bf16
    (``PARTIAL_DTYPE``), a launch of one split keeps fp32; either partial dtype, on either
    split kernel, agrees with the reference (sinks, ragged lengths, NaN-poisoned rows), and
    the two differ by at most the extra bf16 rounding of each partial."""
    from sparse_mla.ops.common import sparse_attention_triton as core
    if route == "ws":
        if not hopper_with_gluon():
            pytest.skip("the warp-specialized kernel is sm_90 only")
        force_tiny_launches(monkeypatch, False)
    else:
        monkeypatch.setenv("SPARSE_MLA_GLUON", "0")
    monkeypatch.setattr(plan, "choose_splits", lambda *args: n_splits)
    made = record_results(monkeypatch, core, "_partials")
    a = decode_case(device, b=2, s_q=2, h=16, bs=53, topk=150, extra=True, extra_topk=70,
                    extra_bs=61, seed=11 + n_splits)
    ref = _run_decode(a, "reference")
    outs = {}
    for dtype in (torch.bfloat16, torch.float32):
        monkeypatch.setattr(core, "PARTIAL_DTYPE", dtype)
        made.clear()
        outs[dtype] = _run_decode(a, "triton")
        if device == "cuda":
            assert split_kernel_name() == ("_ws_kernel" if route == "ws" else "_split_kernel")
        assert last_plan().combined == (route == "portable" or n_splits > 1)
        if last_plan().combined:
            assert made[-1][0].dtype == (dtype if n_splits > 1 else torch.float32)
        check_decode(ref, outs[dtype])
    o16, o32 = outs[torch.bfloat16][0].float(), outs[torch.float32][0].float()
    if n_splits == 1:
        assert torch.equal(o16, o32)
    else:
        torch.testing.assert_close(o16, o32, rtol=2 ** -7, atol=2 ** -8 * float(o32.abs().max()))
    torch.testing.assert_close(outs[torch.bfloat16][1], outs[torch.float32][1], atol=0, rtol=0)


@pytest.mark.skipif(not hopper_with_gluon(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("n_splits", [1, 2, "two launches"])
def test_warp_specialized_prefill_epilogues_match_reference(n_splits, monkeypatch):
    """Prefill through the sm_90 kernel with one split (it writes out, lse and max logits
    itself, sink applied), with two (partials + combine kernel), and as ``plan_phases``' two
    launches (both epilogues in one call); a query without keys, ±inf sinks, out-of-range
    indices, NaN rows past s_kv."""
    force_tiny_launches(monkeypatch, False)
    if n_splits == "two launches":
        monkeypatch.setattr(plan, "plan_phases", lambda T, *args: [(0, 40, 1), (40, T, 3)])
        n_splits = 3
    else:
        monkeypatch.setattr(plan, "choose_splits", lambda *args: n_splits)
    a = prefill_case("cuda", s_q=70, h=128, s_kv=700, topk=256, seed=n_splits)
    a["topk_length"][1] = 0
    a["attn_sink"][:2] = torch.tensor([float("inf"), float("-inf")])
    ro, rm, rl = flash_mla_sparse_fwd(impl="reference", **a)
    o, m, l = flash_mla_sparse_fwd(impl="triton", **a)
    assert split_kernel_name() == "_ws_kernel" and last_plan().combined == (n_splits > 1)
    check_prefill((ro, rm, rl), (o, m, l))
