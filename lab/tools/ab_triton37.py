"""Issue 55 item 5 A/B on Triton 3.7: the sm_90 kernel's 128-head cluster rows with
``compat.RANK_VIEWS`` off and on, against FlashMLA, in one process.

  PYTHONPATH=$(bash tools/pyroot.sh):<flash_mla> python3 -m sparse_mla.lab.tools.ab_triton37 \\
      [--rounds N] [--only TEXT] [--no-vendor]

RANK_VIEWS (ops/attention/sm90/compat.py, default on for Triton 3.7 only): the V4 cluster
producer stores its half and its peer's half of a stage through views indexed by the CTA's
rank at run time, one code path, instead of one branch per rank. On 3.7, LLVM left the two
branches unmerged and the dequantization duplicated into both, and ptxas scheduled all of it
after the stage hand-off's waits. The flag is read at each launch (``tuning.launch_constexprs``
passes it as the kernel's ``RANK_VIEWS`` constexpr), so this script flips it between launches;
a CUDA graph captured inside keeps the kernel it launched.

Per row, in each of ``--rounds`` rounds, FlashMLA, "off" and "on" are timed in turn (CUDA-graph
replay, ``harness.time_graph``: the timing bench_flashmla uses); the µs columns are medians
over the rounds, off/on is the median of the rounds' own ratios (> 1: on is faster) with its
range, x FM = FlashMLA µs / ours. Checks, per row: on's output is bit-identical to off's (the
same arithmetic, stored through other views); where the PyTorch reference is cheap enough
(b · s_q <= 128) max |on - reference| is within the bench's tolerance
(ops/flashmla_decode/bench.py, ``TOLERANCE``); on V4 rows the flag reached the kernel (off and
on launched different compiled kernels: "cvt" gives each one's e4m3 conversions in the PTX,
104 / 56 on Triton 3.7's unmerged / merged producer). The V3.2 row has no V4 stores: its two
kernels are the same one (an anchor for drift). Exit status 1 if any check fails.
Set SPARSE_MLA_GLUON_PANEL_VIEWS=0 to make "off" 3.7 without panel views (both stay as the
launch builds them otherwise).
"""
from __future__ import annotations

import statistics
import sys

import torch
import triton

from sparse_mla.ops.attention.sm90 import compat
from sparse_mla.ops.common import dispatch
from sparse_mla.ops.flashmla_decode import bench
from sparse_mla.tools import bench_flashmla, harness
from sparse_mla.lab.tools import ab_args

# (b, s_q, h, top-k, format): V4 h128 (window 128 + 1024 top-k) and V3.2's h128 row, as
# bench_flashmla has them; all run as 2-CTA clusters
ROWS = ((64, 1, 128, 1024, "v4"), (64, 2, 128, 1024, "v4"), (256, 1, 128, 1024, "v4"),
        (256, 2, 128, 1024, "v4"), (64, 2, 128, 2048, "v32"))


def _with_flag(on, fn):
    """``fn()`` with compat.RANK_VIEWS set to ``on`` (read at each launch)."""
    old = compat.RANK_VIEWS
    compat.RANK_VIEWS = on
    try:
        return fn()
    finally:
        compat.RANK_VIEWS = old


def _timed(fn):
    return bench_flashmla._time(fn)[0]     # graph replay; eager where capture fails


def _launched(on, fn):
    """(output, route, compiled kernel) of one call of ``fn`` with the flag ``on``."""
    out = _with_flag(on, fn)
    plan = dispatch.last_plan()
    return out, getattr(plan, "route", "?"), getattr(plan, "kernel", None)


def _cvt(kernel):
    return kernel.asm["ptx"].count("cvt.rn.f16x2.e4m3x2") if kernel is not None else -1


def main(argv=None):
    args = ab_args(__doc__, argv)
    print(f"{harness.device_name('cuda')}; torch {torch.__version__}, triton "
          f"{triton.__version__}; RANK_VIEWS default {compat.RANK_VIEWS}, PANEL_VIEWS "
          f"{bool(compat.PANEL_VIEWS.value)}", flush=True)
    head = ("shape", "FlashMLA µs", "off µs", "on µs", "off/on", "range", "x FM off",
            "x FM on", "on==off", "cvt off/on", "max |on-ref|")
    rows, failed = [], False
    for b, s_q, h, topk, fmt in ROWS:
        case = bench._decode_case(b, s_q, h, topk, "cuda", fmt=fmt, check=False)
        if args.only not in case.shape:
            continue
        torch.manual_seed(0)
        a = case.make()
        mine = lambda case=case, a=a: case.run(a, "triton")  # noqa: E731
        outs, routes, kernels = {}, {}, {}
        for on in (False, True):
            outs[on], routes[on], kernels[on] = _launched(on, mine)
        same = all(torch.equal(x, y) for x, y in zip(outs[False], outs[True]))
        notes = []
        if not same:
            notes.append("on != off")
        if set(routes.values()) != {"sm90_cluster"}:
            notes.append(f"routes {routes}")
            failed = True
        if fmt == "v4" and (kernels[False] is None or kernels[False] is kernels[True]):
            notes.append("the flag did not reach the kernel")
            failed = True
        ref_err = "-"
        if b * s_q <= 128:
            err = case.compare(case.run(dict(a), "reference"), outs[True])
            ref_err = f"{err:.2e}"
            if not err <= case.tolerance:
                notes.append(f"on outside tolerance {case.tolerance:.2e}")
                failed = True
        failed |= not same
        vendor = None
        if not args.no_vendor:
            try:
                vendor = bench_flashmla.planned_flash_mla(a)[0]
            except Exception as exc:  # reported, the row still times ours
                print(f"FlashMLA failed on {case.shape}: {exc}", file=sys.stderr)
        t = {"fm": [], False: [], True: []}
        for _ in range(args.rounds):
            if vendor is not None:
                t["fm"].append(_timed(vendor))
            for on in (False, True):
                t[on].append(_with_flag(on, lambda mine=mine: _timed(mine)))
        ratios = [o / n for o, n in zip(t[False], t[True])]
        med = {k: statistics.median(v) if v else None for k, v in t.items()}
        fm = med["fm"]
        rows.append((case.shape, "-" if fm is None else f"{fm * 1e6:.1f}",
                     f"{med[False] * 1e6:.1f}", f"{med[True] * 1e6:.1f}",
                     f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f}-{max(ratios):.3f}",
                     "-" if fm is None else f"{fm / med[False]:.3f}",
                     "-" if fm is None else f"{fm / med[True]:.3f}", str(same),
                     f"{_cvt(kernels[False])}/{_cvt(kernels[True])}", ref_err))
        print("  " + "  ".join(rows[-1]) + ("  " + "; ".join(notes) if notes else ""),
              file=sys.stderr, flush=True)
    if not rows:
        print(f"no row matches --only {args.only!r}")
        return 1
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    if failed:
        print("CHECK FAILED: on != off, on outside the reference tolerance, a row off the "
              "cluster route, or the flag not reaching the kernel (stderr above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
