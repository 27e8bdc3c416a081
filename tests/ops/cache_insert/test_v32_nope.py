"""GLM-5.3's no-RoPE insert (docs/semantics.md §13.5): the V3.2 record from kv_c alone.

The oracle is independent of the op's own code path: the V3.2 insert fed an explicit zero
k_pe (what vLLM's zero-padded kv_a_proj produces), checked byte for byte over the whole
allocation (padding between blocks, poisoned neighbours, skipped slots included). Runs on CUDA
when present and under Triton's interpreter in the *_interpret_test target.
"""
import pytest
import torch

from sparse_mla.ops.cache_insert import quantize_insert_v32, quantize_insert_v32_nope
from sparse_mla.ops.common import formats
from sparse_mla.tests.helpers import seeded, storage_bytes, triton_params

POISON = 0xFF
ROPE_AT = 512 + 16            # the record: 512 e4m3, 4 fp32 scales, 64 bf16 RoPE


def _case(n, cap, g):
    x = torch.randn(n, 512, generator=g)
    x = x * torch.exp2(torch.randint(-10, 10, (n, 512), generator=g).float())
    slots = torch.randperm(cap, generator=g)[:n]
    slots[torch.randperm(n, generator=g)[:min(2, n)]] = -1
    return x.to(torch.bfloat16), slots


def _insert(op_args, device, nb, bs, pad, **kw):
    cache = formats.alloc_paged_cache("v32", nb, bs, fill=POISON, device=device,
                                      page_bytes=bs * 656 + pad)
    if len(op_args) == 2:
        kv_c, slots = op_args
        quantize_insert_v32_nope(kv_c.to(device), cache, slots.to(device), **kw)
    else:
        kv_c, k_pe, slots = op_args
        quantize_insert_v32(kv_c.to(device), k_pe.to(device), cache, slots.to(device),
                            impl="reference", scale_format=kw.get("scale_format", "fp32"))
    return cache


@pytest.mark.parametrize("device", ["cpu"] + [p for p in triton_params()])
@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("scale_format", ["fp32", "pow2"])
@pytest.mark.parametrize("bs,pad", [(2, 16), (61, 0), (64, 48)])
def test_nope_insert_is_v32_record_with_zero_rope(device, impl, scale_format, bs, pad):
    if impl == "triton" and device == "cpu" and not _interpreting():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    if impl == "reference" and device != "cpu":
        pytest.skip("the reference runs once, on CPU")
    g = seeded(bs + pad)
    nb = 3
    n = min(5 if device == "cpu" else 150, nb * bs)
    kv_c, slots = _case(n, nb * bs, g)
    got = _insert((kv_c, slots), device, nb, bs, pad, scale_format=scale_format, impl=impl)
    want = _insert((kv_c, torch.zeros(n, 64), slots), device, nb, bs, pad,
                   scale_format=scale_format)
    assert torch.equal(storage_bytes(got).cpu(), storage_bytes(want).cpu())
    written = slots[slots >= 0].long()
    rows = got.view(-1, 656)[written] if pad == 0 else got[written // bs, written % bs]
    assert (rows[:, ROPE_AT:].cpu() == 0).all()        # +0.0 bf16, never -0.0
    # untouched slots keep their poison, whole record
    keep = torch.ones(nb * bs, dtype=torch.bool)
    keep[written] = False
    idx = keep.nonzero().flatten()
    assert (got[idx // bs, idx % bs].cpu() == POISON).all()


def test_nope_insert_non_contiguous_kv_c():
    g = seeded(7)
    wide = torch.randn(6, 1024, generator=g).to(torch.bfloat16)
    kv_c = wide[:, ::2]
    slots = torch.tensor([3, -1, 0, 5, 1, 2])
    got = _insert((kv_c, slots), "cpu", 2, 4, 0)
    want = _insert((kv_c.contiguous(), torch.zeros(6, 64), slots), "cpu", 2, 4, 0)
    assert torch.equal(storage_bytes(got), storage_bytes(want))


@pytest.mark.parametrize("bad,name", [
    (dict(kv_c=torch.zeros(3, 576)), "kv_c"),
    (dict(slot_mapping=torch.zeros(4, dtype=torch.int64)), "slot_mapping"),
    (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "slot_mapping"),
    (dict(scale_format="ue8m0"), "scale_format"),
])
def test_nope_insert_bad_input_names_argument_and_writes_nothing(bad, name):
    args = dict(kv_c=torch.zeros(3, 512, dtype=torch.bfloat16),
                kv_cache=formats.alloc_paged_cache("v32", 1, 4, fill=POISON),
                slot_mapping=torch.tensor([0, 1, 2]))
    args.update(bad)
    before = storage_bytes(args["kv_cache"])
    with pytest.raises((ValueError, TypeError, RuntimeError), match=name):
        quantize_insert_v32_nope(**args)
    assert torch.equal(storage_bytes(args["kv_cache"]), before)


def _interpreting():
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"
