"""TRTLLM-gen-semantics DSv4 decode on plain caches vs our 584 B path, one run (issue 5).

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.tools.bench_trtllm [--quick]

For each shape (s_q = 2, window 128 + compressed 512 / 1024, h 64 / 128, batch 1 / 4 / 64 / 256):
our Triton op on a bf16 plain cache, on a per-tensor-fp8 plain cache, and our
FlashMLA-semantics Triton op on the equivalent V4 584 B workload (same key count per token).
CUDA-graph-timed; GB/s counts the bytes a perfect kernel moves (each op's own row size);
"fp8 / 584" = 584 B time / fp8 time (>= 1: the fp8 plain path is no slower).
"""
import argparse

import torch

from sparse_mla.ops.flashmla_decode import bench as fm_bench
from sparse_mla.ops.trtllm_decode import bench as tr_bench
from sparse_mla.tools import harness

SHAPES = [(h, c, b) for h in (64, 128) for c in (512, 1024) for b in (1, 4, 64, 256)]


def _trtllm_case(dtype, H, topk_c, B):
    name = "bf16" if dtype == torch.bfloat16 else "fp8"
    want = f"{name} h={H} W=128+{topk_c} B={B} s_q=2"
    return next(c for c in tr_bench.cases("cuda", False) if c.shape == want)


def _timed(case):
    torch.manual_seed(0)
    a = case.make()
    case.run(a, "triton")
    t = harness.time_graph(lambda: case.run(a, "triton"))
    return t, case.bytes / t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="batch 1, 4 and 64 at h 64 only")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_trtllm needs a CUDA GPU (its timings are CUDA-graph replays)")
    copy = harness.copy_bandwidth("cuda")
    print(f"{harness.device_name('cuda')}: copy {copy / 1e9:,.0f} GB/s (measured now)",
          flush=True)
    head = ("shape (s_q=2)", "bf16 µs", "bf16 %copy", "fp8 µs", "fp8 %copy", "584B µs",
            "584B %copy", "fp8 / 584")
    rows = []
    for H, topk_c, B in SHAPES:
        if args.quick and (H != 64 or B == 256):
            continue
        tb, gb = _timed(_trtllm_case(torch.bfloat16, H, topk_c, B))
        tf, gf = _timed(_trtllm_case(torch.float8_e4m3fn, H, topk_c, B))
        t4, g4 = _timed(fm_bench._decode_case(max(B, 1), 2, H, topk_c, "cuda", check=False))
        rows.append((f"h={H} W=128+{topk_c} B={B}", f"{tb * 1e6:.1f}",
                     f"{100 * gb / copy:.0f}%", f"{tf * 1e6:.1f}", f"{100 * gf / copy:.0f}%",
                     f"{t4 * 1e6:.1f}", f"{100 * g4 / copy:.0f}%", f"{t4 / tf:.2f}"))
        print("  " + "  ".join(rows[-1]), flush=True)
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))


if __name__ == "__main__":
    main()
