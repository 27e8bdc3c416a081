"""The shared attention core's routes (ops/attention/launch.py, the split planner plan.py, and
the sm_90 kernel of ops/attention/sm90/): forced launch shapes and
split counts, padded block strides, the warp-specialized and 2-CTA cluster kernels, the
two-launch plan, tiny launches, the one-tile form, the capped combine, bf16 split partials, the
prefill epilogues. Each runs the core through the FlashMLA-semantics ops
(tests/ops/flashmla_decode's inputs and checks) and compares it with the reference.

Moved here from tests/ops/flashmla_decode/test_triton.py unchanged: everything from
``test_forced_launch_shapes_match_reference`` to that file's end.
"""
import dataclasses
import os

import pytest
import torch

import sparse_mla
from sparse_mla.ops.attention import plan
from sparse_mla.ops.attention.policy import DEFAULT
from sparse_mla.ops.common.dispatch import last_choice
from sparse_mla.ops.common import formats
from sparse_mla.ops.flashmla_decode import flash_mla_sparse_fwd
from sparse_mla.tests.helpers import (INTERPRETING, cuda_params, fake_device,
                                      force_tiny_launches, hopper_with_sm90, last_plan,
                                      record_results, split_kernel_name, use_policy)
from sparse_mla.tests.ops.flashmla_decode.cases import decode_case, prefill_case
from sparse_mla.tests.ops.flashmla_decode.test_triton import (DEVICES, _run_decode,
                                                              check_decode, check_prefill)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["v4", "v32"])
@pytest.mark.parametrize("n_splits,block_n,dv", [(1, 64, 1), (3, 64, 1), (7, 32, 1), (1, 32, 2),
                                                 (5, 32, 2), (40, 32, 2)])
