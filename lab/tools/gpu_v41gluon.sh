#!/usr/bin/env bash
# GPU check of the sm_90 kernel's V4.1 record decoding (issue 52 item 3, branch v41gluon): the
# GPU tests it touched, then the V4.1-Flash decode timings per record pair and route, the
# table printed last (lab/tools/bench_v41gluon.py).
#   bash lab/tools/gpu_v41gluon.sh [--quick]     (--quick: s_q 1 only)
# Logs under ${OUT:-/tmp/gpu_v41gluon}. Needs CUDA, torch, triton, pytest (xdist optional).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
out=${OUT:-/tmp/gpu_v41gluon}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
par=()
python3 -c "import xdist" 2>/dev/null && par=(-n 8 --dist load)
python3 -m pytest -q -rfEs -p no:cacheprovider "${par[@]}" \
  tests/ops/flashmla_decode/test_v41_decode.py tests/ops/attention/test_v41_plan.py 2>&1 \
  | tee "$out/pytest.log" \
  | grep -E '^(FAILED|ERROR)|passed|failed' | tail -40
rc_tests=${PIPESTATUS[0]}
python3 lab/tools/bench_v41gluon.py "$@" 2>"$out/bench.err" | tee "$out/bench.txt"
rc_bench=${PIPESTATUS[0]}
tail -5 "$out/bench.err"
echo "pytest rc=$rc_tests bench rc=$rc_bench (logs in $out)"
[ "$rc_tests" = 0 ] && [ "$rc_bench" = 0 ]
