#!/usr/bin/env bash
# GPU check of the codebase round (one launch plan, one policy, the q fold deleted, narrow
# sm_90 kernel, backends by model) and of the long-MTP / GLM work that landed with it.
#   bash lab/tools/gpu_round3.sh tests [PYTEST_ARGS...]   # the GPU test tree (xdist if present)
#   bash lab/tools/gpu_round3.sh bench                    # bench_flashmla --rounds 3
# Triton 3.8: first eval "$(python3 tools/triton_bundle.py --unpack BUNDLE)". sgl-flash-mla:
# install its wheel into a --target dir on PYTHONPATH first. Logs under ${OUT:-/tmp/gpu_round3}.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
out=${OUT:-/tmp/gpu_round3}
mode=${1:-tests}
shift || true
mkdir -p "$out"
tag=$(python3 -c "import triton; print(triton.__version__)")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
case "$mode" in
  tests)
    par=()
    python3 -c "import xdist" 2>/dev/null && par=(-n 12 --dist loadfile)
    python3 -m pytest -q -rfE -p no:cacheprovider "${par[@]}" \
      --ignore=tests/integration/vllm --ignore=tests/downstream "${@:-tests}" \
      2>&1 | tee "$out/pytest-$tag.log" | grep -E '^(FAILED|ERROR)|passed|failed' | tail -40
    rc=${PIPESTATUS[0]}
    echo "pytest rc=$rc (triton $tag; logs in $out)"
    exit "$rc" ;;
  bench)
    cd / && python3 -m sparse_mla.tools.bench_flashmla --rounds 3 2>&1 \
      | tee "$out/bench_flashmla-$tag.txt" | tail -40 ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
