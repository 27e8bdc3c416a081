#!/usr/bin/env bash
# GPU check of the indexer step work: the whole GPU test tree (the V4 indexer's split select and
# packed decode scores, the V4.1 two-level ops and layer step, the vLLM indexer's CUDA-only
# tests are not here: they need vLLM), then the product benchmarks' tables:
# ops/indexer/bench.py (stages and whole op), tools/bench_step.py (one layer's step against its
# floor; CSV under $OUT) and lab/tools/indexer_speed.py (the speed targets' shapes).
#   bash lab/tools/gpu_indexer_step.sh [--tests-only | --bench-only]
# Logs under ${OUT:-/tmp/gpu_indexer_step}. Needs CUDA, torch, triton, pytest (xdist optional).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
out=${OUT:-/tmp/gpu_indexer_step}
mode=${1:-all}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
rc=0
if [ "$mode" != --bench-only ]; then
  par=()
  python3 -c "import xdist" 2>/dev/null && par=(-n 12 --dist loadfile)
  python3 -m pytest -q -rfE -p no:cacheprovider "${par[@]}" tests \
    --ignore=tests/integration/vllm --ignore=tests/downstream \
    2>&1 | tee "$out/pytest.log" | grep -E '^(FAILED|ERROR)|passed|failed' | tail -40
  rc=${PIPESTATUS[0]}
  echo "pytest rc=$rc (logs in $out)"
fi
if [ "$mode" != --tests-only ]; then
  python3 -m sparse_mla.ops.indexer.bench --no-hf 2>&1 | tee "$out/indexer_bench.txt" | tail -30
  python3 -m sparse_mla.tools.bench_step --csv "$out/bench_step.csv" 2>&1 \
    | tee "$out/bench_step.txt" | tail -60
  python3 -m sparse_mla.lab.tools.indexer_speed --no-prefill 2>&1 \
    | tee "$out/indexer_speed.txt" | tail -12
fi
[ "$rc" = 0 ]
