"""A tiny engine for backend tests: requests with their own block tables, steps that mix
decodes (MTP included) and chunked prefills, the indexer's top-k and the compressor's rows as
random data, and the step oracle's expected output from the history of rows.

The simulator fills a ``BatchDescription`` exactly as an engine would, and keeps, per
request, every row it asked the backend to write (by position, and by compressed entry), so
the oracle never reads a cache.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from sparse_mla.backends.common import BatchDescription
from sparse_mla.backends.v4 import LayerConfig, LayerKind
from sparse_mla.tests.backends import oracle

D = 512


def cos_sin_table(max_pos: int, theta: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.sin()], -1).float()


@dataclasses.dataclass
class Request:
    rid: int
    computed: int = 0                                   # tokens already in the caches
    swa_blocks: List[int] = dataclasses.field(default_factory=list)
    comp_blocks: List[int] = dataclasses.field(default_factory=list)
    rows: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)   # pos → row
    entries: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # entry → row


@dataclasses.dataclass
class Step:
    q: torch.Tensor
    kv: torch.Tensor
    batch: BatchDescription
    compressed_kv: Optional[torch.Tensor]
    expected: torch.Tensor          # [T, H, 512] float64
    swa_slots: List[int]            # slots this step writes
    comp_slots: List[int]


class Simulator:
    def __init__(self, cfg: LayerConfig, device, storage: oracle.Storage, seed: int = 0,
                 swa_blocks: int = 64, comp_blocks: int = 64, table_width: int = 32,
                 theta: float = 10000.0, comp_seed: Optional[int] = None,
                 comp_storage: Optional[oracle.Storage] = None, rotate_compressed: bool = False):
        """``theta``: the layer's RoPE base (layers of one model may differ). ``comp_seed``:
        draw the compressor's rows, the compressed blocks and the top-k from their own
        stream, so two layers given the same ``comp_seed`` see the same compressed entries
        and top-k (DeepSeek-V4.1's layers sharing a source layer's cache and indexer).
        ``comp_storage``: the compressed cache's record where it differs from ``storage``.
        ``rotate_compressed``: the compressor's rows arrive unrotated and the write rotates
        entry c at position c · ratio (DeepSeek-V4.1); otherwise they are stored as given."""
        self.cfg, self.device, self.storage = cfg, torch.device(device), storage
        self.comp_storage = comp_storage or storage
        self.rotate_compressed = rotate_compressed
        self.g = torch.Generator().manual_seed(seed)
        self.gc = self.g if comp_seed is None else torch.Generator().manual_seed(comp_seed)
        self.cos_sin = cos_sin_table(cfg.max_model_len + 8, theta)
        self.sink = torch.randn(cfg.num_heads, generator=self.g)
        self.requests: Dict[int, Request] = {}
        self.free_swa = torch.randperm(swa_blocks, generator=self.g).tolist()
        self.free_comp = torch.randperm(comp_blocks, generator=self.gc).tolist()
        self.table_width = table_width
        self.num_blocks = {"swa": swa_blocks, "compressed": comp_blocks}

    # -- blocks ---------------------------------------------------------------------------
    def _slot(self, blocks, free, index, bs):
        while len(blocks) <= index // bs:
            blocks.append(free.pop())
        return blocks[index // bs] * bs + index % bs

    def _table(self, reqs: List[Request], attr: str) -> torch.Tensor:
        # Unused table entries hold junk block ids far outside the cache (a backend that
        # read them would fault or be caught by the poisoned caches).
        t = torch.full((len(reqs), self.table_width), 10 ** 6, dtype=torch.int32)
        for i, r in enumerate(reqs):
            b = getattr(r, attr)
            t[i, :len(b)] = torch.tensor(b, dtype=torch.int32)
        return t

    # -- a step ---------------------------------------------------------------------------
    def step(self, decodes: List[Tuple[int, int]], prefills: List[Tuple[int, int]],
             pad_tokens: int = 0, pad_reqs: int = 0) -> Step:
        """``decodes`` / ``prefills``: (request id, new tokens). ``pad_tokens`` rows of
        graph padding after the decode tokens (decode-only steps) or at the end;
        ``pad_reqs`` empty requests after the decodes (a padded CUDA-graph batch)."""
        cfg, g, H = self.cfg, self.g, self.cfg.num_heads
        kind, W, ratio = cfg.kind, cfg.window, cfg.kind.ratio
        order = [(rid, n) for rid, n in decodes] + [(rid, n) for rid, n in prefills]
        reqs = [self.requests.setdefault(rid, Request(rid)) for rid, _ in order]
        qlens = [n for _, n in order]
        seq = [r.computed + n for r, n in zip(reqs, qlens)]
        if pad_reqs and prefills:
            raise ValueError("padded requests only in decode-only steps")
        n_real = sum(qlens)
        T = n_real + pad_tokens
        # V4's write RMS-norms q; a q that arrives normed (DeepSeek-V4.1) is drawn at the
        # scale the norm gives (unit RMS), the regime cases.py's row bounds are set for.
        q = (torch.randn(T, H, D, generator=g) * (2 if cfg.apply_q_norm else 1)
             ).to(torch.bfloat16)
        kv = torch.randn(T, D, generator=g).to(torch.bfloat16)
        positions = torch.zeros(T, dtype=torch.int64)
        swa_slot = torch.full((T,), -1, dtype=torch.int64)
        comp_rows = torch.randn(T, D, generator=self.gc).to(torch.bfloat16) * 1.5
        comp_slot = torch.full((T,), -1, dtype=torch.int64)
        topk = torch.full((T, cfg.topk if kind.uses_topk else 0), -1, dtype=torch.int32)
        tok_req = []
        t = 0
        swa_slots, comp_slots = [], []
        for r, n, s in zip(reqs, qlens, seq):
            for j in range(n):
                p = s - n + j
                positions[t] = p
                sl = self._slot(r.swa_blocks, self.free_swa, p, cfg.swa_block_size)
                swa_slot[t] = sl
                swa_slots.append(sl)
                r.rows[p] = t          # replaced by the stored key below
                if kind.compressed and (p + 1) % ratio == 0:
                    c = p // ratio
                    cs = self._slot(r.comp_blocks, self.free_comp, c, cfg.compressed_block_size)
                    comp_slot[t] = cs
                    comp_slots.append(cs)
                    r.entries[c] = -1 - t  # replaced by the stored key below
                if kind.uses_topk:
                    avail = (p + 1) // ratio
                    m = min(avail, cfg.topk)
                    ids = torch.randperm(avail, generator=self.gc)[:m]
                    topk[t, :m] = ids.to(torch.int32)
                tok_req.append((r, p, t))
                t += 1
        # the rows as the caches hold them, stored once per row (the oracle's history)
        if n_real:
            keys_kv = self.storage.key(oracle.rope(kv[:n_real].double(),
                                                  self.cos_sin[positions[:n_real]]))
            c_rows = comp_rows[:n_real].double()
            if self.rotate_compressed:
                at = positions[:n_real] // ratio * ratio
                c_rows = oracle.rope(c_rows, self.cos_sin[at])
            keys_c = self.comp_storage.key(c_rows)
            for r in {id(r): r for r in reqs}.values():
                for p, v in r.rows.items():
                    if isinstance(v, int):
                        r.rows[p] = keys_kv[v]
                for c, v in r.entries.items():
                    if isinstance(v, int):
                        r.entries[c] = keys_c[-1 - v]
        # expected output from the history (this step's rows included)
        exp = torch.zeros(T, H, D, dtype=torch.float64)
        scale = cfg.softmax_scale
        for r, p, t in tok_req:
            q_in = q[t].float()             # DeepSeek-V4.1: q arrives normed
            if cfg.apply_q_norm:
                q_in = oracle.rms_norm(q[t].double(), cfg.eps)
            q_rot = oracle.rope(q_in, self.cos_sin[p])
            qq = self.storage.query(q_rot)
            keys = [r.rows[i] for i in range(max(p - W + 1, 0), p + 1)]
            if kind.uses_topk:
                keys += [r.entries[int(c)] for c in topk[t] if c >= 0]
            elif kind is LayerKind.C128A:
                n = min((p + 1) // ratio, cfg.compressed_width)
                keys += [r.entries[c] for c in range(n)]
            exp[t] = oracle.attend(qq, torch.stack(keys), self.sink, scale)
        for r, s in zip(reqs, seq):
            r.computed = s
        dev = self.device
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        if pad_reqs:
            qsl = qsl[:len(decodes) + 1] + [qsl[len(decodes)]] * pad_reqs
            seq = seq[:len(decodes)] + [0] * pad_reqs
            reqs = reqs[:len(decodes)] + [Request(-1) for _ in range(pad_reqs)]
        Rd = len(decodes) + pad_reqs
        Td = sum(n for _, n in decodes) + (pad_tokens if not prefills else 0)
        batch = BatchDescription(
            num_decodes=Rd if Td else 0, num_decode_tokens=Td, num_prefills=len(prefills),
            num_prefill_tokens=sum(n for _, n in prefills),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=dev),
            positions=positions.to(dev), swa_block_table=self._table(reqs, "swa_blocks").to(dev),
            swa_slot_mapping=swa_slot.to(dev),
            compressed_block_table=(self._table(reqs, "comp_blocks").to(dev)
                                    if kind.compressed else None),
            compressed_slot_mapping=comp_slot.to(dev) if kind.compressed else None,
            topk_indices=topk.to(dev) if kind.uses_topk else None,
            max_decode_query_len=max([n for _, n in decodes], default=1),
            max_prefill_query_len=max([n for _, n in prefills], default=0),
            query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int32))
        return Step(q.to(dev), kv.to(dev), batch,
                    comp_rows.to(dev) if kind.compressed else None, exp, swa_slots, comp_slots)

    def finish(self, rid: int) -> None:
        r = self.requests.pop(rid)
        self.free_swa.extend(r.swa_blocks)
        self.free_comp.extend(r.comp_blocks)


# Paged records (docs/semantics.md §2.2, §12), written down here rather than read from
# ops.common.formats: (data row bytes, scale row bytes); a page holds all its data rows, then
# all its scale rows, or (the token-inline V4.1 layouts, vLLM 0.33.0) each token's data row
# and then its scale row.
PAGE_ROWS = {"v4": (576, 8), "v41": (512, 16), "v41_fp4": (256, 32)}
INLINE_ROWS = {"v41_inline": (512, 16), "v41_fp4_inline": (256, 32)}


def written_bytes_mask(cache: torch.Tensor, slots, fmt: str, block_size: int) -> torch.Tensor:
    """A bool mask over the cache's whole allocation: the bytes of ``slots``' rows (``fmt``:
    a ``PAGE_ROWS`` or ``INLINE_ROWS`` record, or "plain")."""
    flat = torch.empty(0, dtype=torch.uint8, device=cache.device)
    flat.set_(cache.untyped_storage())
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    base = cache.storage_offset() * cache.element_size()
    s0 = cache.stride(0) * cache.element_size()
    for s in set(slots):
        b, o = divmod(s, block_size)
        if fmt in INLINE_ROWS:
            rec = sum(INLINE_ROWS[fmt])
            a = base + b * s0 + o * rec
            mask[a:a + rec] = True
        elif fmt != "plain":
            data, scales = PAGE_ROWS[fmt]
            a = base + b * s0 + o * data
            mask[a:a + data] = True
            a = base + b * s0 + block_size * data + o * scales
            mask[a:a + scales] = True
        else:
            row = D * cache.element_size()
            a = base + b * s0 + o * cache.stride(1) * cache.element_size()
            mask[a:a + row] = True
    return mask
