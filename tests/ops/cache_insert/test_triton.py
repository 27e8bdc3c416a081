"""Triton kernels vs the reference: byte-exact caches, exact q, on fresh random inputs.

Runs on CUDA when present, and on CPU under Triton's interpreter in the *_interpret_test
target (tiny shapes there: the interpreter is slow).
"""
import pytest
import torch

from sparse_mla.ops.cache_insert import (fused_qnorm_rope_insert_plain, gather_dequant,
                                         insert_plain, qnorm_rope_kv_insert_v4, quantize_insert_v32,
                                         quantize_insert_v4)
from sparse_mla.ops.common import formats
from sparse_mla.tests.helpers import (INTERPRETING, cuda_params, seeded, storage_bytes,
                                      triton_params)

DEVICES = triton_params()
POISON = 0xFF


def _n_tokens(device, gpu_n):
    return 5 if device == "cpu" else gpu_n


def _rand(shape, g, scale=1.0, dtype=torch.bfloat16):
    # heavy-tailed values exercise every scale exponent and the ±448 clamp
    x = torch.randn(shape, generator=g) * scale
    x = x * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    return x.to(dtype)


def _cos_sin(max_pos, g):
    ang = torch.rand(max_pos, 32, generator=g) * 6.283
    return torch.cat([ang.cos(), ang.sin()], dim=1)


def _slots(n, capacity, g, n_skip=2):
    slots = torch.randperm(capacity, generator=g)[:n]
    slots[torch.randperm(n, generator=g)[:min(n_skip, n)]] = -1
    return slots


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs", [2, 61, 64, 256])
@pytest.mark.parametrize("extra_pages", [0, 3])
def test_v4_insert_matches_reference(device, bs, extra_pages):
    g = seeded(bs * 10 + extra_pages)
    n = _n_tokens(device, 1000)
    nb = n // bs + 2
    k = _rand((n, 1024), g)[:, :512]                   # row stride 1024: non-contiguous rows
    slots = _slots(n, nb * bs, g)
    page = formats.V4.page_bytes(bs) + 576 * extra_pages
    results = []
    for impl in ("reference", "triton"):
        cache = formats.alloc_paged_cache("v4", nb, bs, page_bytes=page, fill=POISON,
                                          device=device)
        quantize_insert_v4(k.to(device), cache, slots.to(device), impl=impl)
        results.append(storage_bytes(cache).cpu())
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,padded", [(1, 1), (8, 64), (32, 64), (64, 64), (128, 128)])
@pytest.mark.parametrize("apply_q_norm", [True, False])
def test_fused_v4_matches_reference(device, heads, padded, apply_q_norm):
    g = seeded(heads * 3 + apply_q_norm)
    n = _n_tokens(device, 4096 if heads <= 64 else 2048)
    bs, nb = 64, (n + 63) // 64 + 1
    q = _rand((n, heads, 512), g, 0.5)
    kv = _rand((n, 512), g)
    pos = torch.randint(0, 5000, (n,), generator=g)
    cs = _cos_sin(5000, g)
    n_ins = max(1, n - 2)                               # the last tokens are graph padding
    slots = _slots(n_ins, nb * bs, g)
    res = []
    for impl in ("reference", "triton"):
        cache = formats.alloc_paged_cache("v4", nb, bs, fill=POISON, device=device)
        q_out = qnorm_rope_kv_insert_v4(q.to(device), kv.to(device), cache, slots.to(device),
                                        pos.to(device), cs.to(device), q_head_padded=padded,
                                        apply_q_norm=apply_q_norm, impl=impl)
        res.append((q_out.cpu(), storage_bytes(cache).cpu()))
    assert torch.equal(res[0][0].view(torch.int16), res[1][0].view(torch.int16))
    assert torch.equal(res[0][1], res[1][1])


