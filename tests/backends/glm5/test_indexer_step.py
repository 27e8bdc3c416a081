"""A whole GLM-5.3 DSA layer step (kpool indexer + MLA attention, docs/semantics.md §13)
against a float64 oracle.

The oracle keeps every token's raw indexer key and gate, so it pools each complete pool from
the history itself (the ops' reference ``pool`` / ``quantize_rotated``, no tail ring), scores
pools in float64 with plain torch, orders them (larger first, equal by lower id), expands them
and appends the tail, applies vLLM's short-context rule, and attends over the MLA records.
Selections must equal the step's exactly (ties included: pools built from two patterns give
bit-equal pooled keys); the pooled cache must hold the oracle's bytes at each pool's slot (on
CUDA within the Triton insert's rounding, see LayerSim) and 0xFF elsewhere. Small shapes:
index_topk 16, kpool 4, so contexts past 16 tokens really select.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_mla.backends.common.batch import BatchDescription
from sparse_mla.backends.glm5 import Glm5Config
from sparse_mla.backends.glm5.config import topk_width
from sparse_mla.backends.glm5.indexer_step import (Glm5IndexerConfig, Glm5IndexerInputs,
                                                   Glm5IndexerStep)
from sparse_mla.ops.indexer_kpool import alloc_cache, alloc_tail_cache, ring_size
from sparse_mla.ops.indexer_kpool import reference as kref
from sparse_mla.tests.backends.glm5.test_step import _decode_records
from sparse_mla.tests.helpers import CUDA, seeded

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
KP, ITOPK, IH, H = 4, 16, 4, 8
WIDTH = topk_width(ITOPK, KP)                 # 128
BS, NB = 16, 28                               # MLA cache: 7 blocks (112 tokens) a request
PNB, TNB = 48, 6                              # pooled-cache blocks, tail-ring blocks
RING = ring_size(KP, 1)                       # 8
POISON = 0xFF


class LayerSim:
    """Four requests with shuffled MLA / pooled block tables and tail blocks. A token's raw
    indexer key and gate are a function of (request, position); with ``ties`` every pool is
    one of two patterns, so pooled keys (and their scores) tie exactly."""

    def __init__(self, device, seed, pbs=3, ties=False, q_fp8=False, scale_fmt="fp32",
                 heads=H):
        self.g, self.dev, self.pbs, self.ties, self.q_fp8 = seeded(seed), device, pbs, ties, \
            q_fp8
        self.scale_fmt, self.heads = scale_fmt, heads
        # The Triton insert's exp is the GPU's: a pooled element may land one bf16 rounding
        # off the reference's (ops/indexer_kpool/triton_impl.py), so on CUDA the pooled
        # cache is compared within that and the oracle scores the keys the cache holds.
        # On CPU (reference, interpreter) the bytes are the reference's exactly.
        self.exact = torch.device(device).type == "cpu"
        self.k_cache = None
        g = self.g
        self.tables = torch.randperm(NB, generator=g).view(4, NB // 4).int()
        per = PNB // 4
        assert per * pbs * KP >= NB // 4 * BS
        self.ptables = torch.randperm(PNB, generator=g).view(4, per).int()
        self.tblocks = torch.randperm(TNB, generator=g)[:4]
        self.ape = torch.randn(KP, 128, generator=g) * 0.5
        self.pat_k = torch.randn(2, KP, 128, generator=g).bfloat16()
        self.pat_g = (torch.randn(2, KP, 128, generator=g) * 2).bfloat16()
        self.pat_of = torch.randint(0, 2, (4, 64), generator=g)
        self.hist = [[] for _ in range(4)]     # (k, gate) per position
        self.lens = [0, 0, 0, 0]

    def _kg(self, r, p):
        if self.ties:
            pat = int(self.pat_of[r, p // KP])
            return self.pat_k[pat, p % KP], self.pat_g[pat, p % KP]
        return (torch.randn(128, generator=self.g).bfloat16(),
                (torch.randn(128, generator=self.g) * 2).bfloat16())

    def step(self, decodes, prefills, pad=0, host_meta=False):
        g, rows = self.g, []
        for r, n in decodes + prefills:
            for j in range(n):
                p = self.lens[r] + j
                assert p == len(self.hist[r])
                self.hist[r].append(self._kg(r, p))
                rows.append((r, p))
            self.lens[r] += n
        reqs = [r for r, _ in decodes + prefills]
        T = len(rows) + pad
        qsl = torch.tensor([0] + [n for _, n in decodes + prefills]).cumsum(0).int()
        pos = torch.tensor([p for _, p in rows] + [0] * pad)
        slots = torch.tensor([int(self.tables[r, p // BS]) * BS + p % BS for r, p in rows]
                             + [-1] * pad)
        pslots = torch.tensor([int(self.ptables[r, p // KP // self.pbs]) * self.pbs
                               + p // KP % self.pbs if p % KP == KP - 1 else -1
                               for r, p in rows] + [-1] * pad)
        tslots = torch.tensor([int(self.tblocks[r]) * RING + p % RING for r, p in rows]
                              + [-1] * pad)
        q = (torch.randn(T, self.heads, 512, generator=g) * 0.5).bfloat16()
        kv = torch.randn(T, 512, generator=g).bfloat16()
        iq = torch.randn(T, IH, 128, generator=g).bfloat16()
        if self.q_fp8:
            iq = iq.to(torch.float8_e4m3fn)
        w = torch.rand(T, IH, generator=g) + 0.1
        k = torch.stack([self.hist[r][p][0] for r, p in rows]
                        + [torch.randn(128, generator=g).bfloat16() for _ in range(pad)]) \
            if T else torch.zeros(0, 128, dtype=torch.bfloat16)
        gate = torch.stack([self.hist[r][p][1] for r, p in rows]
                           + [torch.randn(128, generator=g).bfloat16() for _ in range(pad)]) \
            if T else torch.zeros(0, 128, dtype=torch.bfloat16)
        d = self.dev
        seq = torch.tensor([self.lens[r] for r in reqs]).int()
        b = BatchDescription(
            num_decodes=len(decodes), num_decode_tokens=sum(n for _, n in decodes),
            num_prefills=len(prefills), num_prefill_tokens=sum(n for _, n in prefills),
            query_start_loc=qsl.to(d), seq_lens=seq.to(d), positions=pos.to(d),
            swa_block_table=self.tables[reqs].to(d), swa_slot_mapping=slots.to(d),
            compressed_block_table=self.ptables[reqs].to(d),
            compressed_slot_mapping=pslots.to(d),
            max_decode_query_len=max([n for _, n in decodes], default=1),
            max_prefill_query_len=max([n for _, n in prefills], default=0),
            query_start_loc_cpu=qsl if host_meta else None,
            seq_lens_cpu=seq if host_meta else None)
        return q.to(d), kv.to(d), b, iq.to(d), w.to(d), k.to(d), gate.to(d), tslots.to(d), rows

    def inputs(self, st, k_cache, tail_cache, strided=False):
        _, _, _, iq, w, k, gate, tslots, _ = st
        if strided:       # rows (and q's heads) strided, last dims contiguous, as views give
            iq = torch.stack([iq, iq], dim=2)[:, :, 0]
            w, k, gate = (torch.cat([x, x], dim=1)[:, :x.shape[1]] for x in (w, k, gate))
            assert not (iq.is_contiguous() or w.is_contiguous() or k.is_contiguous())
        return Glm5IndexerInputs(iq, w, k, gate, self.ape.to(self.dev), k_cache, tail_cache,
                                 tslots)

    # -- the oracle -------------------------------------------------------------------------
    def pools(self, r, n):
        """Pools 0..n-1 of request r from its history: (e4m3 bytes [n, 128], fp32 scales [n],
        float64 keys [n, 128])."""
        if not n:
            return (torch.zeros(0, 128, dtype=torch.uint8), torch.zeros(0),
                    torch.zeros(0, 128, dtype=torch.float64))
        kk = torch.stack([torch.stack([self.hist[r][j * KP + s][0] for s in range(KP)])
                          for j in range(n)])
        gg = torch.stack([torch.stack([self.hist[r][j * KP + s][1] for s in range(KP)])
                          for j in range(n)])
        vals, scales = kref.quantize_rotated(kref.pool(kk, gg, self.ape))
        return vals, scales, vals.view(torch.float8_e4m3fn).double() * scales.double()[:, None]

    def expected_topk(self, st, capturing=False):
        q, _, b, iq, w, *_ , rows = st
        T, ndt = q.shape[0], b.num_decode_tokens
        out = torch.full((T, WIDTH), -1, dtype=torch.int32)
        seq = b.seq_lens.cpu()
        nreq = b.num_decodes + b.num_prefills
        # vLLM: decode rows look at the whole batch's longest sequence, prefill rows at the
        # prefills'; never while a graph is captured
        short_dec = not capturing and int(seq[:nreq].max()) <= ITOPK
        short_pf = not capturing and b.num_prefills and \
            int(seq[b.num_decodes:nreq].max()) <= ITOPK
        for i, (r, p) in enumerate(rows):
            if (short_dec if i < ndt else short_pf):
                out[i, :p + 1] = torch.arange(p + 1)
                continue
            n = (p + 1) // KP
            keys = self.pools(r, n)[2] if self.exact else kref.paged_pools(
                self.k_cache.cpu(), self.ptables[r], self.pbs, n, self.scale_fmt)[0]
            qd = iq[i].cpu().float().double()
            per_head = (qd[:, None, :] * keys[None]).sum(-1).clamp_min(0)
            s = (w[i].cpu().double()[:, None] * per_head).sum(0).tolist()
            best = sorted(range(n), key=lambda j: (-s[j], j))[:ITOPK // KP]
            ids = [j * KP + o for j in best for o in range(KP)]
            out[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            start = n * KP
            tail = list(range(start, p + 1))
            out[i, ITOPK:ITOPK + len(tail)] = torch.tensor(tail, dtype=torch.int32)
        return out

    def attention(self, st, cache, topk, scale):
        q, _, b, *_, rows = st
        kvf, _ = _decode_records(cache)
        out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
        for i, (r, _p) in enumerate(rows):
            ids = topk[i].long()
            ids = ids[ids >= 0]
            sl = self.tables[r].long()[ids // BS] * BS + ids % BS
            k = kvf[sl]
            s = (q[i].cpu().double() @ k.T) * scale
            out[i] = torch.softmax(s, -1) @ k
        return out

    def check_pooled_cache(self, k_cache):
        """Every complete pool's bytes at its slot (exactly, or on CUDA within two e4m3 steps
        with at most 1% of the bytes off); every other entry still poison."""
        pbs, self.k_cache = self.pbs, k_cache
        page = k_cache.cpu().reshape(PNB, -1)
        seen = torch.zeros(PNB, pbs, dtype=torch.bool)
        off = total = 0
        for r in range(4):
            n = self.lens[r] // KP
            vals, scales, want = self.pools(r, n)
            sb = kref.scale_bytes(scales, self.scale_fmt)
            got = kref.paged_pools(page.view(PNB, pbs, -1), self.ptables[r], pbs, n,
                                   self.scale_fmt)[0]
            for j in range(n):
                blk, o = int(self.ptables[r, j // pbs]), j % pbs
                t0 = pbs * 128 + o * 4
                seen[blk, o] = True
                if self.exact:
                    assert torch.equal(page[blk, o * 128:(o + 1) * 128], vals[j]), (r, j)
                    assert torch.equal(page[blk, t0:t0 + 4], sb[j]), (r, j, "scale")
                    continue
                amax = float(want[j].abs().max())
                assert not got[j].isnan().any(), (r, j)
                assert float((got[j] - want[j]).abs().max()) <= 2 * 32 * amax / 448, (r, j)
                off += int((page[blk, o * 128:(o + 1) * 128] != vals[j]).sum())
                total += 128
        assert off <= 0.01 * total + 128, f"{off} of {total} pooled bytes differ"
        for blk, o in (~seen).nonzero().tolist():
            assert (page[blk, o * 128:(o + 1) * 128] == POISON).all(), (blk, o)
            t0 = pbs * 128 + o * 4
            assert (page[blk, t0:t0 + 4] == POISON).all(), (blk, o, "scale")


def make_step(device, impl="reference", attention_impl=None, mode="auto", pbs=3,
              scale_fmt="fp32", heads=H):
    cfg = Glm5Config(num_heads=heads, max_num_tokens=128, max_num_reqs=4,
                     max_model_len=NB // 4 * BS, topk=WIDTH, block_size=BS)
    idx = Glm5IndexerConfig(num_heads=IH, index_topk=ITOPK, kpool=KP, scale_fmt=scale_fmt)
    step = Glm5IndexerStep(cfg, device, impl, idx, attention_impl=attention_impl,
                           fp8_mode=mode)
    cache = torch.full((NB, BS, 656), POISON, dtype=torch.uint8, device=device)
    k_cache = alloc_cache(PNB, pbs, device=device, fill=POISON)
    tail = alloc_tail_cache(TNB, RING, device=device, fill=POISON)
    return step, cache, k_cache, tail


def run_check(step, caches, sim, st, written, capturing=False, strided=False):
    cache, k_cache, tail = caches
    q, kv, b, *_, rows = st
    out = torch.full(q.shape[:2] + (512,), float("nan"), dtype=torch.bfloat16, device=q.device)
    step.forward(q, kv, {"kv": cache}, b, sim.inputs(st, k_cache, tail, strided), out=out)
    sim.check_pooled_cache(k_cache)
    want = sim.expected_topk(st, capturing)
    got = step.topk[:q.shape[0]].cpu()
    for i in range(q.shape[0]):
        assert torch.equal(got[i], want[i]), f"row {i} {rows[i] if i < len(rows) else 'pad'}" \
            f": got {got[i][got[i] >= 0].tolist()}, want {want[i][want[i] >= 0].tolist()}"
    ref = sim.attention(st, cache, want, step.config.softmax_scale)
    n = len(rows)
    torch.testing.assert_close(out[:n].cpu().double(), ref[:n], atol=2e-2, rtol=2e-2)
    assert (out[n:] == 0).all(), "graph-padding rows must come out as zeros"
    written.update(int(s) for s in b.slot_mapping.cpu() if s >= 0)
    keep = torch.ones(NB * BS, dtype=torch.bool)
    keep[torch.tensor(sorted(written), dtype=torch.long)] = False
    assert (cache.cpu().reshape(-1, 656)[keep] == POISON).all(), "unwritten MLA slots touched"
    return out


# Long contexts (selection really selects), an unaligned prefill chunk continuing a request
# (its first pool completed from the tail ring), MTP next_n 2 with a 1-token draft, padding.
LONG = (([], [(0, 41), (1, 10)], 0, False),
        ([(0, 2), (1, 2)], [(2, 30), (3, 7)], 3, True),
        ([(0, 2), (1, 1), (2, 2), (3, 2)], [], 2, False),
        ([(0, 1), (3, 1)], [(2, 17)], 0, True),
        ([(0, 2), (1, 2), (2, 2), (3, 2)], [], 0, False))
# Short contexts (vLLM's causal shortcut), then growing past index_topk.
SHORT = (([], [(0, 6), (1, 11)], 1, False),
         ([(0, 2), (1, 2)], [(2, 5)], 0, True),
         ([(0, 1), (1, 2)], [(2, 14)], 0, False),
         ([(0, 2), (1, 2), (2, 2)], [], 1, False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("plan", ["long", "short"])
def test_mixed_steps_match_oracle(device, ties, plan):
    step, *caches = make_step(device, "reference" if device == "cpu" else "auto")
    sim, written, ran = LayerSim(device, seed=7 + ties, ties=ties), set(), set()
    for decodes, prefills, pad, host in (LONG if plan == "long" else SHORT):
        run_check(step, caches, sim, sim.step(decodes, prefills, pad, host), written)
        ran |= set(step.explain())
    # the short plan's first steps score nothing: the scoring ops ran only once it grew
    assert ran >= set(Glm5IndexerStep.OPS)


def test_no_shortcut_while_capturing(monkeypatch):
    """A graph must hold the scoring path: short contexts are scored while capturing (the
    shortcut's rows would be baked into the graph)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    step, *caches = make_step("cpu")
    sim, written = LayerSim("cpu", seed=5, ties=True), set()
    for decodes, prefills, pad, host in SHORT:
        run_check(step, caches, sim, sim.step(decodes, prefills, pad, host), written,
                  capturing=True)
    assert "kpool_topk_prefill" in step.explain() or "kpool_topk_decode" in step.explain()


@pytest.mark.parametrize("pbs,scale_fmt,q_fp8", [(5, "ue8m0", False), (7, "fp32", True)])
def test_block_sizes_scale_bytes_fp8_query_strided_inputs(pbs, scale_fmt, q_fp8):
    step, *caches = make_step("cpu", pbs=pbs, scale_fmt=scale_fmt)
    sim = LayerSim("cpu", seed=3, pbs=pbs, ties=True, q_fp8=q_fp8, scale_fmt=scale_fmt)
    written = set()
    for decodes, prefills, pad, host in LONG[:3]:
        run_check(step, caches, sim, sim.step(decodes, prefills, pad, host), written,
                  strided=True)


def test_config_and_bad_input():
    assert Glm5IndexerConfig().width == 2051
    cfg = Glm5Config(num_heads=H, max_num_tokens=8, max_num_reqs=1, max_model_len=64)
    step = Glm5IndexerStep(cfg)                 # GLM-5.3-Flash defaults: 2176 = topk_width
    assert step.topk.shape == (8, 2176) and step.index.num_heads == 32
    with pytest.raises(ValueError, match="config.topk"):
        Glm5IndexerStep(dataclasses.replace(cfg, topk=2048))
    with pytest.raises(ValueError, match="index_topk"):
        Glm5IndexerConfig(index_topk=18)
    step, cache, k_cache, tail = make_step("cpu")
    sim = LayerSim("cpu", seed=1)
    st = sim.step([], [(0, 9)])
    q, kv, b = st[:3]
    out = torch.empty(9, H, 512, dtype=torch.bfloat16)
    good = sim.inputs(st, k_cache, tail)
    before = [t.clone() for t in (cache, k_cache, tail)]
    bad_slots = b.compressed_slot_mapping.clone()
    bad_slots[0] = 0                            # position 0 does not end a pool
    cases = (
        (dataclasses.replace(good, q=good.q[:, :2]), b, "indexer.q"),
        (dataclasses.replace(good, weights=good.weights.double()), b, "indexer.weights"),
        (dataclasses.replace(good, slot_mapping=bad_slots), b, "slot_mapping"),
        (dataclasses.replace(good, ape=good.ape[:2]), b, "ape"),
        (dataclasses.replace(good, k_cache=k_cache.view(PNB, -1)), b, "indexer.k_cache"),
        (good, dataclasses.replace(b, compressed_block_table=None), "block table"),
        (good, dataclasses.replace(b, topk_indices=torch.zeros(9, WIDTH, dtype=torch.int32)),
         "topk_indices"),
    )
    for ix, bb, name in cases:
        with pytest.raises((ValueError, TypeError), match=name):
            step.forward(q, kv, {"kv": cache}, bb, ix, out=out)
    bad_table = b.compressed_block_table.clone()
    bad_table[0, 0] = PNB                       # a prefill's pools on a missing block
    with pytest.raises(ValueError, match=r"indexer.block_table\[0, 0\]"):
        step.forward(q, kv, {"kv": cache}, b, dataclasses.replace(good, block_table=bad_table),
                     out=out)
    for t, t0 in zip((cache, k_cache, tail), before):
        assert torch.equal(t.view(torch.uint8), t0.view(torch.uint8)), "a rejected step wrote"
