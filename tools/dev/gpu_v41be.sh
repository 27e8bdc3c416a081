#!/usr/bin/env bash
# DeepSeek-V4.1 backend (issue 52, items 3-4) on a GPU machine without Bazel (H200: torch 2.11,
# Triton 3.6). Runs the CUDA parametrizations of the V4.1 backend tests for every record choice
# (584 + 584, 528 + 528, 528 + 288 B: step oracle, odd blocks in padded pages, lifecycle,
# CUDA-graph replay of every layer kind and of a layer reading a source layer's compressed
# cache) and of the V4 backend tests the shared hooks touch, then times a V4.1 decode step per
# layer kind x record choice (CUDA-graph replays) with KV bytes per token, and prints a table
# last. Logs under ${OUT:-/tmp/gpu_v41be}.
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

# CUDA rows only ("cuda" is in every GPU test's id or module name); the CPU rows run in CI.
python3 -m pytest -q -rs -p no:cacheprovider -k cuda tests/backends/v41 2>&1 \
  | tee "$out/v41.log" | tail -6
rc_v41=${PIPESTATUS[0]}
# V4's FlashMLA-layout backend (its decode now names the extra list's record) on the GPU.
python3 -m pytest -q -rs -p no:cacheprovider -k "cuda and flashmla" tests/backends/test_step.py \
  tests/backends/test_cuda_graph.py 2>&1 | tee "$out/v4.log" | tail -4
rc_v4=${PIPESTATUS[0]}

# V4.1-Flash decode shapes: local heads 64 / 128, b 1 / 64 / 256, s_q 1, window 128, top-k
# 512, 8,192 tokens of context. "step" = write + plan + attention; "layer" = a further layer
# of the kind (plan shared). FlashMLA (V4.0 SM90 kernel, 584 B pair only, where flash_mla
# imports) runs the same layer with one scheduler metadata per step, reused, as vLLM does
# (bench_backend._as_vllm_runs_it). Bytes: the SWA record per window token (page / 32) and
# the compressed record per context token (page / entries / ratio); SWA-only layers hold the
# window only.
python3 - <<'PY' 2>&1 | tee "$out/bench.txt"
import torch
from sparse_mla.backends.v41 import V41FlashMLABackend, V41Kind, V41LayerConfig
from sparse_mla.ops import cache_insert as ci
from sparse_mla.ops.common import formats
from sparse_mla.tools import bench_backend as bb
from sparse_mla.tools import harness

CTX, dev = bb.CTX, "cuda"
RECORDS = ((584, 584), (528, 528), (528, 288))
FORMAT = {584: "v4", 528: "v41", 288: "v41_fp4"}
vendor = bb._vendor_available()
print(f"# {harness.device_name(dev)}; FlashMLA wheel: {'yes' if vendor else 'no'}")


def fill(cache, fmt, n_slots, bs):
    """Random rows in the cache's record in every slot (no NaN bytes in the timing)."""
    ident = torch.zeros(1, 64, device=dev)
    ident[:, :32] = 1
    for s in range(0, n_slots, 1 << 18):
        n = min(1 << 18, n_slots - s)
        k = torch.randn(n, 512, device=dev, dtype=torch.bfloat16)
        zeros = torch.zeros(n, dtype=torch.int64, device=dev)
        ci.compressed_insert_v41(k, cache, torch.arange(s, s + n, device=dev), zeros, ident, 1,
                                 bs, fmt)


def per_token(spec, ratio):
    return spec.page_bytes / (spec.block_size * ratio)


rows, base, ran = [], {}, {}
for kind in (V41Kind.SWA_ONLY, V41Kind.C1A, V41Kind.C2A):
    for h in (64, 128):
        for b in (1, 64, 256):
            for rec in (RECORDS[:2] if not kind.compressed else RECORDS):
                lens = [(CTX, 1)] * b
                cfg = V41LayerConfig(num_heads=h, kind=kind, max_num_tokens=b, max_num_reqs=b,
                                     max_model_len=2 * CTX + 64, topk=512, swa_record=rec[0],
                                     compressed_record=rec[1])
                batch, blocks, T = bb._batch(cfg, lens, dev, torch.Generator().manual_seed(0))
                be = V41FlashMLABackend(cfg, dev)
                caches = be.allocate_caches(blocks)
                specs = be.cache_specs()
                for name, c in caches.items():
                    fill(c, specs[name].format, blocks[name] * specs[name].block_size,
                         specs[name].block_size)
                q = torch.randn(T, h, 512, device=dev, dtype=torch.bfloat16)
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
                be.forward(q, kv, caches, batch, cos_sin, sink, out, comp)
                ok = bool(torch.isfinite(out.float()).all())
                if kind is V41Kind.C1A and b == 64 and h == 64:
                    ran[rec] = {op: c.impl for op, c in be.explain().items() if c}
                fl, diff = None, None
                if vendor and rec == (584, 584):
                    ref = out.clone()
                    theirs = V41FlashMLABackend(cfg, dev, attention_impl="vendor")
                    theirs.plan(batch, T)
                    with bb._as_vllm_runs_it():
                        fl = harness.time_graph(lambda: theirs.forward(
                            q, kv, caches, batch, cos_sin, sink, out, comp, planned=True))
                    theirs.forward(q, kv, caches, batch, cos_sin, sink, out, comp)
                    diff = float((out.float() - ref.float()).abs().max())
                    del theirs
                swa_b = per_token(specs["swa"], 1)
                comp_b = per_token(specs["compressed"], kind.ratio) if kind.compressed else 0.0
                key = (kind, h, b)
                if rec == (584, 584):
                    base[key] = (layer, comp_b if kind.compressed else swa_b)
                rows.append((kind.name, h, b, rec, step, layer, fl, diff, swa_b, comp_b,
                             key, ok))
                print(kind.name, h, b, rec, "done", flush=True)
                del caches, be
                torch.cuda.empty_cache()


def us(s):
    return "-" if s is None else f"{s * 1e6:.1f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


for rec, ops in ran.items():
    print(f"# ops ran (C1A h64 b64, {rec[0]}+{rec[1]}): " + ", ".join(f"{k}={v}" for k, v in ops.items()))
print("kind      h    b  records  step_us layer_us  vs584 FlashMLA_us FM/ours max|diff|"
      "  swaB/tok compB/ctx_tok  B_vs584 finite")
for kind, h, b, rec, step, layer, fl, diff, swa_b, comp_b, key, ok in rows:
    b584, bytes584 = base[key]
    mine = comp_b if comp_b else swa_b
    print(f"{kind:<9} {h:>3} {b:>4} {rec[0]}+{rec[1]:<4} {us(step):>8} {us(layer):>8} "
          f"{ratio(layer, b584):>6} {us(fl):>11} {ratio(fl, layer):>7} "
          f"{'-' if diff is None else f'{diff:.3g}':>8} {swa_b:>9.0f} {comp_b:>13.0f} "
          f"{mine / bytes584:>8.2f} {ok}")
PY
rc_bench=${PIPESTATUS[0]}
echo "v41 tests rc=$rc_v41  v4 tests rc=$rc_v4  bench rc=$rc_bench"
[ "$rc_v41" = 0 ] && [ "$rc_v4" = 0 ] && [ "$rc_bench" = 0 ]
