#!/usr/bin/env bash
# DeepSeek-V4.1 backend (issue 52, items 3-4) on a GPU machine without Bazel (H200: torch 2.11,
# Triton 3.6). Tests first, a short table last; logs under ${OUT:-/tmp/gpu_v41be}.
#   bash lab/tools/gpu_v41be.sh          # lean: tests <= 50 s, bench <= 20 s
#   bash lab/tools/gpu_v41be.sh --full   # every CUDA test of tests/backends/v41, and the
#                                        # whole decode table (kinds x records x h x b)
# Lean tests (one process, the same 8-head shapes, so kernels compile once per record): the
# step oracle per layer kind x record choice (584 + 584, 528 + 528, 528 + 288 B), one CUDA-graph
# replay per record choice (C2A), a layer reading a source's 528 + 288 B cache (eager and
# graphed), odd blocks in padded pages, and V4's FlashMLA-layout step (its decode call changed).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
out=${OUT:-/tmp/gpu_v41be}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"

T=tests/backends/v41
full=0
[ "${1:-}" = "--full" ] && full=1
test_s=50 bench_s=20
if [ $full = 1 ]; then
  test_s=900 bench_s=600
  sel=(-k cuda "$T")
else
  sel=()
  for k in SWA_ONLY C1A C2A; do
    for r in 584+584 528+528 528+288; do
      [ "$k" = SWA_ONLY ] && [ "$r" = 528+288 ] && continue   # no compressed cache: as 528+528
      sel+=("$T/test_step.py::test_mixed_steps_match_oracle[$k-$r-cuda]")
    done
  done
  for r in 584+584 528+528 528+288; do
    sel+=("$T/test_cuda_graph.py::test_decode_step_graph_replays[C2A-$r-8-1]")
  done
  sel+=("$T/test_cuda_graph.py::test_reader_layer_graph_replays[C1A-528+288]"
        "$T/test_step.py::test_layer_reads_a_source_layers_compressed_cache[C1A-528+288-cuda]"
        "$T/test_step.py::test_odd_blocks_in_padded_pages[C2A-528+288-cuda]"
        "tests/backends/v4/test_step.py::test_mixed_steps_match_oracle[C4A-flashmla-cuda]")
fi
start=$SECONDS
timeout "$test_s" python3 -m pytest -q -rs -p no:cacheprovider "${sel[@]}" \
  > "$out/tests.log" 2>&1
rc_tests=$?
echo "tests: rc=$rc_tests (124: its timeout), $(tail -1 "$out/tests.log"), $((SECONDS - start)) s"
[ "$rc_tests" = 0 ] || grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -5

# Decode step, s_q 1, window 128, top-k 512, 8,192 tokens of context. "step" = write + plan +
# attention; "layer" = a further layer of the kind (plan shared); "vs584" = layer time / the
# 584 + 584 row's of the same shape. FlashMLA (V4.0 SM90 kernel, 584 B pair, where flash_mla
# imports) runs the same layer with one scheduler metadata per step, reused, as vLLM does
# (bench_backend.VllmLikeFlashMLA); "FM/ours" = its layer time / ours. Bytes: the SWA record
# per window token (page / 32 slots) and the compressed record per context token (page /
# entries / ratio); "B_vs584" compares the compressed cache (SWA-only layers: the SWA cache).
start=$SECONDS
timeout "$bench_s" python3 - "$full" <<'PY' > "$out/bench.txt" 2>&1
import sys

import torch
from sparse_mla.backends.v41 import V41FlashMLABackend, V41Kind, V41LayerConfig
from sparse_mla.ops import cache_insert as ci
from sparse_mla.tools import bench_backend as bb
from sparse_mla.tools import harness

CTX, dev = bb.CTX, "cuda"
RECORDS = ((584, 584), (528, 528), (528, 288))
vendor = bb._vendor_available()
print(f"# {harness.device_name(dev)}; FlashMLA wheel: {'yes' if vendor else 'no'}", flush=True)
if sys.argv[1] == "1":
    SHAPES = [(k, h, b) for k in (V41Kind.SWA_ONLY, V41Kind.C1A, V41Kind.C2A)
              for h in (64, 128) for b in (1, 64, 256)]
