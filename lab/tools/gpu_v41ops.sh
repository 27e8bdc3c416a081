#!/usr/bin/env bash
# GPU check of the DeepSeek-V4.1 record work (issue 52 items 1-3, branch v41ops): the GPU tests
# of the files it touched, then the V4.1-Flash decode bench, its table printed last.
#   bash lab/tools/gpu_v41ops.sh [--full]     (default: the quick bench shapes)
# Logs under ${OUT:-/tmp/gpu_v41ops}. Needs CUDA, torch, triton, pytest (xdist optional);
# FlashMLA (flash_mla) optional: its V4.0 SM90 kernel on the 584 B pair where it imports.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
out=${OUT:-/tmp/gpu_v41ops}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
par=()
python3 -c "import xdist" 2>/dev/null && par=(-n 8 --dist loadfile)
python3 -m pytest -q -rfEs -p no:cacheprovider "${par[@]}" \
  tests/ops/cache_insert tests/ops/flashmla_decode tests/ops/attention \
  tests/ops/test_arch_compile.py 2>&1 | tee "$out/pytest.log" | grep -E '^(FAILED|ERROR)|passed|failed' | tail -40
rc_tests=${PIPESTATUS[0]}
python3 - "$@" <<'PY' 2>"$out/bench.err" | tee "$out/bench.txt"
import sys

import torch

from sparse_mla.ops.common import dispatch
from sparse_mla.ops.flashmla_decode import bench, ops
from sparse_mla.tools import harness

shapes = bench.V41_DECODE_SHAPES if "--full" in sys.argv else bench.V41_QUICK_SHAPES
try:
    import flash_mla
except ImportError:
    flash_mla = None


def ours(a):
    a = dict(a)
    q, c, i = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    return lambda: ops.flash_mla_with_kvcache(q, c, i, **a)


def vendor(a):
    meta = flash_mla.get_mla_metadata()[0]
    four = lambda c: c.unsqueeze(-2)  # noqa: E731
    return lambda: flash_mla.flash_mla_with_kvcache(
        a["q"], four(a["k_cache"]), None, None, 512, meta, softmax_scale=512 ** -0.5,
        is_fp8_kvcache=True, indices=a["indices"], use_legacy=True, kv_format="V4",
        extra_k_cache=four(a["extra_k_cache"]),
        extra_indices_in_kvcache=a["extra_indices_in_kvcache"], topk_length=a["topk_length"],
        extra_topk_length=a["extra_topk_length"], attn_sink=a["attn_sink"])


def timed(fn):
    t = harness.time_graph(fn)
    return t if t is not None else harness.time_fn(fn, "cuda")


print(f"{harness.device_name('cuda')}; window {bench.WINDOW} + top-k {bench.V41_TOPK}, "
      f"SWA pages {bench.V41_SWA_PAGE}, compressed blocks {bench.V41_COMPRESSED_BLOCK}")
hdr = (f"{'h':>4} {'s_q':>3} {'b':>4}  {'records':<16} {'route':<10} {'us':>8} "
       f"{'vs 584':>7} {'FlashMLA':>9} {'x FM':>6} {'C1A B/tok':>9} {'C2A B/tok':>9} {'err':>8}")
rows = []
for h, s_q, b in shapes:
    base = None
    fm = None
    for main, extra in bench.V41_RECORDS[::-1]:          # the 584 B pair first: the baseline
        torch.manual_seed(0)
        a = bench.v41_decode_inputs(b, s_q, h, main, extra, "cuda")
        fn = ours(a)
        out = fn()
        route = dispatch.last_plan().route
        err = float("nan")
        if b * s_q <= 64:
            ra = dict(a)
            q, c, i = ra.pop("q"), ra.pop("k_cache"), ra.pop("indices")
            ref = ops.flash_mla_with_kvcache(q, c, i, impl="reference", **ra)
            err = bench._max_err(ref, out)
        t = timed(fn) * 1e6
        if main == "v4":
            base = t
            if flash_mla is not None:
                try:
                    fm = timed(vendor(a)) * 1e6
                except Exception as exc:      # e.g. a block size its SM90 kernel refuses
                    print(f"FlashMLA h{h} s_q{s_q} b{b}: {type(exc).__name__}: {exc}",
                          file=sys.stderr)
                    fm = None
        rows.append((f"{h:>4} {s_q:>3} {b:>4}  {main + '+' + extra:<16} {route:<10} {t:8.1f} "
                     f"{t / base:7.2f} {fm if fm is not None else float('nan'):9.1f} "
                     f"{(fm / t) if fm else float('nan'):6.2f} "
                     f"{bench.v41_kv_bytes(main, extra, 1):9.0f} "
                     f"{bench.v41_kv_bytes(main, extra, 2):9.0f} {err:8.1e}"))
print("us: CUDA-graph replay per call; 'vs 584': time / our 584 B pair's; 'x FM': FlashMLA "
      "V4.0 SM90 (584 B) time / ours; B/tok: compressed-cache KV bytes per context token per "
      "layer (C1A, C2A); err: max |ours - reference| (b*s_q <= 64)")
print(hdr)
for r in rows:
    print(r)
PY
rc_bench=${PIPESTATUS[0]}
echo "pytest rc=$rc_tests bench rc=$rc_bench (logs in $out)"
[ "$rc_tests" = 0 ] && [ "$rc_bench" = 0 ]
