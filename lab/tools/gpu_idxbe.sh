#!/usr/bin/env bash
# The indexer inside a backend step (backends/v4/indexer_step.py) on a GPU machine without
# Bazel (the lead's H200): its tests with their CUDA parametrizations (CUDA-graph replay
# included), then a decode-step timing table: the C4A step given the top-k, the same step with
# the indexer inside (insert + top-k + attention), and the indexer's top-k op alone, for a
# batch of B decode requests (s_q 1 and 2) over a long context. Logs under
# ${OUT:-/tmp/gpu_idxbe}; the table prints last.
#   bash lab/tools/gpu_idxbe.sh            (a few minutes)
#   bash lab/tools/gpu_idxbe.sh --smoke    the table's code on CPU, tiny shapes (no tests)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_idxbe}
mkdir -p "$out"
rc_tests=0
smoke=0
[ "${1:-}" = "--smoke" ] && smoke=1
if [ $smoke = 0 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/gpu.txt"
  OMP_NUM_THREADS=2 python3 -m pytest -q -rs -p no:cacheprovider tests/backends/v4/test_indexer_step.py \
    2>&1 | tee "$out/pytest.log" | tail -15
  rc_tests=${PIPESTATUS[0]}
fi
python3 - $smoke <<'PY' 2>"$out/bench.err" | tee "$out/bench.txt"
import dataclasses
import sys
import torch
from sparse_mla.backends.common import BatchDescription
from sparse_mla.backends.v4 import LayerConfig, LayerKind
from sparse_mla.backends.v4.indexer_step import IndexerInputs, IndexerStep
from sparse_mla.backends.v4 import FlashMLABackend
from sparse_mla.ops.indexer import indexer_topk_decode

smoke = sys.argv[1] == "1"
dev = "cpu" if smoke else "cuda"
B, CTX, HEADS, IDX_HEADS, TOPK = (2, 256, 2, 4, 16) if smoke else (64, 65536, 64, 64, 512)
g = torch.Generator().manual_seed(0)


def timed(fn, reps):
    if smoke:
        fn()
        return float("nan")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


rows = []
for s_q in (1, 2):
    T = B * s_q
    cfg = LayerConfig(num_heads=HEADS, kind=LayerKind.C4A, max_num_tokens=T, max_num_reqs=B,
                      max_model_len=CTX + 8, topk=TOPK)
    be = FlashMLABackend(cfg, dev)
    swa_bs, c_bs = cfg.swa_block_size, cfg.compressed_block_size
    swa_w, c_w = -(-(CTX + 8) // swa_bs), -(-(CTX // 4 + 2) // c_bs)
    caches = be.allocate_caches({"swa": B * swa_w, "compressed": B * c_w}, fill=0)
    step = IndexerStep(be)
    icache = step.allocate_cache(B * c_w, fp8=True, fill=0)
    seq = torch.full((B,), CTX, dtype=torch.int32)
    pos = (seq.repeat_interleave(s_q) - s_q + torch.arange(s_q).repeat(B)).long()
    swa_table = torch.arange(B * swa_w, dtype=torch.int32).view(B, swa_w)
    c_table = torch.arange(B * c_w, dtype=torch.int32).view(B, c_w)
    req = torch.arange(T) // s_q
    swa_slots = swa_table[req, pos // swa_bs].long() * swa_bs + pos % swa_bs
    done = (pos + 1) % 4 == 0
    c_slots = torch.where(done, c_table[req, pos // 4 // c_bs].long() * c_bs + (pos // 4) % c_bs,
                          -1)
    batch = BatchDescription(
        num_decodes=B, num_decode_tokens=T, num_prefills=0, num_prefill_tokens=0,
        query_start_loc=(torch.arange(B + 1) * s_q).int().to(dev), seq_lens=seq.to(dev),
        positions=pos.to(dev), swa_block_table=swa_table.to(dev),
        swa_slot_mapping=swa_slots.to(dev), compressed_block_table=c_table.to(dev),
        compressed_slot_mapping=c_slots.to(dev), max_decode_query_len=s_q)
    q = torch.randn(T, HEADS, 512, generator=g).to(torch.bfloat16).to(dev)
    kv = torch.randn(T, 512, generator=g).to(torch.bfloat16).to(dev)
    ckv = torch.randn(T, 512, generator=g).to(torch.bfloat16).to(dev)
    cos_sin = torch.randn(CTX + 8, 64, generator=g).to(dev)
    sink = torch.randn(HEADS, generator=g).to(dev)
    out = torch.empty(T, HEADS, 512, dtype=torch.bfloat16, device=dev)
    ix = IndexerInputs(torch.randn(T, IDX_HEADS, 128, generator=g).to(torch.bfloat16).to(dev),
                       torch.randn(T, IDX_HEADS, generator=g).to(dev),
                       torch.randn(T, 128, generator=g).to(dev), icache)
    with_topk = dataclasses.replace(batch, topk_indices=torch.randint(
        0, CTX // 4 - 1, (T, TOPK), generator=g, dtype=torch.int32).to(dev))
    given = timed(lambda: be.forward(q, kv, caches, with_topk, cos_sin, sink, out, ckv), 20)
    fused = timed(lambda: step.forward(q, kv, caches, batch, ix, cos_sin, sink, out, ckv), 20)
    sel = torch.empty(T, TOPK, dtype=torch.int32, device=dev)
    op = timed(lambda: indexer_topk_decode(ix.q, ix.weights, icache, batch.seq_lens,
                                           c_table.to(dev), sel, next_n=s_q), 20)
    rows.append((s_q, given, fused, op))
print(f"decode B {B}, context {CTX} ({CTX // 4} indexer entries), {HEADS} heads, "
      f"{IDX_HEADS} indexer heads, top-{TOPK}, fp8 indexer cache; microseconds per step")
print(f"{'s_q':>4} {'step(given topk)':>17} {'step+indexer':>13} {'topk op alone':>14}")
for s_q, a, b, c in rows:
    print(f"{s_q:>4} {a:>17.1f} {b:>13.1f} {c:>14.1f}")
PY
rc_bench=${PIPESTATUS[0]}
echo "pytest rc=$rc_tests bench rc=$rc_bench"
[ "$rc_tests" = 0 ] && [ "$rc_bench" = 0 ]
