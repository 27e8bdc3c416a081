"""The V4.1-Flash decode shapes (ops/flashmla_decode/bench.py: window 128 in 32-token SWA pages
+ top-k 512 in 64-token compressed blocks) per record pair and kernel route: the 584 B pair
on the sm_90 kernel (the baseline), 528+528 and 528+288 on the route the planner picks now
and on the portable kernel (``SPARSE_MLA_SM90=0``), and where flash_mla imports FlashMLA's
V4.0 SM90 kernel on the 584 B pair (what vLLM runs for V4.1 on Hopper; tools/bench_flashmla.py's
call, one scheduler metadata per shape). Times are CUDA-graph replays (``harness.time_graph``;
do_bench where a call cannot be captured). Run by lab/tools/gpu_v41gluon.sh; ``--quick``: s_q
1 only."""
from __future__ import annotations

import os
import sys
from unittest import mock

import torch

from sparse_mla.ops.common import dispatch
from sparse_mla.ops.flashmla_decode import bench, ops
from sparse_mla.tools import bench_flashmla, harness

# (main, extra, routes): "auto" the planner's choice, "portable" with the Gluon kernel off
RUNS = (("v4", "v4", ("auto",)), ("v41", "v41", ("auto", "portable")),
        ("v41", "v41_fp4", ("auto", "portable")))


def _call(a):
    a = dict(a)
    q, c, i = a.pop("q"), a.pop("k_cache"), a.pop("indices")
    return lambda: ops.flash_mla_with_kvcache(q, c, i, **a)


def _timed(fn):
    t = harness.time_graph(fn)
    return t if t is not None else harness.time_fn(fn, "cuda")


def _reference_err(a, out):
    ra = dict(a)
    q, c, i = ra.pop("q"), ra.pop("k_cache"), ra.pop("indices")
    return bench._max_err(ops.flash_mla_with_kvcache(q, c, i, impl="reference", **ra), out)


def _flash_mla_time(a, h, s_q, b):
    """FlashMLA's V4.0 SM90 decode on the 584 B pair's inputs ``a`` (None where flash_mla does
    not import or refuses the shape: the reason goes to stderr)."""
    try:
        import flash_mla  # noqa: F401
    except ImportError:
        return None
    try:
        meta = bench_flashmla._fresh_meta()
        return _timed(lambda: bench_flashmla._flash_mla_decode(a, meta)) * 1e6
    except Exception as exc:      # e.g. a page size its SM90 kernel refuses
        print(f"FlashMLA h{h} s_q{s_q} b{b}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def main(argv):
    shapes = [s for s in bench.V41_DECODE_SHAPES if "--quick" not in argv or s[1] == 1]
    print(f"{harness.device_name('cuda')}; window {bench.WINDOW} + top-k {bench.V41_TOPK}, "
          f"SWA pages {bench.V41_SWA_PAGE}, compressed blocks {bench.V41_COMPRESSED_BLOCK}")
    rows = []
    for h, s_q, b in shapes:
        base = None
        fm = None
        for main_fmt, extra_fmt, routes in RUNS:
            torch.manual_seed(0)
            a = bench.v41_decode_inputs(b, s_q, h, main_fmt, extra_fmt, "cuda")
            if main_fmt == "v4":
                fm = _flash_mla_time(a, h, s_q, b)
            for route in routes:
                env = {"SPARSE_MLA_SM90": "0"} if route == "portable" else {}
                with mock.patch.dict(os.environ, env):
                    fn = _call(a)
                    out = fn()
                    ran = dispatch.last_plan().route
                    err = _reference_err(a, out) if b * s_q <= 64 else float("nan")
                    t = _timed(fn) * 1e6
                base = t if base is None else base
                rows.append(f"{h:>4} {s_q:>3} {b:>4}  {main_fmt + '+' + extra_fmt:<12} "
                            f"{ran:<13} {t:8.1f} {t / base:7.2f} "
                            f"{fm if fm is not None else float('nan'):9.1f} "
                            f"{fm / t if fm is not None else float('nan'):6.2f} "
                            f"{bench.v41_kv_bytes(main_fmt, extra_fmt, 1):9.0f} "
                            f"{bench.v41_kv_bytes(main_fmt, extra_fmt, 2):9.0f} {err:8.1e}")
    print("us: CUDA-graph replay per call; 'vs 584': time / the 584 B pair's (sm_90 kernel) "
          "on the same shape; FlashMLA: its V4.0 SM90 kernel on the 584 B pair (us), 'x FM' "
          "its time / this row's; B/tok: compressed-cache KV bytes per context token per layer "
          "(C1A, C2A; SWA adds 128 records per request); err: max |ours - reference| "
          "(b*s_q <= 64)")
    print(f"{'h':>4} {'s_q':>3} {'b':>4}  {'records':<12} {'route':<13} {'us':>8} "
          f"{'vs 584':>7} {'FlashMLA':>9} {'x FM':>6} {'C1A B/tok':>9} {'C2A B/tok':>9} "
          f"{'err':>8}")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main(sys.argv[1:])
