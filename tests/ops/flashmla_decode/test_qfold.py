"""The q fold of ``flashmla_sparse_decode`` (``q_positions`` / ``cos_sin_cache`` /
``q_norm_eps``): raw q normed and rotated by the kernel as it loads it.

The oracle of the fold is the unfused path run as the backends ran it: the fused insert's q
(``qnorm_rope_kv_insert_v4``, its own tests pin it to docs/semantics.md §3.1 byte for byte)
handed to the same decode op. The fold reproduces that q's bf16 rounding, so the Triton
routes must give the unfused path's outputs bit for bit, and the reference route (which
applies the unfused reference ops) the reference's within the decode tolerances.
"""
import pytest
import torch

from sparse_mla.ops import cache_insert as ci
from sparse_mla.ops.common import formats
from sparse_mla.ops.flashmla_decode import flash_mla_with_kvcache
from sparse_mla.tests.helpers import (force_tiny_launches, hopper_with_gluon, split_kernel_name,
                                      triton_params)
from sparse_mla.tests.ops.flashmla_decode.cases import decode_case
from sparse_mla.tests.ops.flashmla_decode.test_triton import check_decode

DEVICES = triton_params()
MAX_POS = 70_000


def cos_sin_table(n, device):
    """A RoPE table [n, 64] fp32 (cos[0:32] || sin[0:32]) of the usual inverse frequencies."""
    inv = 1.0 / 10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.sin()], -1).float().to(device)


def raw_q(q, g, nan_heads=0):
    """A raw q like ``q`` ([b, s_q, h, 512]) but of a model's scale (norms far from 1, so a
    missing or wrong norm shows), as a view of a buffer whose ``nan_heads`` heads past the
    real ones are NaN (a kernel reading past the heads poisons its rows)."""
    b, s_q, h, d = q.shape
    buf = torch.full((b, s_q, h + nan_heads, d), float("nan"))
    buf[:, :, :h] = torch.randn(b, s_q, h, d, generator=g) * 4 + 0.5
    return buf.to(torch.bfloat16).to(q.device)[:, :, :h]


def positions_for(b, s_q, g, device):
    """Row positions: 0, the table's last row and random ones between."""
    pos = torch.randint(0, MAX_POS, (b, s_q), generator=g)
    pos.view(-1)[0] = 0
    pos.view(-1)[-1] = MAX_POS - 1
    return pos.to(device)


def unfused_q(q, positions, cos_sin, eps):
    """q as the unfused path hands it to the decode op: the fused insert's q_out (no kv rows
    written: an empty slot mapping)."""
    b, s_q, h, d = q.shape
    flat = q.reshape(b * s_q, h, d)
    cache = torch.zeros(1, formats.V4.page_bytes(64), dtype=torch.uint8, device=q.device)
    none = torch.empty(0, dtype=torch.int64, device=q.device)
    kv = torch.zeros(b * s_q, d, dtype=torch.bfloat16, device=q.device)
    if eps is None:
        out = ci.rope_kv_insert_v41(flat, kv, cache, none, positions.reshape(-1), cos_sin,
                                    block_size=64, cache_format="v4")
    else:
        out = ci.qnorm_rope_kv_insert_v4(flat, kv, cache, none, positions.reshape(-1), cos_sin,
                                         eps=eps, block_size=64)
    return out.view(b, s_q, h, d)


def _decode(a, q, impl, **fold):
    a = dict(a)
    a.pop("q")
    cache, idx = a.pop("k_cache"), a.pop("indices")
    return flash_mla_with_kvcache(q, cache, idx, impl=impl, **a, **fold)


def _fold_case(device, seed, eps=1e-6, nan_heads=0, fmt="v4", **shape):
    a = decode_case(device, seed=seed, fmt=fmt, **shape)
    g = torch.Generator().manual_seed(seed + 100)
    q = raw_q(a["q"], g, nan_heads)
    b, s_q = q.shape[:2]
    pos = positions_for(b, s_q, g, device)
    cs = cos_sin_table(MAX_POS, device)
    fold = dict(q_positions=pos, cos_sin_cache=cs, q_norm_eps=eps)
    return a, q, fold, unfused_q(q, pos, cs, eps)


def _assert_same(got, want):
    for x, y in zip(got, want):
        assert torch.equal(x.isnan(), y.isnan())
        assert torch.equal(x.nan_to_num(), y.nan_to_num()), \
            f"max |diff| {(x.float() - y.float()).abs().nan_to_num().max()}"


CPU_SHAPES = [dict(b=2, s_q=2, h=3, bs=61, topk=32, extra_topk=16),
              dict(b=1, s_q=1, h=16, bs=2, topk=32, extra=False)]
