#!/usr/bin/env bash
# The indexer family on a GPU machine without Bazel (the lead's H200). By default (about 120 s):
# its tests with their CUDA parametrizations, then the comparison table last (decode b 64 over
# 16k candidates as % of copy bandwidth per stage: scores kernel / top-k select / whole op; an
# 8192-token prefill over 16k as % of bf16 matmul; HF's eager indexer math beside them: time
# and peak memory; host microseconds per op call as HF's hook makes it).
# Logs under ${OUT:-/tmp/gpu_indexer}.
#   bash lab/tools/gpu_indexer.sh          the above
#   bash lab/tools/gpu_indexer.sh --full   also the tests with the software e4m3 route forced
#                                          (SPARSE_MLA_SOFT_FP8=1), the per-arch compile check
#                                          of the indexer's kernels, the HF integration's
#                                          indexer test and the launch-shape sweep
#   bash lab/tools/gpu_indexer.sh --hf     also HF's bench model at 16k and 64k prompts
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_indexer}
mkdir -p "$out"
t0=$SECONDS
stamp() { echo "[$(( SECONDS - t0 )) s] $*"; }
full=0; [ "${1:-}" = "--full" ] && full=1
# compiles dominate the tests: several processes where pytest-xdist is installed
par=""; python3 -c "import xdist" 2>/dev/null && par="-n 4"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/gpu.txt"
python3 -m pytest -q -rs -p no:cacheprovider $par tests/ops/indexer 2>&1 \
  | tee "$out/pytest.log" | tail -4
rc_tests=${PIPESTATUS[0]}
rc_hf=0
stamp "tests (hardware e4m3)"
if [ "$full" = 1 ]; then
# the software route changes the e4m3 code only: the insert and the tests with fp8 inputs
SPARSE_MLA_SOFT_FP8=1 python3 -m pytest -q -rs -p no:cacheprovider tests/ops/indexer \
  -k "(triton or cuda) and (insert or poisoned or mixed_batch or missing)" 2>&1 \
  | tee "$out/pytest_soft.log" | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || rc_tests=1
stamp "tests (software e4m3 forced)"
# the indexer's variants of the per-arch compile check only (the whole check compiles every
# family): the same bounds and compile function as tests/ops/test_arch_compile.py
python3 - <<'EOF' 2>&1 | tee "$out/arch.log" | tail -4
import concurrent.futures, multiprocessing, os, sys
from sparse_mla.tests.ops import test_arch_compile as t
specs = {(a, n): s for (a, n), s in t.variants().items() if n.startswith("indexer")}
ctx = multiprocessing.get_context("fork")
with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1, mp_context=ctx) as pool:
    res = {k: pool.submit(t.compile_variant, s, k[0]) for k, s in specs.items()}
    res = {k: f.result() for k, f in res.items()}
bad = 0
for (arch, name), (shared, spills, err) in sorted(res.items()):
    bound = t.SPILL_BOUND.get(name, 0)
    ok = err is None and shared <= t.SHARED_LIMIT[arch] and spills is not None \
        and spills <= bound
    bad += not ok
    print(f"sm_{arch} {name}: shared {shared} spills {spills} (bound {bound})"
          f"{'' if ok else ' FAIL ' + str(err)[:300]}")
print(f"arch check: {len(res) - bad} of {len(res)} indexer variants within bounds")
sys.exit(1 if bad else 0)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || rc_tests=1
stamp "arch check"
# the HF test (transformers' own indexer against the op), where transformers is installed
python3 -m pytest -q -rs -p no:cacheprovider tests/integration/transformers/test_indexer.py \
  2>&1 | tee "$out/pytest_hf.log" | tail -3
rc_hf=${PIPESTATUS[0]}
stamp "HF indexer test"
fi
if [ "${1:-}" = "--hf" ]; then
  python3 -m sparse_mla.tools.bench_hf --lengths 16384 65536 --decode-prompt 4096 \
    --decode-tokens 8 --reps 1 2>"$out/bench_hf.err" | tee "$out/bench_hf.txt"
  stamp "HF"
fi
python3 -m sparse_mla.ops.indexer.bench 2>"$out/bench.err" | tee "$out/bench.txt"
[ "$full" = 1 ] && python3 -m sparse_mla.lab.tools.indexer_speed --sweep | tee "$out/sweep.txt"
rc_bench=${PIPESTATUS[0]}
[ "$rc_bench" = 0 ] || tail -5 "$out/bench.err"
stamp "bench"
echo "pytest rc=$rc_tests hf rc=$rc_hf bench rc=$rc_bench"
[ "$rc_tests" = 0 ] && [ "$rc_hf" = 0 ] && [ "$rc_bench" = 0 ]
