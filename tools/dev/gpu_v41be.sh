#!/usr/bin/env bash
# DeepSeek-V4.1 backend (issue 52, item 4) on a GPU machine without Bazel (H200: torch 2.11,
# Triton 3.6). Runs the V4.1 backend tests with their CUDA parametrizations (step oracle,
# lifecycle, CUDA-graph replay of every layer kind and of a layer reading a source layer's
# compressed cache), the V4 backend tests the shared hooks touch, then times a V4.1 decode
# step per layer kind (CUDA-graph replays) and prints a table last. Logs under
# ${OUT:-/tmp/gpu_v41be}.
#   bash tools/dev/gpu_v41be.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
out=${OUT:-/tmp/gpu_v41be}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"

python3 -m pytest -q -rs -p no:cacheprovider tests/backends/v41 2>&1 | tee "$out/v41.log" | tail -6
rc_v41=${PIPESTATUS[0]}
python3 -m pytest -q -rs -p no:cacheprovider tests/backends/test_step.py \
  tests/backends/test_cuda_graph.py tests/backends/test_lifecycle.py 2>&1 \
  | tee "$out/v4.log" | tail -4
rc_v4=${PIPESTATUS[0]}

# V4.1-Flash decode shapes: local heads 64 / 128, b 1 / 64 / 256, s_q 1 / 2, window 128,
# top-k 512, 8,192 tokens of context, the 584 B record (what vLLM writes for V4.1 on SM90).
# "step" = write + plan + attention; "layer" = a further layer of the kind (plan shared).
python3 - <<'PY' 2>&1 | tee "$out/bench.txt"
import torch
from sparse_mla.backends.v41 import V41FlashMLABackend, V41Kind, V41LayerConfig
from sparse_mla.tools import bench_backend as bb
from sparse_mla.tools import harness

CTX, dev = bb.CTX, "cuda"
rows = []
for kind in (V41Kind.SWA_ONLY, V41Kind.C1A, V41Kind.C2A):
    for h in (64, 128):
        for b in (1, 64, 256):
            for s_q in (1, 2):
                lens = [(CTX, s_q)] * b
                T = b * s_q
                cfg = V41LayerConfig(num_heads=h, kind=kind, max_num_tokens=T,
                                     max_num_reqs=b, max_model_len=2 * CTX + 64, topk=512)
                batch, blocks, T = bb._batch(cfg, lens, dev, torch.Generator().manual_seed(0))
                be = V41FlashMLABackend(cfg, dev)
                caches = be.allocate_caches(blocks)
                for name, c in caches.items():
                    bs = cfg.swa_block_size if name == "swa" else cfg.compressed_block_size
                    bb._fill(c, blocks[name] * bs, bs, dev)
                q = torch.randn(T, h, 512, device=dev, dtype=torch.bfloat16) * 0.05
                kv = torch.randn(T, 512, device=dev, dtype=torch.bfloat16)
                comp = (torch.randn(T, 512, device=dev, dtype=torch.bfloat16)
                        if kind.compressed else None)
                cos_sin, sink = bb._cos_sin(2 * CTX + 64, dev), torch.randn(h, device=dev)
                out = torch.empty(T, h, 512, device=dev, dtype=torch.bfloat16)
                step = harness.time_graph(
                    lambda: be.forward(q, kv, caches, batch, cos_sin, sink, out, comp))
                be.plan(batch, T)
                layer = harness.time_graph(lambda: be.forward(
                    q, kv, caches, batch, cos_sin, sink, out, comp, planned=True))
                ok = bool(torch.isfinite(out.float()).all())
                # bytes per context token in the compressed cache (pages included); the SWA
                # cache holds the window only
                c = be.cache_specs().get("compressed")
                kv_b = 0 if c is None else c.page_bytes / (c.block_size * kind.ratio)
                us = lambda s: "n/a" if s is None else f"{s * 1e6:.1f}"
                rows.append((kind.name, h, b, s_q, us(step), us(layer), f"{kv_b:.0f}", ok))
                del caches, be
                torch.cuda.empty_cache()
print("kind      heads    b  s_q  step_us  layer_us  compB/ctx_tok  finite")
for r in rows:
    print(f"{r[0]:<9} {r[1]:>5} {r[2]:>4} {r[3]:>4} {r[4]:>8} {r[5]:>9} {r[6]:>14}  {r[7]}")
PY
rc_bench=${PIPESTATUS[0]}
echo "v41 tests rc=$rc_v41  v4 tests rc=$rc_v4  bench rc=$rc_bench"
[ "$rc_v41" = 0 ] && [ "$rc_v4" = 0 ] && [ "$rc_bench" = 0 ]
