"""A tiny engine for the V3.2 backend tests: requests with their own block tables, steps that
mix decodes (MTP included) and chunked prefills, the indexer's top-k as random positions, and
the step oracle: dense float64 attention from the rows each request wrote (kept here, as the
cache stores them), never read back from the cache.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

import torch

from sparse_mla.backends.common import BatchDescription
from sparse_mla.backends.v32 import V32Config
from sparse_mla.ops.common import quant

D_QK, D_V = 576, 512


def stored_key(kv_c: torch.Tensor, k_pe: torch.Tensor, fp8: bool) -> torch.Tensor:
    """[n, 576] float64: a row as the cache holds it (656 B: vLLM's fp32-scale e4m3 of the
    latent, dequantized as FlashMLA does (bf16); bf16: the row itself)."""
    if fp8:
        return quant.dequantize_v32(quant.quantize_v32(kv_c, k_pe, "fp32")).double()
    return torch.cat([kv_c, k_pe], 1).to(torch.bfloat16).double()


def attend(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, 576], keys [n, 576] float64 → [H, 512]: scores over 576 dims, values 512."""
    s = scale * (q @ keys.T)
    return torch.softmax(s, -1) @ keys[:, :D_V]


@dataclasses.dataclass
class Request:
    rid: int
    computed: int = 0
    blocks: List[int] = dataclasses.field(default_factory=list)
    rows: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)   # pos → key


@dataclasses.dataclass
class Step:
    q: torch.Tensor
    kv: torch.Tensor                # [T, 576]: kv_c (512), then k_pe (64)
    batch: BatchDescription
    expected: torch.Tensor          # [T, H, 512] float64
    slots: List[int]                # slots this step writes


class Simulator:
    def __init__(self, cfg: V32Config, device, fp8: bool, seed: int = 0, num_blocks: int = 48,
                 table_width: int = 24):
        self.cfg, self.device, self.fp8 = cfg, torch.device(device), fp8
        self.g = torch.Generator().manual_seed(seed)
        self.requests: Dict[int, Request] = {}
        self.free = torch.randperm(num_blocks, generator=self.g).tolist()
        self.num_blocks, self.table_width = num_blocks, table_width

    def _slot(self, r: Request, pos: int) -> int:
        bs = self.cfg.block_size
        while len(r.blocks) <= pos // bs:
            r.blocks.append(self.free.pop())
        return r.blocks[pos // bs] * bs + pos % bs

    def _table(self, reqs) -> torch.Tensor:
        # unused entries: junk block ids far outside the cache
        t = torch.full((len(reqs), self.table_width), 10 ** 6, dtype=torch.int32)
        for i, r in enumerate(reqs):
            t[i, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        return t

    def step(self, decodes: List[Tuple[int, int]], prefills: List[Tuple[int, int]],
             pad_tokens: int = 0, pad_reqs: int = 0) -> Step:
        """``decodes`` / ``prefills``: (request id, new tokens); ``pad_tokens`` graph-padding
        rows at the end; ``pad_reqs`` empty requests after the decodes (decode-only steps)."""
        cfg, g, H, K = self.cfg, self.g, self.cfg.num_heads, self.cfg.topk
        order = decodes + prefills
        reqs = [self.requests.setdefault(rid, Request(rid)) for rid, _ in order]
        qlens = [n for _, n in order]
        seq = [r.computed + n for r, n in zip(reqs, qlens)]
        n_real = sum(qlens)
        T = n_real + pad_tokens
        q = (torch.randn(T, H, D_QK, generator=g) / 2).to(torch.bfloat16)
        kv_c = torch.randn(T, D_V, generator=g).to(torch.bfloat16)
        k_pe = torch.randn(T, D_QK - D_V, generator=g).to(torch.bfloat16)
        positions = torch.zeros(T, dtype=torch.int64)
        slot = torch.full((T,), -1, dtype=torch.int64)
        topk = torch.full((T, K), -1, dtype=torch.int32)
        keys = stored_key(kv_c[:n_real], k_pe[:n_real], self.fp8)
        toks, slots, t = [], [], 0
        for r, n, s in zip(reqs, qlens, seq):
            for j in range(n):
                p = s - n + j
                positions[t] = p
                slot[t] = self._slot(r, p)
                slots.append(int(slot[t]))
                r.rows[p] = keys[t]
                # the indexer: distinct positions in [0, p], a left-aligned prefix (a few
                # rows short of top-k even with enough tokens)
                m = min(p + 1, K) - int(torch.randint(0, 3, (1,), generator=g))
                m = max(m, 1)
                topk[t, :m] = torch.randperm(p + 1, generator=g)[:m].to(torch.int32)
                toks.append((r, t))
                t += 1
        exp = torch.zeros(T, H, D_V, dtype=torch.float64)
        for r, t in toks:
            sel = [int(i) for i in topk[t] if i >= 0]
            exp[t] = attend(q[t].double(), torch.stack([r.rows[i] for i in sel]),
                            cfg.softmax_scale)
        for r, s in zip(reqs, seq):
            r.computed = s
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        if pad_reqs:
            if prefills:
                raise ValueError("padded requests only in decode-only steps")
            qsl += [qsl[-1]] * pad_reqs
            seq += [0] * pad_reqs
            reqs += [Request(-1) for _ in range(pad_reqs)]
        Rd = len(decodes) + pad_reqs
        Td = sum(n for _, n in decodes)
        dev = self.device
        batch = BatchDescription(
            num_decodes=Rd if Td else 0, num_decode_tokens=Td, num_prefills=len(prefills),
            num_prefill_tokens=sum(n for _, n in prefills),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
            positions=positions.to(dev), swa_block_table=self._table(reqs).to(dev),
            swa_slot_mapping=slot.to(dev), topk_indices=topk.to(dev),
            max_decode_query_len=max([n for _, n in decodes], default=1),
            max_prefill_query_len=max([n for _, n in prefills], default=0),
            query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32))
        kv = torch.cat([kv_c, k_pe], 1)
        return Step(q.to(dev), kv.to(dev), batch, exp, slots)


def written_bytes_mask(cache: torch.Tensor, slots, block_size: int) -> torch.Tensor:
    """A bool mask over the cache's whole allocation: the bytes of ``slots``' rows (656 B
    records, or 576 bf16 values)."""
    flat = torch.empty(0, dtype=torch.uint8, device=cache.device)
    flat.set_(cache.untyped_storage())
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    es = cache.element_size()
    base, s0, s1 = cache.storage_offset() * es, cache.stride(0) * es, cache.stride(1) * es
    row = cache.shape[2] * es
    for s in set(slots):
        b, o = divmod(s, block_size)
        a = base + b * s0 + o * s1
        mask[a:a + row] = True
    return mask