GPU_SHAPES = [dict(b=4, s_q=1, h=64, bs=64, topk=128, extra_topk=128),
              dict(b=3, s_q=2, h=128, bs=64, topk=128, extra_topk=64),
              dict(b=40, s_q=1, h=64, bs=64, topk=512, extra_topk=128),
              dict(b=20, s_q=1, h=128, bs=64, topk=256, extra_topk=64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiny", [False, True])
@pytest.mark.parametrize("case", range(len(GPU_SHAPES)))
def test_fold_is_the_unfused_path_bit_for_bit(device, tiny, case, monkeypatch, request):
    """Triton with the fold == Triton on the fused insert's q, outputs and lse bit for bit
    (the general and the tiny launch shape; pad heads within a head block; NaN past them);
    and the reference route with the fold within the decode tolerances of it."""
    shapes = CPU_SHAPES if device == "cpu" else GPU_SHAPES
    if case >= len(shapes):
        pytest.skip(f"the {device} grid has {len(shapes)} shapes")
    force_tiny_launches(request, tiny)
    a, q, fold, q_rot = _fold_case(device, case, nan_heads=2, **shapes[case])
    want = _decode(a, q_rot, "triton")
    got = _decode(a, q, "triton", **fold)
    if device != "cpu" and hopper_with_gluon() and not tiny:
        assert split_kernel_name() == "_ws_kernel"
    _assert_same(got, want)
    check_decode(_decode(a, q, "reference", **fold), got)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_only_fold_over_v41_rows(device):
    """``q_norm_eps=None`` (DeepSeek-V4.1: RoPE, no norm) over 528 B rows: bit for bit the
    V4.1 insert's q through the same kernel."""
    a, q, fold, q_rot = _fold_case(device, 7, eps=None, fmt="v41", b=2, s_q=1, h=4, bs=2,
                                   topk=32, extra=False)
    _assert_same(_decode(a, q, "triton", **fold), _decode(a, q_rot, "triton"))


def test_reference_route_applies_the_unfused_reference_ops():
    """The reference route's folded call is the reference on the reference ops' q."""
    a, q, fold, _ = _fold_case("cpu", 3, b=2, s_q=2, h=5, bs=64, topk=32, extra_topk=16)
    pos, cs = fold["q_positions"].reshape(-1), fold["cos_sin_cache"]
    b, s_q, h, d = q.shape
    q_out = torch.empty(b * s_q, h, d, dtype=torch.bfloat16)
    ci.fused_qnorm_rope_insert_v4(q.reshape(-1, h, d), torch.zeros(b * s_q, d), torch.zeros(
        1, formats.V4.page_bytes(64), dtype=torch.uint8), torch.empty(0, dtype=torch.int64),
        pos, cs, q_out, 1e-6, 64, True, "reference")
    _assert_same(_decode(a, q, "reference", **fold),
                 _decode(a, q_out.view(b, s_q, h, d), "reference"))


@pytest.mark.parametrize("change, match", [
    (dict(cos_sin_cache=None), "q_positions and cos_sin_cache go together"),
    (dict(q_positions=None, cos_sin_cache=None, q_norm_eps=1e-6), "q_norm_eps needs"),
    (dict(q_positions="short"), "q_positions must be a contiguous tensor of 4"),
    (dict(q_positions="float"), "q_positions"),
    (dict(cos_sin_cache="narrow"), "cos_sin_cache must be a contiguous"),
    (dict(cos_sin_cache="fp64"), "cos_sin_cache"),
    (dict(q_norm_eps=-1.0), "q_norm_eps must be a float"),
    (dict(q_positions="past"), "q_positions"),
])
def test_bad_fold_arguments_raise_before_writing(change, match):
    a, q, fold, _ = _fold_case("cpu", 1, b=2, s_q=2, h=3, bs=64, topk=32, extra_topk=16)
    pos, cs = fold["q_positions"], fold["cos_sin_cache"]
    bad = {"short": pos.reshape(-1)[:3], "float": pos.float(), "narrow": cs[:, :32],
           "fp64": cs.double(), "past": torch.full_like(pos, MAX_POS)}
    fold.update({k: bad.get(v, v) if isinstance(v, str) else v for k, v in change.items()})
    out = torch.full((2, 2, 3, 512), 7.0, dtype=torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match=match):   # TypeError: a dtype
        _decode(a, q, "reference", out=out, **fold)
    assert bool((out == 7.0).all())


def test_fold_needs_512_wide_rows():
    a = decode_case("cpu", b=1, s_q=1, h=2, fmt="v32", bs=64, topk=32, extra=False, seed=0)
    with pytest.raises(ValueError, match="need 512-wide rows"):
        _decode(a, a["q"], "reference", q_positions=torch.zeros(1, 1, dtype=torch.int64),
                cos_sin_cache=cos_sin_table(4, "cpu"))
