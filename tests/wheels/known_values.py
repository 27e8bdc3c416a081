"""The FlashMLA-semantics ops on CPU against values worked out by hand (SPEC §5).

Used where only an installed or vendored copy of `sparse_mla.ops.flashmla_decode` is present:
inside the wheels' fresh venv (tests/wheels/test_install.py runs this file as a script) and in
the downstream vendoring workspace (tests/downstream). It imports nothing else first-party: the
V4 cache bytes are written here by hand (SPEC §2.2), the expected outputs are closed forms.

Keys are rows with one value in all 512 dims (NoPE e4m3 1.0 times a power-of-two scale, RoPE
bf16 of the same value), so with q = 1 in every dim and softmax_scale = 1/512 a key's score is
its value, and outputs are softmax-weighted averages of those values.
"""
from __future__ import annotations

import math
import sys

import torch

BLOCK = 2
PAGE = 1728  # ceil(2 * 584 / 576) * 576: vLLM's aligned V4 page for block size 2
E4M3_ONE = 0x38
NAN_SLOT = 2
KEY_VALUES = {0: 1.0, 1: 2.0, 3: 4.0}  # slot -> value; slot 2 is NaN poison (never valid)


def v4_cache() -> torch.Tensor:
    """[2 blocks, 2 tokens, 584] uint8 view of a hand-written V4 cache (SPEC §2.2)."""
    raw = torch.full((2, PAGE), 0xFF, dtype=torch.uint8)  # 0xFF: e4m3 NaN, bf16 NaN
    for slot, value in KEY_VALUES.items():
        block, off = divmod(slot, BLOCK)
        exponent = int(math.log2(value))
        data = block * PAGE + off * 576
        raw.view(-1)[data:data + 448] = E4M3_ONE
        rope = torch.full((64,), value, dtype=torch.bfloat16).view(torch.uint8)
        raw.view(-1)[data + 448:data + 576] = rope
        scales = block * PAGE + BLOCK * 576 + off * 8
        raw.view(-1)[scales:scales + 7] = 127 + exponent  # UE8M0: 2^(byte - 127)
        raw.view(-1)[scales + 7] = 0
    return raw.as_strided((2, BLOCK, 584), (PAGE, 584, 1))


def softmax_expect(values, sink=None):
    """(o, lse) for keys of the given values, q·k = value: o = Σ softmax(v)·v (all dims),
    lse without the sink; the sink scales o by sigmoid(lse - sink). No keys: (0, +inf)."""
    if not values:
        return 0.0, math.inf
    lse = math.log(sum(math.exp(v) for v in values))
    o = sum(math.exp(v - lse) * v for v in values)
    if sink is not None:
        o *= 1.0 / (1.0 + math.exp(sink - lse))
    return o, lse


def _close(name, got: torch.Tensor, want: float, rtol=1e-2):
    if math.isinf(want):
        ok = bool(torch.all(got == want))
    else:
        ok = bool(torch.allclose(got.float(), torch.full_like(got.float(), want), rtol=rtol,
                                 atol=1e-3))
    if not ok:
        raise AssertionError(f"{name}: expected {want} everywhere, got {got.flatten()[:8]}")


def check_decode(impl="auto"):
    from sparse_mla.ops.flashmla_decode import flash_mla_with_kvcache

    cache = v4_cache()
    # batch row 0: slots 0, 1 valid; slot 3 sits past topk_length; -1 unused.
    # batch row 1: slots 1, 3 valid; the NaN slot sits past topk_length.
    # batch row 2: topk_length 0 -> no keys.
    indices = torch.tensor([[[0, 1, 3, -1]], [[1, 3, NAN_SLOT, 0]], [[0, 1, 3, 0]]],
                           dtype=torch.int32)
    lengths = torch.tensor([2, 2, 0], dtype=torch.int32)
    q = torch.ones(3, 1, 2, 512, dtype=torch.bfloat16)
    q[:, :, 1] = 0.0  # head 1: all scores 0, a plain average
    sink = torch.tensor([-math.inf, 1.5], dtype=torch.float32)
    out, lse = flash_mla_with_kvcache(q, cache.unsqueeze(-2), indices, topk_length=lengths,
                                      attn_sink=sink, softmax_scale=1 / 512, block_size=BLOCK,
                                      impl=impl)
    for row, values in enumerate(([1.0, 2.0], [2.0, 4.0], [])):
        o0, l0 = softmax_expect(values)
        _close(f"decode row {row} head 0 out", out[row, 0, 0], o0)
        _close(f"decode row {row} head 0 lse", lse[row, 0, 0], l0)
        # head 1: scores 0, so o is the mean, lse = log(n); the sink 1.5 then scales o
        mean = sum(values) / len(values) if values else 0.0
        l1 = math.log(len(values)) if values else math.inf
        o1 = mean / (1.0 + math.exp(1.5 - l1)) if values else 0.0
        _close(f"decode row {row} head 1 out", out[row, 0, 1], o1)
        _close(f"decode row {row} head 1 lse", lse[row, 1, 0], l1)


def check_prefill(impl="auto"):
    from sparse_mla.ops.flashmla_decode import flash_mla_sparse_fwd

    kv = torch.full((5, 1, 512), math.nan, dtype=torch.bfloat16)
    for slot, value in KEY_VALUES.items():
        kv[slot] = value
    q = torch.ones(2, 1, 512, dtype=torch.bfloat16)
    # query 0: rows 0, 1 valid; 7 is beyond kv; -1 unused; query 1: only row 3 (length 1)
    indices = torch.tensor([[[0, 1, 7, -1]], [[3, NAN_SLOT, 0, 1]]], dtype=torch.int32)
    lengths = torch.tensor([4, 1], dtype=torch.int32)
    out, max_logits, lse = flash_mla_sparse_fwd(q, kv, indices, 1 / 512, topk_length=lengths,
                                                impl=impl)
    for row, values in enumerate(([1.0, 2.0], [4.0])):
        o, l = softmax_expect(values)
        _close(f"prefill query {row} out", out[row], o)
        _close(f"prefill query {row} lse", lse[row], l)
        _close(f"prefill query {row} max_logits", max_logits[row], max(values))


def main(argv):
    """`known_values.py [--absent MODULE ...]`: the checks, after asserting each MODULE does
    not import (an installed subset must not bring in other families)."""
    import importlib.util

    import sparse_mla.ops.flashmla_decode as decode

    absent = argv[argv.index("--absent") + 1:] if "--absent" in argv else []
    for name in absent:
        if importlib.util.find_spec(name) is not None:
            raise AssertionError(f"{name} is importable, but it should not be installed")
    check_decode()
    check_prefill()
    print(f"known values: decode and prefill match; flashmla_decode from {decode.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
