#!/usr/bin/env bash
# The indexer family on a GPU machine without Bazel (the lead's H200): its tests with their
# CUDA parametrizations, the arch compile check of its kernels, the main job's indexer rows,
# then the comparison table (decode b 64 over 16k candidates as % of copy bandwidth, an
# 8192-token prefill chunk over 16k as % of bf16 matmul, HF's eager indexer math beside them:
# time and peak memory). Logs under ${OUT:-/tmp/gpu_indexer}; the table prints last.
#   bash tools/dev/gpu_indexer.sh         (about 5 minutes on an H200)
#   bash tools/dev/gpu_indexer.sh --hf    also HF's bench model at 16k and 64k prompts, eager
#                                         vs sparse_mla (whose indexer now runs the op)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_indexer}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
python3 -m pytest -q -rs -p no:cacheprovider tests/ops/indexer 2>&1 | tee "$out/pytest.log" \
  | tail -15
rc_tests=${PIPESTATUS[0]}
# compiles every variant of every family once (all cores), then checks the indexer's
python3 -m pytest -q -rs -p no:cacheprovider tests/ops/test_arch_compile.py -k indexer 2>&1 \
  | tee "$out/arch.log" | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || rc_tests=1
# the HF test (transformers' own indexer against the op), where transformers is installed
python3 -m pytest -q -rs -p no:cacheprovider tests/integration/transformers/test_indexer.py \
  2>&1 | tee "$out/pytest_hf.log" | tail -5
rc_hf=${PIPESTATUS[0]}
python3 -m sparse_mla.tools.cli --ops indexer --no-model 2>"$out/cli.err" | tee "$out/cli.txt"
rc_cli=${PIPESTATUS[0]}
python3 -m sparse_mla.ops.indexer.bench --sweep 2>"$out/bench.err" | tee "$out/bench.txt"
rc_bench=${PIPESTATUS[0]}
if [ "${1:-}" = "--hf" ]; then
  python3 -m sparse_mla.tools.bench_hf --lengths 16384 65536 --decode-prompt 4096 \
    --decode-tokens 8 --reps 1 2>"$out/bench_hf.err" | tee "$out/bench_hf.txt"
fi
echo "pytest rc=$rc_tests hf rc=$rc_hf cli rc=$rc_cli bench rc=$rc_bench"
[ "$rc_tests" = 0 ] && [ "$rc_hf" = 0 ] && [ "$rc_cli" = 0 ] && [ "$rc_bench" = 0 ]
