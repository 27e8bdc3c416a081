"""A GLM-5.3 DSA attention step (docs/semantics.md §13.5) against a float64 oracle.

The oracle reads the 656 B records back with its own decoding (e4m3 bytes times the fp32
group scale), checks that the RoPE bytes are +0.0 and attends over each token's selected
request-local positions with q's 512 dims alone — no 576-wide padding — so it fails if the
backend's zero tail or the record's zero RoPE leaked anything into the scores. Caches start
poisoned (0xFF, NaN when read) and every slot the steps did not write must stay so.
"""
from __future__ import annotations

import pytest
import torch

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.glm5 import Glm5Config, Glm5FlashMLABackend
from sparse_mla.tests.helpers import CUDA, seeded

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
BS, NB, H, TOPK = 16, 24, 8, 11
POISON = 0xFF


class Sim:
    """Requests with shuffled block tables; each step names (req, n_new) decodes and prefills."""

    def __init__(self, device, seed, heads=H):
        self.g, self.dev, self.heads = seeded(seed), device, heads
        perm = torch.randperm(NB, generator=self.g)
        self.tables = perm.view(4, NB // 4).int()
        self.lens = [0, 0, 0, 0]

    def step(self, decodes, prefills, pad=0):
        g, rows = self.g, []
        for r, n in decodes + prefills:
            rows += [(r, self.lens[r] + j) for j in range(n)]
            self.lens[r] += n
        reqs = [r for r, _ in decodes + prefills]
        T = len(rows) + pad
        qsl = torch.tensor([0] + [n for _, n in decodes + prefills]).cumsum(0).int()
        pos = torch.tensor([p for _, p in rows] + [0] * pad)
        slots = torch.tensor([int(self.tables[r, p // BS]) * BS + p % BS for r, p in rows]
                             + [-1] * pad)
        topk = torch.full((T, TOPK), -1, dtype=torch.int32)
        for i, (_, p) in enumerate(rows):
            k = int(torch.randint(0, min(TOPK, p + 1) + 1, (1,), generator=g))
            if i % 5 == 0:
                k = min(TOPK, p + 1)            # the newest token included, a full row
            sel = torch.randperm(p + 1, generator=g)[:k]
            topk[i, :k] = sel.int()
        q = (torch.randn(T, self.heads, 512, generator=g) * 0.5).bfloat16()
        kv = torch.randn(T, 512, generator=g).bfloat16()
        d = self.dev
        b = BatchDescription(
            num_decodes=len(decodes), num_decode_tokens=sum(n for _, n in decodes),
            num_prefills=len(prefills), num_prefill_tokens=sum(n for _, n in prefills),
            query_start_loc=qsl.to(d), seq_lens=torch.tensor(
                [self.lens[r] for r in reqs]).int().to(d),
            positions=pos.to(d), swa_block_table=self.tables[reqs].to(d),
            swa_slot_mapping=slots.to(d), topk_indices=topk.to(d),
            max_decode_query_len=max([n for _, n in decodes], default=1),
            max_prefill_query_len=max([n for _, n in prefills], default=0))
        return q.to(d), kv.to(d), b, rows, reqs


def _decode_records(cache):
    rec = cache.cpu().reshape(-1, 656)
    data = rec[:, :512].contiguous().view(torch.float8_e4m3fn).double()
    scale = rec[:, 512:528].contiguous().view(torch.float32).double()
    return data * scale.repeat_interleave(128, dim=1), rec[:, 528:]


def oracle(q, cache, b, rows, reqs, sim, scale):
    kvf, _ = _decode_records(cache)
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    for i, (r, _p) in enumerate(rows):
        ids = b.topk_indices[i].cpu().long()
        ids = ids[ids >= 0]
        if not ids.numel():
            continue
        sl = sim.tables[r].long()[ids // BS] * BS + ids % BS
        k = kvf[sl]
        s = (q[i].cpu().double() @ k.T) * scale
        out[i] = torch.softmax(s, -1) @ k
    return out


def _check(be, cache, sim, step, written):
    q, kv, b, rows, reqs = step
    out = torch.full((q.shape[0], q.shape[1], 512), float("nan"), dtype=torch.bfloat16,
                     device=q.device)
    be.forward(q, kv, {"kv": cache}, b, out=out)
    written.update(int(s) for s in b.slot_mapping.cpu() if s >= 0)
    ref = oracle(q, cache, b, rows, reqs, sim, be.config.softmax_scale)
    n = len(rows)
    torch.testing.assert_close(out[:n].cpu().double(), ref[:n], atol=2e-2, rtol=2e-2)
    assert (out[n:] == 0).all(), "graph-padding rows must come out as zeros"
    _, rope = _decode_records(cache)
    w = torch.tensor(sorted(written))
    assert (rope[w] == 0).all(), "RoPE bytes of written records must be +0.0"
    keep = torch.ones(NB * BS, dtype=torch.bool)
    keep[w] = False
    assert (cache.cpu().reshape(-1, 656)[keep] == POISON).all(), "unwritten slots touched"
    return out


def _backend(device, mode="auto", heads=H):
    cfg = Glm5Config(num_heads=heads, max_num_tokens=128, max_num_reqs=4,
                     max_model_len=NB // 4 * BS, topk=TOPK, block_size=BS)
    be = Glm5FlashMLABackend(cfg, device=device, fp8_mode=mode)
    cache = torch.full((NB, BS, 656), POISON, dtype=torch.uint8, device=device)
    return be, cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["separate", "mixed"])
def test_mixed_steps_with_mtp_match_oracle(device, mode):
    be, cache = _backend(device, mode)
    sim, written = Sim(device, seed=5), set()
    # prefills from 0; MTP next_n 2 decodes beside a prefill chunk with context; decodes
    for decodes, prefills, pad in (([], [(0, 40), (1, 23)], 0),
                                   ([(0, 2), (1, 2)], [(2, 30), (3, 9)], 3),
                                   ([(0, 2), (1, 2), (2, 2), (3, 2)], [], 2),
                                   ([(0, 1), (3, 1)], [(2, 17)], 0)):
        _check(be, cache, sim, sim.step(decodes, prefills, pad), written)


def test_defaults_and_bad_input():
    cfg = Glm5Config(num_heads=H, max_num_tokens=8, max_num_reqs=1, max_model_len=64)
    assert cfg.topk == 2176 and cfg.softmax_scale == 256 ** -0.5
    with pytest.raises(ValueError, match="cache_dtype"):
        Glm5FlashMLABackend(cfg, cache_dtype="bfloat16")
    be, cache = _backend("cpu")
    q, kv, b, rows, reqs = Sim("cpu", 1).step([], [(0, 5)])
    before = cache.clone()
    for bad_q, bad_kv, name in ((q.new_zeros(5, H, 576)[..., :500], kv, "q"),
                                (q, torch.zeros(5, 576, dtype=torch.bfloat16), "kv")):
        with pytest.raises(ValueError, match=name):
            be.forward(bad_q, bad_kv, {"kv": cache}, b,
                       out=torch.empty(5, H, 512, dtype=torch.bfloat16))
    assert torch.equal(cache, before)
    with pytest.raises(ValueError, match="write"):
        be.attend(q, {"kv": cache}, b, out=torch.empty(5, H, 512, dtype=torch.bfloat16))
