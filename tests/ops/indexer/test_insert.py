"""The indexer-K insert on every route against an independent writer: the fp8 page's bytes
from a search over every e4m3 value (nearest, ties to even) and a scale from ``math.frexp``;
bytes outside the written entries stay as they were."""
import math

import pytest
import torch

from sparse_mla.ops.indexer import alloc_cache, indexer_k_insert
from sparse_mla.ops.indexer import format as fmt
from sparse_mla.tests.helpers import seeded, storage_bytes, triton_devices
from sparse_mla.tests.ops.indexer import cases

ROUTES = [pytest.param("reference", "cpu", id="reference")] + [
    pytest.param("triton", d, id=f"triton-{d.replace(':', '')}") for d in triton_devices()]
POISON = 0xFF


def _rows(n, g):
    # heavy-tailed magnitudes reach every scale exponent; one tiny row hits the 1e-4 floor
    x = torch.randn(n, fmt.DIM, generator=g) * torch.exp2(
        torch.randint(-10, 10, (n, 1), generator=g).float())
    x[0] = 1e-7
    x[1, :] = 448.0 * 4           # amax / 448 exactly a power of two
    return x


def _scale(amax: float) -> float:
    """2^ceil(log2(max(amax, 1e-4) / 448))."""
    m, e = math.frexp(max(amax, 1e-4) / 448.0)
    return 2.0 ** (e if m > 0.5 else e - 1)


def _expected_fp8(cache, x, slots, bs):
    want = storage_bytes(cache).cpu()
    page = cache.stride(0)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        row = x[t].to(torch.bfloat16).double()
        s = _scale(float(row.abs().max()))
        base = (slot // bs) * page
        off = slot % bs
        want[base + off * fmt.DIM: base + (off + 1) * fmt.DIM] = cases.nearest_e4m3(row / s)
        tail = base + bs * fmt.DIM + off * 4
        want[tail:tail + 4] = torch.tensor([s], dtype=torch.float32).view(torch.uint8)
    return want


@pytest.mark.parametrize("impl,device", ROUTES)
@pytest.mark.parametrize("bs", [1, 4, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_insert_matches_an_independent_writer(impl, device, bs, dtype):
    g = seeded(bs)
    n = 9
    nb = n // bs + 2
    cache = alloc_cache(nb, bs, fp8=True, fill=POISON, device=device)
    x = _rows(n, g).to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[3] = -1
    want = _expected_fp8(cache, x, slots, bs)
    indexer_k_insert(x.to(device), cache, slots.to(device), impl=impl)
    assert torch.equal(storage_bytes(cache).cpu(), want)


@pytest.mark.parametrize("impl,device", ROUTES)
def test_fp8_insert_into_a_2d_page_view(impl, device):
    """[num_blocks, bytes] pages wider than a block (vLLM's padded pages), block_size given."""
    g = seeded(40)
    bs, nb, page = 4, 3, 4 * 132 + 48
    raw = torch.full((nb, page), POISON, dtype=torch.uint8)
    x = _rows(5, g)
    slots = torch.tensor([0, 11, 5, -1, 6])
    want = _expected_fp8(raw, x, slots, bs)
    raw = raw.to(device)
    indexer_k_insert(x.to(device), raw, slots.to(device), block_size=bs, impl=impl)
    assert torch.equal(storage_bytes(raw).cpu(), want)


@pytest.mark.parametrize("impl,device", ROUTES)
def test_bf16_insert_rounds_to_nearest_even(impl, device):
    g = seeded(41)
    cache = alloc_cache(3, 4, fp8=False, fill=POISON, device=device)
    x = torch.randn(6, fmt.DIM, generator=g)
    slots = torch.tensor([2, -1, 7, 0, 11, 9])
    want = cache.cpu().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s // 4, s % 4] = x[t].to(torch.bfloat16)
    indexer_k_insert(x.to(device), cache, slots.to(device), impl=impl)
    assert torch.equal(storage_bytes(cache).cpu(), storage_bytes(want))


@pytest.mark.parametrize("impl,device", ROUTES)
def test_inserted_keys_score_like_the_dense_keys(impl, device):
    """Insert, then decode over the cache: the same selection as prefill over the dense keys
    the insert wrote (the two ops agree on the page layout)."""
    from sparse_mla.ops.indexer import lightning_indexer_decode
    from sparse_mla.ops.indexer.reference import quantize_fp8
    g = seeded(42)
    x = torch.randn(10, fmt.DIM, generator=g)
    cache = alloc_cache(4, 4, fp8=True, fill=POISON, device=device)
    bt = torch.tensor([[2, 0, 3, -1]], dtype=torch.int32)
    slots = torch.tensor([bt[0, j // 4].item() * 4 + j % 4 for j in range(10)])
    indexer_k_insert(x.to(device), cache, slots.to(device), impl=impl)
    q = cases.bf16_exact((1, 2, fmt.DIM), g)
    w = torch.randn(1, 2, generator=g)
    got = lightning_indexer_decode(q.to(device), w.to(device), cache, torch.tensor([43]).to(device),
                                   bt.to(device), topk=6, impl=impl)
    vals, scales = quantize_fp8(x)
    keys = vals.view(torch.float8_e4m3fn).double() * scales.double().unsqueeze(1)
    s = cases.scores(q[0], w[0], keys)
    want = torch.tensor([cases.expected(s, torch.ones(10, dtype=torch.bool), 6)],
                        dtype=torch.int32)
    cases.assert_selection(got, want, [s], [torch.ones(10, dtype=torch.bool)],
                           1e-12 if impl == "reference" else 1e-4)