@pytest.mark.parametrize("device", DEVICES)
def test_fused_v4_non_contiguous_q_and_flashmla_4d_cache(device):
    g = seeded(7)
    n, h = _n_tokens(device, 300), 16
    q = _rand((n, 2 * h, 512), g)[:, ::2]               # head stride 1024
    kv = _rand((n, 512), g)
    pos = torch.randint(0, 64, (n,), generator=g)
    cs = _cos_sin(64, g)
    nb = n // 61 + 2
    slots = _slots(n, nb * 61, g)                       # distinct: duplicate slots would race
    res = []
    for impl in ("reference", "triton"):
        cache = formats.alloc_paged_cache("v4", nb, 61, fill=POISON, device=device)
        q_out = torch.full((n, 64, 512), 7.0, dtype=torch.bfloat16, device=device)
        qnorm_rope_kv_insert_v4(q.to(device), kv.to(device), cache.unsqueeze(-2),
                                slots.to(device), pos.to(device), cs.to(device), out=q_out,
                                impl=impl)
        res.append((q_out.cpu(), storage_bytes(cache).cpu()))
    assert torch.equal(res[0][0].view(torch.int16), res[1][0].view(torch.int16))
    assert torch.equal(res[0][1], res[1][1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_format", ["fp32", "pow2"])
@pytest.mark.parametrize("bs", [2, 61, 64])
def test_v32_insert_matches_reference(device, scale_format, bs):
    g = seeded(bs)
    nb = 4
    n = min(_n_tokens(device, 200), nb * bs)
    kv_c = _rand((n, 512), g)
    k_pe = _rand((n, 64), g)
    slots = _slots(n, nb * bs, g)
    res = []
    for impl in ("reference", "triton"):
        cache = formats.alloc_paged_cache("v32", nb, bs, fill=POISON, device=device,
                                          page_bytes=bs * 656 + 16)
        quantize_insert_v32(kv_c.to(device), k_pe.to(device), cache, slots.to(device),
                            scale_format=scale_format, impl=impl)
        res.append(storage_bytes(cache).cpu())
    assert torch.equal(res[0], res[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [1, 8, 128])
def test_plain_insert_matches_reference(device, fp8, heads):
    g = seeded(heads + fp8)
    n = _n_tokens(device, 1024 if heads < 128 else 256)
    bs, nb = 64, (n + 63) // 64 + 1
    q = _rand((n, heads, 512), g, 0.3)
    kv = _rand((n, 512), g, 0.01)
    pos = torch.randint(0, 300, (n,), generator=g)
    cs = _cos_sin(300, g)
    slots = _slots(n - 1, nb * bs, g)
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    scales = dict(kv_scale=torch.tensor([0.0173]), q_scale_inv=torch.tensor([3.3])) if fp8 \
        else {}
    res = []
    for impl in ("reference", "triton"):
        # padded block stride: blocks 64 rows apart in a [nb, 2*bs, 512] allocation
        cache = torch.full((nb, 2 * bs, 512), float("nan"), device=device).to(dt)[:, :bs]
        q_out = torch.empty(n, heads, 512, dtype=dt, device=device)
        fused_qnorm_rope_insert_plain(q.to(device), kv.to(device), cache, slots.to(device),
                                      pos.to(device), cs.to(device), q_out, impl=impl,
                                      **{k: v.to(device) for k, v in scales.items()})
        res.append((q_out.view(torch.uint8).cpu(), storage_bytes(cache).cpu()))
    assert torch.equal(res[0][0], res[1][0])
    assert torch.equal(res[0][1], res[1][1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
def test_insert_plain_matches_reference(device, fp8):
    g = seeded(40 + fp8)
    n = _n_tokens(device, 700)
    bs, nb = 2, n // 2 + 3
    k = _rand((n, 512), g, 0.05, torch.float32)     # fp32 rows: the bf16 rounding is the op's
    slots = _slots(n, nb * bs, g)
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    scale = torch.tensor([0.0173], device=device) if fp8 else None
    res = []
    for impl in ("reference", "triton"):
        cache = torch.full((nb, 2 * bs, 512), float("nan"), device=device).to(dt)[:, :bs]
        insert_plain(k.to(device), cache, slots.to(device), scale, impl=impl)
        res.append(storage_bytes(cache).cpu())
    assert torch.equal(res[0], res[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["v4", "v32"])
@pytest.mark.parametrize("bs", [2, 61, 256])
def test_gather_dequant_matches_reference(device, fmt, bs):
    g = seeded(bs)
    nb = 6
    cap = nb * bs
    cache = formats.alloc_paged_cache(fmt, nb, bs, fill=POISON, device=device)
    # fill every slot, then poison block 5 with NaN-decoding bytes that must never be read
    if fmt == "v4":
        quantize_insert_v4(_rand((cap, 512), g).to(device), cache, torch.arange(cap, device=device))
    else:
        quantize_insert_v32(_rand((cap, 512), g).to(device), _rand((cap, 64), g).to(device),
                            cache, torch.arange(cap, device=device))
    r = 3
    max_blocks = 4
    block_table = torch.randint(0, 5, (r, max_blocks), generator=g, dtype=torch.int32)
    block_table[1, 2] = -1
    block_table[2, 0] = 99                               # out of range: skipped
    seq_lens = torch.randint(0, max_blocks * bs + 1, (r,), generator=g, dtype=torch.int32)
    gather_lens = torch.minimum(seq_lens, torch.randint(0, 2 * bs + 3, (r,), generator=g,
                                                        dtype=torch.int32))
    width = formats.get_format(fmt).out_dim
    res = []
    for impl in ("reference", "triton"):
        out = torch.full((r, bs + 5, width), float("nan"), dtype=torch.bfloat16, device=device)
        gather_dequant(out, cache, seq_lens.to(device), gather_lens.to(device),
                       block_table.to(device), offset=2, cache_format=fmt, impl=impl)
        res.append(out.view(torch.int16).cpu())
    assert torch.equal(res[0], res[1])


@pytest.mark.skipif(INTERPRETING, reason="GPU-only behaviour")
@pytest.mark.parametrize("device", cuda_params())
def test_cuda_out_of_range_slots_are_skipped_not_written(device, monkeypatch):
    """Without value checks (no host sync) a slot beyond the cache is skipped by the kernel;
    with SPARSE_MLA_CHECK_VALUES=1 the op raises before writing."""
    cache = formats.alloc_paged_cache("v4", 2, 4, fill=POISON, device=device)
    before = storage_bytes(cache)
    k = torch.randn(2, 512, dtype=torch.bfloat16, device=device)
    slots = torch.tensor([8, 1000], device=device)
    quantize_insert_v4(k, cache, slots, impl="triton")
    assert torch.equal(storage_bytes(cache), before)
    monkeypatch.setenv("SPARSE_MLA_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match="slot_mapping holds slot 1000"):
        quantize_insert_v4(k, cache, slots, impl="triton")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens_per_program", [3, 8])
def test_v4_insert_multi_token_programs(device, tokens_per_program, monkeypatch):
    """The launch shape is tunable: any tokens-per-program (not dividing N) gives the same
    bytes, including the ragged last program."""
    from sparse_mla.ops.cache_insert import triton_impl
    monkeypatch.setitem(triton_impl.CONFIG, "tokens_per_program", tokens_per_program)
    g = seeded(tokens_per_program)
    n, bs = 10, 64
    k = _rand((n, 512), g)
    slots = _slots(n, 2 * bs, g)
    res = []
    for impl in ("reference", "triton"):
        cache = formats.alloc_paged_cache("v4", 2, bs, fill=POISON, device=device)
        quantize_insert_v4(k.to(device), cache, slots.to(device), impl=impl)
        res.append(storage_bytes(cache).cpu())
    assert torch.equal(res[0], res[1])


@pytest.mark.skipif(INTERPRETING, reason="interpreted kernels always take the software route")
@pytest.mark.parametrize("device", cuda_params())
def test_software_e4m3_route_matches_reference(device, monkeypatch):
    """The route GPUs below sm_89 take (e4m3 encoded and decoded in integer arithmetic),
    forced on this GPU (``SPARSE_MLA_SOFT_FP8=1``): every e4m3-writing insert and the gather
    byte-exact with the reference, as on the hardware route."""
    monkeypatch.setenv("SPARSE_MLA_SOFT_FP8", "1")
    test_v4_insert_matches_reference(device, 61, 3)
    test_fused_v4_matches_reference(device, 128, 128, True)
    test_v32_insert_matches_reference(device, "fp32", 61)
    test_v32_insert_matches_reference(device, "pow2", 64)
    for heads in (1, 128):
        test_plain_insert_matches_reference(device, True, heads)
    test_insert_plain_matches_reference(device, True)
    for fmt in ("v4", "v32"):
        test_gather_dequant_matches_reference(device, fmt, 61)
