#!/usr/bin/env bash
# Issue 54 item 2 on one GPU (the lead's H200 call; no Bazel, no internet): the q fold (q's
# RMS-norm + RoPE applied by the decode kernel as it loads q).
#   bash lab/tools/gpu_qfold.sh [STEP ...]      (steps: tests step graph bench; default all)
# 1. tests: the fold vs the unfused path bit for bit (sm_90 kernel, portable kernel, tiny
#    launches), the kv-only insert vs the fused insert's bytes;
# 2. step: the FlashMLA backend's steps against the dense oracle on CUDA (fold on, the default);
# 3. graph: the decode step under CUDA-graph replay (fold on);
# 4. bench: tools/bench_backend.py C4A decode, h64 / h128, b 64 / 256, s_q 1, each without the
#    fold ("unfused") then with it ("fold"): "glue" = step - attention, the target <= 10 µs at
#    b 256; "attn_fold" = the decode op with the fold alone.
# Then a short table. Logs under ${OUT:-/tmp/gpu_qfold}; each step under its own time limit
# (210 s at most; "bash lab/tools/gpu_qfold.sh bench" runs the bench alone); the last line
# gives every step's rc (124: its limit).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
steps="${*:-tests step graph bench}"
out=${OUT:-/tmp/gpu_qfold}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$out/env.txt"
declare -A rc
step() {  # step NAME TIMEOUT_S CMD...: runs CMD, log $out/NAME.log, rc kept
  local name=$1 limit=$2
  shift 2
  case " $steps " in
    *" ${name%%_*} "*) ;;
    *) return ;;
  esac
  echo "== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  rc[$name]=$?
  echo "   rc=${rc[$name]} in $((SECONDS - t0)) s (log $out/$name.log)"
  tail -2 "$out/$name.log"
}
step tests 60 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/ops/flashmla_decode/test_qfold.py \
  "tests/ops/cache_insert/test_triton.py::test_rope_insert_v4_is_the_fused_inserts_kv_half"
step step 60 python3 -m pytest -q -p no:cacheprovider tests/backends/test_step.py \
  -k "cuda and flashmla and (mixed_steps or padded_decode)"
step graph 20 python3 -m pytest -q -p no:cacheprovider tests/backends/test_cuda_graph.py \
  -k "flashmla and not indexer"
step bench 70 python3 -m sparse_mla.tools.bench_backend --batches 64 256 --no-prefill \
  --kinds C4A --s-q 1 --qfold both
echo
echo "== table (GPU µs per step / layer; glue = step or layer - attn; attn_fold: the op with the fold)"
if [ -f "$out/bench.log" ]; then
  python3 - "$out/bench.log" <<'PY'
import re, sys
rows, name = [], None
for line in open(sys.argv[1]):
    m = re.match(r"(C\S+ h\d+ b\d+ s_q\d+ \S+)\s+step\s+(\S+)\s+layer\s+(\S+)\s+attn\s+(\S+)\s+"
                 r"glue step/layer\s+(\S+)/\s*(\S+).*layer ratio (\S+)", line)
    if m:
        name = m.groups()
        continue
    if name and "parts" in line:
        fold = re.search(r"attn_fold ([-\d.]+)", line)
        write = re.search(r"write ([-\d.]+)", line)
        n, st, la, at, gs, gl, ratio = name
        print(f"{n:27s} step {st:>7s} layer {la:>7s} attn {at:>7s} "
              f"attn_fold {fold.group(1) if fold else '-':>7s} write {write.group(1) if write else '-':>6s} "
              f"glue step/layer {gs:>6s}/{gl:>6s} FlashMLA layer ratio {ratio}")
        name = None
PY
fi
echo "rc: $(for k in "${!rc[@]}"; do printf '%s=%s ' "$k" "${rc[$k]}"; done)"