else:
    SHAPES = [(V41Kind.C1A, 64, 64)]


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


def us(s):
    return "-" if s is None else f"{s * 1e6:.1f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


print("kind      h    b  records  step_us layer_us  vs584 FlashMLA_us FM/ours max|diff|"
      "  swaB/tok compB/ctx_tok  B_vs584 finite", flush=True)
for kind, h, b in SHAPES:
    base = None
    for rec in (RECORDS if kind.compressed else RECORDS[:2]):
        cfg = V41LayerConfig(num_heads=h, kind=kind, max_num_tokens=b, max_num_reqs=b,
                             max_model_len=2 * CTX + 64, topk=512, swa_record=rec[0],
                             compressed_record=rec[1])
        batch, blocks, T = bb._batch(cfg, [(CTX, 1)] * b, dev, torch.Generator().manual_seed(0))
        be = V41FlashMLABackend(cfg, dev)
        caches = be.allocate_caches(blocks)
        specs = be.cache_specs()
        for name, c in caches.items():
            fill(c, specs[name].format, blocks[name] * specs[name].block_size,
                 specs[name].block_size)
        q = torch.randn(T, h, 512, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(T, 512, device=dev, dtype=torch.bfloat16)
        comp = torch.randn(T, 512, device=dev, dtype=torch.bfloat16) if kind.compressed else None
        cos_sin, sink = bb._cos_sin(2 * CTX + 64, dev), torch.randn(h, device=dev)
        out = torch.empty(T, h, 512, device=dev, dtype=torch.bfloat16)
        step = harness.time_graph(lambda: be.forward(q, kv, caches, batch, cos_sin, sink, out,
                                                     comp))
        be.plan(batch, T)
        layer = harness.time_graph(lambda: be.forward(q, kv, caches, batch, cos_sin, sink, out,
                                                      comp, planned=True))
        be.forward(q, kv, caches, batch, cos_sin, sink, out, comp)
        ok = bool(torch.isfinite(out.float()).all())
        attn = be.explain()["flashmla_sparse_decode"].impl
        fl = diff = None
        if vendor and rec == (584, 584):
            ref = out.clone()
            theirs = bb.vllm_like(V41FlashMLABackend)(cfg, dev, attention_impl="vendor")
            theirs.plan(batch, T)
            fl = harness.time_graph(lambda: theirs.forward(
                q, kv, caches, batch, cos_sin, sink, out, comp, planned=True))
            # decode rows only: the output stayed in FlashMLA's tensors
            diff = float((theirs.decode_out().float() - ref.float()).abs().max())
            del theirs
        swa_b = per_token(specs["swa"], 1)
        comp_b = per_token(specs["compressed"], kind.ratio) if kind.compressed else 0.0
        mine = comp_b or swa_b
        if base is None:
            base = (layer, mine)
        print(f"{kind.name:<9} {h:>3} {b:>4} {rec[0]}+{rec[1]:<4} {us(step):>8} {us(layer):>8} "
              f"{ratio(layer, base[0]):>6} {us(fl):>11} {ratio(fl, layer):>7} "
              f"{'-' if diff is None else f'{diff:.3g}':>8} {swa_b:>9.0f} {comp_b:>13.0f} "
              f"{mine / base[1]:>8.2f} {ok} (decode: {attn})", flush=True)
        del caches, be
        torch.cuda.empty_cache()
PY
rc_bench=$?
echo "bench: rc=$rc_bench, $((SECONDS - start)) s (rc 124: its timeout; the rows printed stand)"
grep -v "^#" "$out/bench.txt" | grep -E "^(kind|SWA|C1A|C2A)" || tail -5 "$out/bench.txt"
[ "$rc_tests" = 0 ] && [ "$rc_bench" = 0 ]