def test_forced_launch_shapes_match_reference(device, fmt, n_splits, block_n, dv, request):
    """The launch picks its split count from a cost model and the output-dim split for tiny
    launches only; force 1, 3, 5, 7 and 40 splits (more than some tokens have tiles: empty
    splits; 40 is past the 32 the model allows tiny launches, where the combine kernel's
    one-step load spills) with and without the output-dim split, on ragged per-token
    lengths, so every way of cutting a token's two-source key list is checked whatever the
    model picks."""
    force_tiny_launches(request, False)
    use_policy(request, splits=n_splits,
               general=dataclasses.replace(DEFAULT.general, block_n=block_n, dv=dv))
    a = decode_case(device, b=3, s_q=2, h=24, topk=150, extra=True, extra_topk=70, seed=21,
                    fmt=fmt)
    check_decode(_run_decode(a, "reference"), _run_decode(a, "triton"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gluon", ["1", "0"])
def test_last_choice_names_the_kernel_file(device, gluon, monkeypatch, request):
    """After a call, ``last_choice``'s route names the file of the kernel that ran (README ->
    op -> route -> kernel file), and that file is there and holds that kernel."""
    monkeypatch.setenv("SPARSE_MLA_SM90", gluon)
    force_tiny_launches(request, False)
    a = decode_case(device, b=2, s_q=1, h=8, bs=64, topk=32, extra=True, extra_topk=16,
                    extra_bs=64, seed=5)
    _run_decode(a, "triton")
    choice = last_choice("flashmla_sparse_decode")
    path = choice.plan.kernel_file
    assert path in str(choice)
    sm90 = gluon == "1" and hopper_with_sm90()
    assert path == ("ops/attention/sm90/kernel.py" if sm90 else "ops/attention/portable.py")
    with open(os.path.join(os.path.dirname(os.path.abspath(sparse_mla.__file__)), path)) as f:
        kernel = "sm90_kernel" if sm90 else "_split_kernel"
        assert f"def {kernel}(" in f.read()
    if device != "cpu":     # (the interpreter compiles nothing)
        assert split_kernel_name() == kernel


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pad_bytes,aligned", [(0, True), (576 + 8, True), (4, False), (12, False)])
def test_padded_block_strides_match_reference(device, pad_bytes, aligned, monkeypatch):
    """V4 scale bytes are read as one int64 per row only when every block starts 8-byte
    aligned; page paddings of 4 or 12 bytes (strides stay 4-byte aligned, as the op requires)
    take the byte-wise path: the launcher's ``scales_aligned`` decides it. Both must agree
    with the reference (the poisoned padding is never read)."""
    from sparse_mla.ops.attention import launch as core
    a = decode_case(device, b=2, s_q=2, h=16, bs=53, topk=96, extra_bs=61, extra_topk=40,
                    seed=5, pad_bytes=pad_bytes)
    decided = record_results(monkeypatch, core, "scales_aligned")
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert decided == [aligned]     # one launch, its decision for both caches
    check_decode(ref, got)


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("b,s_q,h,bs,topk,etopk,n_splits,fmt", [
    (3, 2, 24, 53, 150, 70, 1, "v4"), (3, 2, 24, 53, 150, 70, 3, "v4"),
    (2, 1, 128, 61, 256, 512, 7, "v4"), (5, 3, 1, 2, 64, 0, 2, "v4"),
    (4, 1, 64, 64, 128, 1024, None, "v4"), (80, 2, 64, 256, 128, 512, None, "v4"),
    (3, 2, 24, 53, 150, 70, 1, "v32"), (3, 2, 24, 53, 150, 70, 3, "v32"),
    (2, 1, 128, 61, 256, 512, 7, "v32"), (5, 3, 1, 2, 64, 0, 2, "v32"),
    (4, 2, 128, 64, 2048, 0, None, "v32")])
def test_sm90_kernel_matches_reference(b, s_q, h, bs, topk, etopk, n_splits, fmt,
                                                   monkeypatch, request):
    """The sm_90 Gluon kernel (V4 and V3.2 caches) on poisoned caches, ragged lengths, ±inf
    sinks, forced and modelled split counts (some splits empty), every head count class, one
    and two sources; it must be what ran, and agree with the reference and the portable
    kernel."""
    force_tiny_launches(request, False)
    if n_splits is not None:
        use_policy(request, splits=n_splits)
    a = decode_case("cuda", b=b, s_q=s_q, h=h, fmt=fmt, bs=bs, topk=topk, extra=bool(etopk),
                    extra_topk=etopk or 64, extra_bs=64, seed=b + h, noncontig_q=h == 24)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == "sm90_kernel"
    if n_splits is not None:    # one split: the kernel's own epilogue, no combine launch
        assert last_plan().combined == (n_splits > 1)
    check_decode(ref, got)
    monkeypatch.setenv("SPARSE_MLA_SM90", "0")
    portable = _run_decode(a, "triton")
    assert split_kernel_name() == "_split_kernel"
    check_decode(ref, portable)


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("h", [128, 72])
@pytest.mark.parametrize("n_splits", [1, 3, 7])
@pytest.mark.parametrize("fmt", ["v4", "v32"])
def test_cluster_kernel_matches_one_cta_per_head_block(h, n_splits, fmt, monkeypatch, request):
    """V4 and V3.2 rows at 65-128 heads run as 2-CTA clusters, each CTA dequantizing half of
    every tile for both: on poisoned caches, ragged lengths (some splits empty) and a head
    count that leaves most of the second block masked, the output must agree with the
    reference and be bit-identical to one CTA per head block (the same arithmetic)."""
    force_tiny_launches(request, False)
    use_policy(request, splits=n_splits)
    a = decode_case("cuda", b=5, s_q=2, h=h, fmt=fmt, bs=64, topk=192, extra_bs=64,
                    extra_topk=512, seed=h + n_splits)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == "sm90_kernel"
    assert last_plan().kernel.packed_metadata[1] == 2       # launched as clusters of two
    check_decode(ref, got)
    use_policy(request, clusters=False)
    one = _run_decode(a, "triton")
    assert last_plan().kernel.packed_metadata[1] == 1
    assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("h", [128, 72])
def test_one_wave_of_short_v4_lists_runs_without_clusters(h, monkeypatch, request):
    """V4 rows at 65-128 heads over 3 key tiles a token (window 128 + 64 compressed rows, the
    C128A shape) in one wave run one CTA a head block (``plan.cluster_pays``); with the tile
    bound lowered they run as clusters, and the outputs are bit-identical."""
    force_tiny_launches(request, False)
    a = decode_case("cuda", b=5, s_q=2, h=h, fmt="v4", bs=64, topk=128, extra_bs=64,
                    extra_topk=64, seed=h)
    got = _run_decode(a, "triton")
    assert last_plan().route == "sm90" and last_plan().kernel.packed_metadata[1] == 1
    check_decode(_run_decode(a, "reference"), got)
    use_policy(request, cluster_v4_min_tiles=3)
    pair = _run_decode(a, "triton")
    assert last_plan().route == "sm90_cluster" and last_plan().kernel.packed_metadata[1] == 2
    assert torch.equal(got[0], pair[0]) and torch.equal(got[1], pair[1])


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("h", [64, 128, 72])
@pytest.mark.parametrize("programs", ["few", "over"])
@pytest.mark.parametrize("graph", [False, True])
def test_persistent_programs_match_one_program_a_token(h, programs, graph, monkeypatch,
                                                       request):
    """Persistent launches (ops/attention/sm90/persist.py: each program, or 2-CTA cluster,
    runs several tokens, its ring running on across them): on poisoned caches, ragged
    lengths with a token that has no key at all, ±inf sinks, at 64 heads and as clusters
    (72 heads: most of the second block masked), with fewer programs than tokens ("few": the
    card taken as 6 SMs, 6 or 3 tokens a program) and more programs than fit ("over": at most
    2 tokens a program), eager and replayed from a CUDA graph: the output must agree with the
    reference and be bit-identical to one program a token (the same arithmetic)."""
    a = decode_case("cuda", b=9, s_q=2, h=h, fmt="v4", bs=64, topk=192, extra_bs=64,
                    extra_topk=512, seed=h + len(programs))
    _check_persistent(a, h, programs, graph, monkeypatch, request)


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("h", [128, 72])
@pytest.mark.parametrize("programs", ["few", "over"])
@pytest.mark.parametrize("efmt", ["v41", "v41_fp4", "v4"])
def test_persistent_programs_over_v41_rows(h, programs, efmt, monkeypatch, request):
    """The same over DeepSeek-V4.1's 528 B main rows with 528 B, 288 B or 584 B extra rows,
    in 2-CTA clusters."""
    a = decode_case("cuda", b=9, s_q=2, h=h, fmt="v41", bs=32, topk=192, extra_bs=64,
                    extra_topk=512, seed=h + len(efmt), extra_fmt=efmt)
    _check_persistent(a, h, programs, False, monkeypatch, request)


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("h", [128, 72])
@pytest.mark.parametrize("programs", ["few", "over"])
@pytest.mark.parametrize("graph", [False, True])
def test_persistent_programs_over_v32_clusters(h, programs, graph, monkeypatch, request):
    """The same over V3.2's 656 B rows (576-wide keys, both sources) in 2-CTA clusters, the
    pair producer's staging a tile ahead running on across tokens."""
    a = decode_case("cuda", b=9, s_q=2, h=h, fmt="v32", bs=64, topk=192, extra_bs=64,
                    extra_topk=512, seed=h + len(programs) + 7)
    _check_persistent(a, h, programs, graph, monkeypatch, request)


def _check_persistent(a, h, programs, graph, monkeypatch, request):
    """``a`` (9 x 2 tokens) through a persistent launch, against the reference and against
    one program a token."""
    force_tiny_launches(request, False)
    fake_device(monkeypatch, sms=6)
    use_policy(request, splits=1)
    if programs == "over":
        use_policy(request, sm90=dataclasses.replace(DEFAULT.sm90, persist_tokens=2))
    b, s_q, n_hb = 9, 2, -(-h // 64)
    a["topk_length"][1] = 0
    a["extra_topk_length"][1] = 0       # batch row 1's tokens: no key, no tile
    run = (lambda: _replayed(a)) if graph else (lambda: _run_decode(a, "triton"))
    got = run()
    p = last_plan()
    slots = 6 // n_hb
    assert p.persist == (slots if programs == "few" else b * s_q // 2) > 0
    assert p.kernel.packed_metadata[1] == n_hb      # clusters of two at 72 and 128 heads
    assert (got[0][1].float().abs().amax() == 0) and got[1][1].isinf().all()
    check_decode(_run_decode(a, "reference"), got)
    use_policy(request, persistent=False)
    one = run()
    assert last_plan().persist == 0
    assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])


def _replayed(a):
    """``_run_decode(a, "triton")`` captured in a CUDA graph, then replayed into NaN-filled
    outputs."""
    _run_decode(a, "triton")        # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _run_decode(a, "triton")
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("h,cluster,fmt", [(128, True, "v4"), (128, False, "v4"),
                                           (64, False, "v4"), (128, True, "v32")])
def test_two_launch_plan_matches_reference(h, cluster, fmt, request):
    """``plan_phases``' two launches: the first tokens one program per unit (the kernel's own
    epilogue), the rest split, their partial rows numbered from their first token and merged
    by a combine launch for those tokens only; with and without clusters."""
    force_tiny_launches(request, False)
    use_policy(request, clusters=cluster, phases=((0, 3, 1), (3, None, 3)))
    a = decode_case("cuda", b=5, s_q=2, h=h, fmt=fmt, bs=64, topk=192, extra_bs=64,
                    extra_topk=512, seed=h)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == "sm90_kernel" and last_plan().combined
    check_decode(ref, got)


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("pad_bytes,kernel", [(0, "sm90_kernel"), (16, "sm90_kernel"),
                                              (4, "_split_kernel"), (8, "_split_kernel")])
def test_v32_block_alignment_routes_the_kernel(pad_bytes, kernel, monkeypatch, request):
    """The sm_90 kernel copies V3.2's RoPE dims with 16-byte cp.async, so it serves only caches
    whose blocks all start 16-byte aligned; 4- and 8-byte-aligned paddings take the portable
    kernel. Both read through the padded strides (the poisoned padding is never read)."""
    force_tiny_launches(request, False)
    a = decode_case("cuda", b=3, s_q=2, h=64, fmt="v32", bs=53, topk=96, extra_bs=61,
                    extra_topk=40, seed=7, pad_bytes=pad_bytes)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == kernel
    check_decode(ref, got)


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("bs,pad_bytes,extra_pad_bytes,staged", [
    (64, 0, 0, True), (53, 0, 0, True), (64, 16, 16, True), (64, 8, 8, False),
    (53, 8, 8, False), (64, 0, 8, False)])
def test_v4_block_alignment_picks_the_producer(bs, pad_bytes, extra_pad_bytes, staged,
                                               monkeypatch, request):
    """The sm_90 kernel gathers V4 rows by 16-byte cp.async through a staging buffer when
    every block of both caches starts 16-byte aligned (vLLM's pages are multiples of 576
    bytes), and by register loads when some block is only 8-byte aligned (8-byte paddings,
    one cache enough). Both producers must agree with the reference on poisoned, padded
    caches."""
    force_tiny_launches(request, False)
    a = decode_case("cuda", b=3, s_q=2, h=64, bs=bs, topk=96, extra_bs=61, extra_topk=40,
                    seed=bs + pad_bytes, pad_bytes=pad_bytes, extra_pad_bytes=extra_pad_bytes)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == "sm90_kernel"
    assert ("cp.async" in last_plan().kernel.asm["ptx"]) == staged
    check_decode(ref, got)


# UE8M0 scale bytes, seven per row (one per 64-dim group), from the bottom of the range
# (2^-127, a bf16 subnormal) to the largest that cannot overflow (246: 448 · 2^119 < bf16
# max); the last row's overflow to inf (247-254) or are inf (255)
EXTREME_SCALES = [0, 1, 2, 3, 6, 7, 8, 9, 10, 100, 117, 118, 119, 120, 126, 127, 128, 134,
                  135, 136, 140, 141, 160, 180, 200, 220, 240, 127, 241, 242, 243, 244, 245,
                  246, 1, 247, 248, 250, 252, 253, 254, 255]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["sm90_staged", "sm90_registers", "portable"])
def test_v4_extreme_scale_bytes_dequantize_exactly(device, route, monkeypatch, request):
    """With q = 0 and one usable key, the output is that key's dequantized row bit for bit
    (p = 1), so every finite e4m3 value times every scale 2^(s - 127) must round to bf16
    exactly as the reference's fp32 product does, subnormal results included. A row whose
    dequantized values overflow to ±inf (or are scaled by 255, inf) scores 0 · inf = NaN,
    so its token's output is NaN in both (a saturated finite value would score 0 and give
    a finite mean of the token's two rows). Each route's own
    dequantization: the sm_90 kernel's staged and register producers (bf16x2 multiply) and
    the portable kernel (fp32 multiply)."""
    ws = route.startswith("sm90")
    if ws and not hopper_with_sm90():
        pytest.skip("the warp-specialized kernel is sm_90 only")
    if ws:
        force_tiny_launches(request, False)
    else:
        monkeypatch.setenv("SPARSE_MLA_SM90", "0")
    b, s_q, h, bs, topk = 2, 3, 64, 16, 64
    a = decode_case(device, b=b, s_q=s_q, h=h, bs=bs, topk=topk, extra=False,
                    use_lengths=False, sink="none", seed=7,
                    pad_bytes=8 if route == "sm90_registers" else 0)
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
        assert split_kernel_name() == "sm90_kernel"
        assert ("cp.async" in last_plan().kernel.asm["ptx"]) == (route == "sm90_staged")
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
def test_one_tile_form_matches_the_loop(device, fmt, n_splits, one_tile, monkeypatch, request):
    """Splits of at most one key tile run the split kernel without its key loop
    (``ONE_TILE``): 8 tiles of 32 keys per token in 12 splits (some of them empty) or 8, and
    in 7 (some splits two tiles: the loop). With the form allowed and forbidden, both agree
    with the reference (NaN-poisoned rows, ragged lengths, sinks) and with each other bit
    for bit: the same arithmetic in the same order."""
    use_policy(request, splits=n_splits)
    force_tiny_launches(request, True)
    a = decode_case(device, b=2, s_q=2, h=24, topk=150, extra=True, extra_topk=70, seed=23,
                    fmt=fmt)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert last_plan().one_tile == one_tile
    if device == "cuda":
        assert split_kernel_name() == "_split_kernel"
    check_decode(ref, got)


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("b,s_q,h,extra_topk,kernel", [
    (2, 2, 128, 512, "sm90_kernel"), (1, 1, 72, 512, "sm90_kernel"),
    (1, 2, 64, 512, "_split_kernel"), (2, 2, 64, 512, "sm90_kernel"),
    (1, 2, 64, 896, "_split_kernel"), (1, 1, 64, 960, "sm90_kernel"),
    (1, 1, 64, 1024, "sm90_kernel")])
def test_tiny_launches_route_by_head_blocks(b, s_q, h, extra_topk, kernel):
    """Batch-1/2-sized launches: two head blocks go to the sm_90 kernel, one head block keeps
    the portable output-dim split only up to ``Policy.sm90_tiny_units`` / ``_tiles`` (2 units
    of at most 16 key tiles; the H200 measurements behind it), both through the combine
    kernel."""
    a = decode_case("cuda", b=b, s_q=s_q, h=h, bs=64, topk=128, extra=True,
                    extra_topk=extra_topk, extra_bs=64, seed=h + s_q)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    assert split_kernel_name() == kernel and last_plan().combined
    check_decode(ref, got)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="the combine is launched early (PDL) from sm_90 on")
