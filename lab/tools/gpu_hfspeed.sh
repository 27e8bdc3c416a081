#!/usr/bin/env bash
# Issue 54 items 1 and 3 on one GPU (the lead's H200 call; no Bazel, no internet):
#   bash lab/tools/gpu_hfspeed.sh [--quick] [--inductor-cache FILE.tar.xz] [STEP ...]
# 1. tests/integration/transformers on CUDA (hot path: op once per kind, kept route = op,
#    no host sync per call; greedy tokens = eager's);
# 2. lab/tools/profile_hf.py: the attention function's time per call, ours and eager's
#    (synced and host only), decode after a 4,096-token prompt, and the host syncs of a generate;
# 3. tools/bench_hf.py: decode after 4k and 16k, prefill 1k / 4k / 16k, eager vs sparse_mla,
#    then decode after 4k with model.forward under torch.compile for both (on a carried
#    inductor cache: the "cache" step below);
# 4. tools/bench_backend.py: FlashMLA layer with the step's metadata (fair) and per-call
#    planner columns;
# then a short table of the lines that matter. Logs under ${OUT:-/tmp/gpu_hfspeed}.
# --quick: no 16k rows, bench_backend --quick, fewer decode tokens (about half the time).
# Each step is run even when an earlier one fails, under its own time limit (all of them
# together 600 s: one device call); the last line gives every step's rc (124: its limit).
# STEP names (e.g. "profile backend") run only those steps (tests profile prefill decode compiled
# backend; and "cache", not among the defaults: see the compiled step).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
inductor_cache=
if [ "${1:-}" = "--inductor-cache" ]; then inductor_cache=$2; shift 2; fi
steps="${*:-tests profile prefill decode compiled backend}"
out=${OUT:-/tmp/gpu_hfspeed}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/env.txt"
python3 - <<'PY' | tee -a "$out/env.txt"
import torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers",
      transformers.__version__)
try:
    import flash_mla  # noqa: F401
    print("flash_mla importable: yes (sgl-flash-mla; the bf16 op's automatic route is FlashMLA's"
          " prefill)")
except ImportError as exc:
    print(f"flash_mla importable: NO ({exc}); the bf16 op runs our Triton kernels and "
          "bench_backend has no FlashMLA columns")
PY
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
}
# the CUDA parametrizations and the device-free checks; test_tools runs the CPU smoke runs
step tests 140 python3 -m pytest -q -rs -p no:cacheprovider tests/integration/transformers \
  -k "cuda or not cpu" --ignore=tests/integration/transformers/test_tools.py
tail -3 "$out/tests.log"
step profile 70 python3 -m sparse_mla.lab.tools.profile_hf --prompt 4096 --decode 8 --no-tables
if [ $quick = 1 ]; then
  lengths="1024 4096"; tokens=16; decode_prompts="4096"; backend_args="--quick"
else
  lengths="1024 4096 16384"; tokens=32; decode_prompts="4096 16384"
  backend_args="--batches 64 256 --no-prefill"
fi
step prefill 70 python3 -m sparse_mla.tools.bench_hf --lengths $lengths --decode-prompt 1024 \
  --decode-tokens 2 --reps 3
for n in $decode_prompts; do
  step decode_$n $((n > 8192 ? 65 : 45)) python3 -m sparse_mla.tools.bench_hf --decode-only \
    --decode-prompt "$n" --decode-tokens $tokens --reps 3
done
# model.forward under inductor: ~40 s per graph, 8 graphs per implementation after a 4k
# prompt (HF's cache states), so both cold do not fit one call. "cache" fills inductor's cache
# with one process per implementation side by side (~6 min: a call of its own) and packs it;
# a later call's "compiled" step, given it (--inductor-cache the .tar.xz, carried), times both
# in one process on it (a cache serves the same GPU model and software only).
cache_dir=/tmp/gpu_hfspeed_inductor
case " $steps " in
  *" cache "*)
    echo "== cache: bench_hf --compile --impls eager | sparse_mla, side by side"
    t0=$SECONDS
    for impl in eager sparse_mla; do
      TORCHINDUCTOR_CACHE_DIR=$cache_dir timeout 500 python3 -m sparse_mla.tools.bench_hf \
        --decode-only --compile --impls $impl --decode-prompt 4096 --decode-tokens $tokens \
        --reps 2 >"$out/cache_$impl.log" 2>&1 &
    done
    wait
    tar -C "$cache_dir" -cJf "$out/inductor.tar.xz" . && rc[cache]=0 || rc[cache]=1
    echo "   rc=${rc[cache]} in $((SECONDS - t0)) s: $(du -h "$out/inductor.tar.xz" | cut -f1)"
    ;;
esac
if [ -n "$inductor_cache" ]; then
  mkdir -p "$cache_dir" && tar -C "$cache_dir" -xJf "$inductor_cache"
fi
step compiled 400 env TORCHINDUCTOR_CACHE_DIR=$cache_dir python3 -m sparse_mla.tools.bench_hf \
  --decode-only --compile --decode-prompt 4096 --decode-tokens $tokens --reps 2
step backend 80 python3 -m sparse_mla.tools.bench_backend $backend_args

echo
echo "================ summary ($(head -1 "$out/env.txt"))"
grep -h "flash_mla importable" "$out/env.txt"
echo "-- tests: $(tail -1 "$out/tests.log")"
echo "-- attention function per call, decode after 4096 (median ms: synced, host), profile_hf:"
grep -E "^  (eager|sparse_mla) .* q=1 " "$out/profile.log" || echo "   (none: see profile.log)"
grep -E "host syncs|^decode step," "$out/profile.log" | sed 's/: {.*//'
echo "-- prefill (bench_hf):"
grep -E "^(prompt|[0-9]+ )" "$out/prefill.log" || echo "   (none: see prefill.log)"
for f in $(ls "$out"/decode_*.log "$out"/cache_*.log "$out"/compiled.log 2>/dev/null); do
  echo "-- $(basename "$f" .log):"
  grep -E "^(generate|eager|sparse_mla|same greedy)" "$f" || echo "   (none: see $f)"
done
echo "-- bench_backend (layer ratio = FlashMLA with the step's metadata / ours; planner/call):"
grep -E "^C(4|128)A" "$out/backend.log" \
  | sed -E 's/ +parts.*//; s/ +max\|diff\|.*//' || echo "   (none: see backend.log)"
line="rc:"
for k in tests profile prefill $(for n in $decode_prompts; do echo decode_$n; done) \
  cache compiled backend; do
  line="$line $k=${rc[$k]:-?}"
done
echo "$line"
