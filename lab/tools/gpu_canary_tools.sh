#!/usr/bin/env bash
# Issue 65 items 3 and 5 on one GPU (the lead's H200; no Bazel, no internet):
#   bash lab/tools/gpu_canary_tools.sh [--smoke] [STEP ...]
# 1. "tests": the dispatcher's canary tests, the vendor routes' and the tools' tests on this
#    machine's torch / Triton (tests/ops/common, tests/ops/trtllm_decode/test_vendor.py,
#    tests/ops/flashmla_decode/test_vendor.py, tests/tools);
# 2. "canary": the vendor canary through real kernels on cuda:0: FlashInfer's canary calls
#    (ops/trtllm_decode/canary.py) run by Triton agree with the reference at the op's tolerance;
#    a throwaway dispatcher whose "vendor" is the reference (truthful) is accepted once by its
#    canary against the Triton kernel, one whose vendor scales its output is rejected and not
#    retried; under CUDA-graph capture no canary runs (the vendor is rejected with the reason,
#    Triton is captured); the sm_90 FlashMLA prefill is verified here (no canary) where
#    sgl-flash-mla is installed; with a second GPU, the lookup is the tensors' GPU;
# 3. "soft": python3 -m sparse_mla.tools.bench_flashmla --rounds 2 --soft (prefill rows' soft
#    columns "n/a*" with the footnote, the run reaching the table).
# Each step runs even when an earlier one fails, under its own limit (together under 600 s);
# the last line gives every step's rc (124: its limit). Logs under ${OUT:-/tmp/gpu_canary_tools}.
# --smoke: the "canary" step's code on CPU (TRITON_INTERPRET=1), nothing else.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$(bash tools/pyroot.sh)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_canary_tools}
mkdir -p "$out"
smoke=0
if [ "${1:-}" = "--smoke" ]; then smoke=1; shift; fi
steps="${*:-tests canary soft}"
[ $smoke = 1 ] && steps=canary
declare -A rc

if [ $smoke = 0 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/env.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/env.txt"
  python3 -c "import flash_mla; print('flash_mla: yes')" 2>/dev/null | tee -a "$out/env.txt"
fi

for step in $steps; do
  case $step in
  tests)
    OMP_NUM_THREADS=4 timeout 240 python3 -m pytest -q -rs -p no:cacheprovider \
      tests/ops/common tests/ops/trtllm_decode/test_vendor.py \
      tests/ops/flashmla_decode/test_vendor.py tests/tools 2>&1 \
      | tee "$out/tests.log" | tail -15
    rc[tests]=${PIPESTATUS[0]} ;;
  canary)
    dev=cuda; [ $smoke = 1 ] && dev=cpu
    [ $smoke = 1 ] && export TRITON_INTERPRET=1
    timeout 120 python3 - "$dev" <<'PY' 2>&1 | tee "$out/canary.log"
import sys

import torch

from sparse_mla.ops.common import dispatch
from sparse_mla.ops.trtllm_decode import canary, reference, triton_impl

dev = torch.device(sys.argv[1])
failed = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failed.append(what)


# 1. the FlashInfer canary calls: Triton's answer is the reference's at the op's tolerance
for name, c, tri, ref in (("dsv4", canary.DSV4, triton_impl.dsv4, reference.dsv4),
                          ("v32", canary.V32, triton_impl.v32, reference.v32)):
    a, b = c.build(dev), c.build(dev)
    tri(*a[0], **a[1])
    ref(*b[0], **b[1])
    diff = c.compare(a, b)
    check(diff is None, f"{name} canary call: Triton vs reference: {diff or 'agree'}")


def toy(name, vendor):
    d = dispatch.Dispatcher(name)
    d.register("vendor", vendor, canary=canary.DSV4)
    d.register("triton", triton_impl.dsv4, dispatch.triton_check_args)
    d.register("reference", reference.dsv4)
    return d


def lying(*args):
    reference.dsv4(*args)
    args[6].mul_(1.5)


cc = dispatch.device_capability(dev)
print(f"{dev}: capability {cc}; the toy routes are verified nowhere", flush=True)
# 2. a truthful vendor: accepted once by its canary, used from then on
truthful = toy("gpu_canary_truthful", reference.dsv4)
args, _ = canary.dsv4_call(dev)
truthful(*args)
first = dispatch.last_choice("gpu_canary_truthful")
print(first, flush=True)
check(first.impl == "vendor" and "matched Triton" in (first.canary or ""), "truthful accepted")
truthful(*args)
check(dispatch.last_choice("gpu_canary_truthful").impl == "vendor", "truthful used after")
# 3. a lying vendor: rejected with the reason, Triton runs, never retried
liar = toy("gpu_canary_lies", lying)
liar(*args)
choice = dispatch.last_choice("gpu_canary_lies")
print(choice, flush=True)
check(choice.impl == "triton" and "disagreed" in choice.rejected.get("vendor", ""),
      "liar rejected")
calls = []
liar._impls["vendor"] = (lambda *a: calls.append(1), None, None)
liar(*args)
check(calls == [] and dispatch.last_choice("gpu_canary_lies").impl == "triton",
      "liar not retried")
if dev.type == "cuda":
    # 4. graph capture: no canary; the vendor is rejected with the reason, Triton is captured
    capture = toy("gpu_canary_capture", reference.dsv4)
    capture(*args, impl="triton")                   # compiled before the capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        capture(*args)
    torch.cuda.current_stream().wait_stream(stream)
    choice = dispatch.last_choice("gpu_canary_capture")
    print(choice, flush=True)
    check(choice.impl == "triton" and "captured" in choice.rejected.get("vendor", ""),
          "no canary under capture")
    graph.replay()
    torch.cuda.synchronize()
    # 5. FlashMLA's prefill on sm_90: verified, no canary (where sgl-flash-mla is installed)
    try:
        import flash_mla  # noqa: F401
        from sparse_mla.ops.flashmla_decode import bench as fm_bench
        case = [c for c in fm_bench.cases("cuda", True) if "prefill" in c.op][0]
        case.run(case.make(), "auto")
        choice = dispatch.last_choice("flashmla_sparse_prefill")
        print(choice, flush=True)
        check(cc != (9, 0) or (choice.impl == "vendor" and choice.canary is None),
              "FlashMLA prefill verified on sm_90: no canary")
    except ImportError:
        print("skip FlashMLA: sgl-flash-mla is not installed", flush=True)
    # 6. two GPUs: the canary runs on (and is kept for) the tensors' GPU
    if torch.cuda.device_count() > 1:
        other = toy("gpu_canary_two", reference.dsv4)
        other(*canary.dsv4_call("cuda:1")[0])
        check("cuda:1" in (dispatch.last_choice("gpu_canary_two").canary or ""),
              "canary on the tensors' GPU")
print("FAILED: " + "; ".join(failed) if failed else "canary: all checks passed", flush=True)
sys.exit(1 if failed else 0)
PY
    rc[canary]=${PIPESTATUS[0]} ;;
  soft)
    timeout 420 python3 -m sparse_mla.tools.bench_flashmla --rounds 2 --soft \
      2> "$out/soft.err" | tee "$out/soft.txt"
    rc[soft]=${PIPESTATUS[0]}
    tail -5 "$out/soft.err" ;;
  *) echo "unknown step $step (tests canary soft)"; rc[$step]=2 ;;
  esac
done
summary=""
for step in $steps; do summary+="$step=${rc[$step]} "; done
echo "rc: $summary" | tee "$out/rc.txt"