@pytest.mark.parametrize("b,s_q,h,extra_topk", [(2, 2, 128, 1024), (2, 1, 64, 512)])
def test_capped_combine_matches_uncapped(b, s_q, h, extra_topk, monkeypatch, request):
    """Small early-launched combines run with at most ceil(CTAs / SMs) CTAs per SM
    (``Policy.combine_spread``): the same kernel and arithmetic as uncapped, so bit-identical
    outputs, both within tolerance of the reference."""
    from sparse_mla.ops.attention import launch as core
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
    use_policy(request, combine_spread=None)
    caps.clear()
    plain = _run_decode(a, "triton")
    assert caps == [] and last_plan().combined
    for x, y in zip(got, plain):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("h", [5, 24])
def test_tiny_launches_on_sm90_take_a_64_row_head_block(device, h, monkeypatch, request):
    """Tiny portable launches of V4 rows run 64 q rows per program on sm_90 whatever the
    head count (``Policy.tiny_head_block_sm90``, rows past h masked), elsewhere the smallest power
    of two that holds the heads; both blocks agree with the reference (NaN-poisoned rows,
    ragged lengths, sinks). CPU runs force the sm_90 choice to run it interpreted. (Plain
    bf16 rows keep 16-row blocks: tests/ops/trtllm_decode.)"""
    force_tiny_launches(request, True)
    a = decode_case(device, b=2, s_q=2, h=h, bs=53, topk=96, extra=True, extra_topk=40,
                    extra_bs=61, seed=30 + h)
    ref = _run_decode(a, "reference")
    blocks = record_results(monkeypatch, plan, "head_block")
    here = device != "cpu" and torch.cuda.get_device_capability(device)[0] == 9
    for sm90 in (None, False, True):    # None: this device's own answer
        if sm90 is not None:
            fake_device(monkeypatch, capability=(9, 0) if sm90 else (8, 0))
        blocks.clear()
        got = _run_decode(a, "triton")
        assert blocks == [64 if (here if sm90 is None else sm90) else (16 if h <= 16 else 32)]
        if device == "cuda":
            assert split_kernel_name() == "_split_kernel"
        check_decode(ref, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["portable", "ws"])
