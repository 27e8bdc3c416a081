"""kpool_k_insert against independent float64 / matrix formulations (docs/semantics.md §13)."""
import os

import pytest
import torch

from sparse_mla.ops.indexer_kpool import alloc_cache, alloc_tail_cache, kpool_k_insert, ring_size
from sparse_mla.ops.indexer_kpool import reference as ref
from sparse_mla.ops.indexer_kpool.format import DIM

KP = 4
BS = 5                                   # odd block size


def sylvester(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def test_hadamard_matches_matrix():
    x = torch.randn(7, DIM).to(torch.bfloat16).float()
    want = x.double() @ sylvester(DIM) / DIM ** 0.5
    torch.testing.assert_close(ref.hadamard128(x).double(), want, rtol=1e-6, atol=1e-6)


def test_quantize_rotated_scale_and_values():
    x = torch.randn(9, DIM).to(torch.bfloat16).float() * torch.logspace(-3, 3, 9).unsqueeze(1)
    vals, scale = ref.quantize_rotated(x)
    m, e = torch.frexp(scale)
    assert bool((m == 0.5).all())                                 # powers of two
    y = (x.double() @ sylvester(DIM) / DIM ** 0.5)
    amax = y.abs().amax(1)
    assert bool((amax / scale.double() <= 448 * (1 + 2 ** -7)).all())
    assert bool((amax / scale.double() > 224 * (1 - 2 ** -7)).all())
    deq = vals.view(torch.float8_e4m3fn).double() * scale.double().unsqueeze(1)
    assert float(((deq - y).abs() / amax.unsqueeze(1)).max()) < 2 ** -4


def pool64(k, g, ape):
    """float64 softmax pooling of one pool: k, g [kpool, 128]."""
    p = torch.softmax(g.double() + ape.double(), dim=0)
    return (p * k.double()).sum(0)


def make(n_tok, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_tok, DIM, generator=gen).to(torch.bfloat16)
    g = (2 * torch.randn(n_tok, DIM, generator=gen)).to(torch.bfloat16)
    ape = torch.randn(KP, DIM, generator=gen)
    return k, g, ape


def insert(k, g, ape, pos, cache, tail, ring, req=None, blocks=None, **kw):
    pos = torch.as_tensor(pos)
    req = torch.zeros_like(pos) if req is None else torch.as_tensor(req)
    base = req * 100 if blocks is None else torch.as_tensor(blocks)
    slot = torch.where(pos % KP == KP - 1, base + pos // KP, -1)
    kpool_k_insert(k, g, ape, pos, slot, req * ring + pos % ring, cache, tail, KP, **kw)


def entry(cache, slot, scale_fmt="fp32"):
    page = cache.view(cache.shape[0], -1)
    b, o = divmod(slot, BS)
    vals = page[b, o * DIM:(o + 1) * DIM].view(torch.float8_e4m3fn).double()
    raw = page[b, BS * DIM + o * 4:BS * DIM + o * 4 + 4]
    return vals * ref.decode_scales(raw, scale_fmt)


def test_prefill_pools_and_tail_ring():
    n, ring = 11, ring_size(KP, 0)
    k, g, ape = make(n)
    cache = alloc_cache(60, BS, fill=0xFF)
    tail = alloc_tail_cache(2, ring, fill=0xFF)
    insert(k, g, ape, torch.arange(n), cache, tail, ring)
    h = sylvester(DIM) / DIM ** 0.5
    for j in range(n // KP):
        want = pool64(k[j * KP:(j + 1) * KP], g[j * KP:(j + 1) * KP], ape) @ h
        got = entry(cache, j)
        assert float((got - want).abs().max()) < 2 ** -4 * float(want.abs().max())
    # the third pool (tokens 8..10) is incomplete: its slot stays poisoned
    assert bool(entry(cache, 2).isnan().all())
    for p in range(n - KP, n):                  # the last kpool tokens sit at pos % ring
        assert torch.equal(tail[0, 0, p % ring], k[p]) and torch.equal(tail[0, 1, p % ring], g[p])
    assert bool(tail[1].isnan().all())


TRITON = pytest.param("triton", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton needs CUDA or TRITON_INTERPRET=1"))
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("impl", ["reference", TRITON])
@pytest.mark.parametrize("split", [[12], [6, 12], [3, 7, 12], [11, 12], list(range(1, 13))])
def test_chunk_boundaries_match_one_shot(split, impl):
    """Any split of a request into prefill chunks / decode steps writes the same bytes."""
    d = DEV if impl == "triton" else "cpu"
    n, ring = 12, ring_size(KP, 0)
    k, g, ape = (t.to(d) for t in make(n, seed=3))
    one = alloc_cache(60, BS, fill=0xFF, device=d)
    tail1 = alloc_tail_cache(1, ring, fill=0xFF, device=d)
    insert(k, g, ape, torch.arange(n, device=d), one, tail1, ring, impl=impl)
    cache = alloc_cache(60, BS, fill=0xFF, device=d)
    tail = alloc_tail_cache(1, ring, fill=0xFF, device=d)
    start = 0
    for end in split:                            # chunk ends
        insert(k[start:end], g[start:end], ape, torch.arange(start, end, device=d), cache, tail,
               ring, impl=impl)
        start = end
    assert torch.equal(cache.view(torch.uint8), one.view(torch.uint8))


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_triton_insert_close_to_reference(scale_fmt):
    """Random gates: Triton's exp (the interpreter's numpy exp, the GPU's approximate one) may
    move a pooled value across a bf16 rounding boundary, which then moves that element's
    e4m3 code by one step (32 x the scale at the top of the range). So: dequantized values
    within 2 such steps, at most 1% of the entries' bytes different; the interpreter's
    fp32 -> e4m3 cast is not an oracle either (the GPU-only test below is the byte-exact
    one). The ring (raw copies) must be byte-exact."""
    n, ring = 23, ring_size(KP, 3)
    k, g, ape = make(n, seed=13)
    res = []
    for impl, d in (("reference", "cpu"), ("triton", DEV)):
        c = alloc_cache(60, BS, fill=0xFF, device=d)
        t = alloc_tail_cache(2, ring, fill=0xFF, device=d)
        pos = torch.tensor(list(range(11)) + list(range(12)))
        req = torch.tensor([0] * 11 + [1] * 12)
        insert(k.to(d), g.to(d), ape.to(d), pos.to(d), c, t, ring, req=req.to(d), impl=impl,
               scale_fmt=scale_fmt)
        res.append((c.cpu(), t.cpu()))
    (c0, t0), (c1, t1) = res
    assert torch.equal(t0.view(torch.uint8), t1.view(torch.uint8))
    slots = [j for j in range(2)] + [100 + j for j in range(3)]
    for s in slots:
        a, b = entry(c0, s, scale_fmt), entry(c1, s, scale_fmt)
        assert not a.isnan().any() and not b.isnan().any(), s
        assert float((a - b).abs().max()) <= 2 * 32 * float(a.abs().max()) / 448, s
    diff = (c0 != c1).sum().item()
    assert diff <= 0.01 * len(slots) * DIM


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (byte-exact e4m3)")
def test_cuda_triton_insert_bytes_exact_with_exact_softmax():
    """gate = ape = 0: every softmax weight is exp(0) = 1 on any device, so the pooled row
    is the exact fp32 mean; from there rotation, bf16 and e4m3 must match byte for byte."""
    n, ring = 19, ring_size(KP, 2)
    k, _, _ = make(n, seed=17)
    g = torch.zeros(n, DIM, dtype=torch.bfloat16)
    ape = torch.zeros(KP, DIM)
    res = []
    for impl, d in (("reference", "cpu"), ("triton", "cuda")):
        c = alloc_cache(60, BS, fill=0xFF, device=d)
        t = alloc_tail_cache(1, ring, fill=0xFF, device=d)
        insert(k.to(d), g.to(d), ape.to(d), torch.arange(n, device=d), c, t, ring, impl=impl)
        res.append(c.cpu())
    assert torch.equal(res[0], res[1])


@pytest.mark.parametrize("next_n", [1, 2, 3, 5])
def test_mtp_steps_match_one_shot(next_n):
    """Decode steps of next_n tokens for two requests batched together (ring sized for
    num_spec = next_n - 1) write the pools a one-shot prefill writes."""
    n0, steps, ring = 6, 3, ring_size(KP, next_n - 1)
    n = n0 + steps * next_n
    ka, ga, ape = make(n, seed=5)
    kb, gb, _ = make(n, seed=6)
    one = alloc_cache(60, BS, fill=0xFF)
    t1 = alloc_tail_cache(2, ring, fill=0xFF)
    insert(torch.cat((ka, kb)), torch.cat((ga, gb)), ape, torch.arange(n).repeat(2), one, t1,
           ring, req=torch.arange(2).repeat_interleave(n))
    cache = alloc_cache(60, BS, fill=0xFF)
    tail = alloc_tail_cache(2, ring, fill=0xFF)
    insert(torch.cat((ka[:n0], kb[:n0])), torch.cat((ga[:n0], gb[:n0])), ape,
           torch.arange(n0).repeat(2), cache, tail, ring,
           req=torch.arange(2).repeat_interleave(n0))
    for s in range(steps):
        r = slice(n0 + s * next_n, n0 + (s + 1) * next_n)
        insert(torch.cat((ka[r], kb[r])), torch.cat((ga[r], gb[r])), ape,
               torch.arange(r.start, r.stop).repeat(2), cache, tail, ring,
               req=torch.arange(2).repeat_interleave(next_n))
    assert torch.equal(cache.view(torch.uint8), one.view(torch.uint8))


def test_ue8m0_scales():
    n, ring = 8, ring_size(KP, 0)
    k, g, ape = make(n, seed=7)
    a, b = alloc_cache(60, BS, fill=0), alloc_cache(60, BS, fill=0)
    insert(k, g, ape, torch.arange(n), a, alloc_tail_cache(1, ring), ring)
    insert(k, g, ape, torch.arange(n), b, alloc_tail_cache(1, ring), ring, scale_fmt="ue8m0")
    pa, pb = a.view(a.shape[0], -1), b.view(b.shape[0], -1)
    assert torch.equal(pa[:, :BS * DIM], pb[:, :BS * DIM])
    for j in range(2):
        sa = pa[0, BS * DIM + 4 * j:BS * DIM + 4 * j + 4].view(torch.float32)
        exp_byte = int((sa.view(torch.int32) >> 23) & 0xFF)
        assert pb[0, BS * DIM + 4 * j:BS * DIM + 4 * j + 4].tolist() == [exp_byte] * 4
        assert torch.equal(entry(a, j), entry(b, j, "ue8m0"))


@pytest.mark.parametrize("bad, match", [
    (dict(k=torch.zeros(4, DIM)), "k"),
    (dict(slot_mapping=torch.tensor([0, -1, -1, -1])), "slot_mapping"),
    (dict(ape=torch.zeros(3, DIM)), "ape"),
    (dict(tail_slot_mapping=torch.tensor([0, 1, 2, 99])), "tail_slot_mapping"),
    (dict(kpool=1), "kpool"),
    (dict(scale_fmt="e8m0"), "scale_fmt"),
])
def test_bad_input_raises_before_writing(bad, match):
    k, g, ape = make(4)
    args = dict(k=k, gate=g, ape=ape, positions=torch.arange(4),
                slot_mapping=torch.tensor([-1, -1, -1, 0]),
                tail_slot_mapping=torch.arange(4), k_cache=alloc_cache(2, BS, fill=0xFF),
                tail_cache=alloc_tail_cache(1, 4, fill=0xFF), kpool=KP)
    args.update(bad)
    before = (args["k_cache"].clone(), args["tail_cache"].clone())
    with pytest.raises((ValueError, TypeError), match=match):
        kpool_k_insert(**args)
    assert torch.equal(args["k_cache"], before[0])
    assert torch.equal(args["tail_cache"].view(torch.uint8), before[1].view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_insert_bytes_match_cpu():
    n, ring = 19, ring_size(KP, 2)
    k, g, ape = make(n, seed=9)
    cpu = (alloc_cache(60, BS, fill=0xFF), alloc_tail_cache(1, ring, fill=0xFF))
    insert(k, g, ape, torch.arange(n), *cpu, ring)
    dev = [t.cuda() for t in (alloc_cache(60, BS, fill=0xFF), alloc_tail_cache(1, ring, fill=0xFF))]
    insert(k.cuda(), g.cuda(), ape.cuda(), torch.arange(n).cuda(), *dev, ring)
    assert torch.equal(dev[0].cpu(), cpu[0])
    assert torch.equal(dev[1].cpu().view(torch.uint8), cpu[1].view(torch.uint8))
