#!/usr/bin/env bash
# GPU check of "V4.1 bytes equal to vLLM's writers" (issue 65 item 2, branch v41-bytes): the
# SWA 528 B writer's bf16 rounding, the token-inline layouts (v41_inline, v41_fp4_inline) in
# the inserts, gather_dequant and the decode (the portable kernel on every GPU; on sm_90 the
# plan's reason for it), the V4.1 backend with record_layout="inline", and the compile check
# of the kernels whose constexprs changed.
#   bash lab/tools/gpu_v41_bytes.sh
# Logs under ${OUT:-/tmp/gpu_v41_bytes}. Needs CUDA, torch, triton, pytest (xdist optional).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
out=${OUT:-/tmp/gpu_v41_bytes}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
par=()
python3 -c "import xdist" 2>/dev/null && par=(-n 8 --dist loadfile)
# every test of the files this branch touched (their CUDA parametrizations run here; CPU ones
# too, they are quick), then the sm_90 route of the footer layouts kept as it was
python3 -m pytest -q -rfEs -p no:cacheprovider "${par[@]}" \
  tests/ops/cache_insert/test_v41_bytes.py tests/ops/cache_insert/test_v41_insert.py \
  tests/ops/cache_insert/test_v41_formats.py tests/ops/flashmla_decode/test_v41_decode.py \
  tests/ops/attention/test_v41_plan.py tests/backends/v41 tests/ops/test_arch_compile.py \
  2>&1 | tee "$out/pytest.log" | grep -E '^(FAILED|ERROR)|passed|failed' | tail -40
rc=${PIPESTATUS[0]}
echo "pytest rc=$rc (logs in $out)"
[ "$rc" = 0 ]