@pytest.mark.parametrize("n_splits", [1, 3])
def test_split_partials_bf16_by_default(device, route, n_splits, monkeypatch, request):
    """Tokens cut into several splits pass their partial rows to the combine kernel as bf16
    (``Policy.partials``), a launch of one split keeps fp32; either partial dtype, on either
    split kernel, agrees with the reference (sinks, ragged lengths, NaN-poisoned rows), and
    the two differ by at most the extra bf16 rounding of each partial."""
    from sparse_mla.ops.attention import launch as core
    if route == "ws":
        if not hopper_with_sm90():
            pytest.skip("the warp-specialized kernel is sm_90 only")
        force_tiny_launches(request, False)
    else:
        monkeypatch.setenv("SPARSE_MLA_SM90", "0")
    use_policy(request, splits=n_splits)
    made = record_results(monkeypatch, core, "_partials")
    a = decode_case(device, b=2, s_q=2, h=16, bs=53, topk=150, extra=True, extra_topk=70,
                    extra_bs=61, seed=11 + n_splits)
    ref = _run_decode(a, "reference")
    outs = {}
    for dtype in (torch.bfloat16, torch.float32):
        use_policy(request, partials=dtype)
        made.clear()
        outs[dtype] = _run_decode(a, "triton")
        if device == "cuda":
            assert split_kernel_name() == ("sm90_kernel" if route == "ws" else "_split_kernel")
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


@pytest.mark.skipif(not hopper_with_sm90(), reason="the warp-specialized kernel is sm_90 only")
@pytest.mark.parametrize("n_splits", [1, 2, "two launches"])
def test_warp_specialized_prefill_epilogues_match_reference(n_splits, monkeypatch, request):
    """Prefill through the sm_90 kernel with one split (it writes out, lse and max logits
    itself, sink applied), with two (partials + combine kernel), and as ``plan_phases``' two
    launches (both epilogues in one call); a query without keys, ±inf sinks, out-of-range
    indices, NaN rows past s_kv."""
    force_tiny_launches(request, False)
    if n_splits == "two launches":
        use_policy(request, phases=((0, 40, 1), (40, None, 3)))
        n_splits = 3
    else:
        use_policy(request, splits=n_splits)
    a = prefill_case("cuda", s_q=70, h=128, s_kv=700, topk=256, seed=n_splits)
    a["topk_length"][1] = 0
    a["attn_sink"][:2] = torch.tensor([float("inf"), float("-inf")])
    ro, rm, rl = flash_mla_sparse_fwd(impl="reference", **a)
    o, m, l = flash_mla_sparse_fwd(impl="triton", **a)
    assert split_kernel_name() == "sm90_kernel" and last_plan().combined == (n_splits > 1)
    check_prefill((ro, rm, rl), (o, m, l))


@pytest.mark.skipif(INTERPRETING, reason="interpreted kernels always take the software route")
@pytest.mark.parametrize("device", cuda_params())
@pytest.mark.parametrize("fmt", ["v4", "v32"])
@pytest.mark.parametrize("tiny", [True, False])
def test_software_e4m3_route_matches_reference(device, fmt, tiny, monkeypatch, request):
    """The route GPUs below sm_89 take (e4m3 decoded in integer arithmetic by the portable
    kernel), forced on this GPU (``SPARSE_MLA_SOFT_FP8=1``): the route says so, the portable
    kernel ran, and the outputs are the reference's."""
    monkeypatch.setenv("SPARSE_MLA_SOFT_FP8", "1")
    force_tiny_launches(request, tiny)
    a = decode_case(device, b=4, s_q=2, h=128, bs=64, topk=256, extra=True, extra_topk=128,
                    extra_bs=64, seed=17, fmt=fmt)
    ref = _run_decode(a, "reference")
    got = _run_decode(a, "triton")
    route = "tiny" if tiny else "portable"
    assert last_choice("flashmla_sparse_decode").route == f"{route}, software e4m3 (forced)"
    assert split_kernel_name() == "_split_kernel"
    check_decode(ref, got)
