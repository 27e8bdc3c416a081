"""A/B of the split plan on short key lists (C128A-shaped rows: window 128 + 64 compressed
rows, 3 key tiles a token), against FlashMLA, in one process.

  PYTHONPATH=$(bash tools/pyroot.sh):<flash_mla> python3 -m sparse_mla.tools.dev.ab_short_keys \\
      [--rounds N] [--only TEXT] [--no-vendor]

Variants (module settings read at each launch's plan, restored after each call):
* ``base``: the defaults;
* ``comb1``: ``plan.SPLIT_COMBINE_TILES`` = 1, the combine launch charged as one key tile to
  any plan that splits (V4 b64 s_q1 h64 window 128 + 64: one split of 3 tiles, no combine,
  where the default runs two splits of 2 + 1 tiles and a combine);
* ``nocl``: ``tuning.CLUSTER_V4`` off, one CTA per head block at h128 (rows at 65-128 heads).

Per row, in each of ``--rounds`` rounds, FlashMLA and each variant are timed in turn
(CUDA-graph replay, ``harness.time_graph``: bench_flashmla's timing); µs are medians over the
rounds, "x FM" FlashMLA µs / ours. Each variant's plan (route and phases) is printed; a
variant whose plan equals base's is still timed (a drift anchor). Checks: every variant within
the bench's tolerance of the reference (b · s_q <= 128) and of base. Exit status 1 if any fails.
"""
from __future__ import annotations

import statistics
import sys

import torch

from sparse_mla.ops.attention import plan
from sparse_mla.ops.attention.sm90 import tuning
from sparse_mla.ops.common import dispatch
from sparse_mla.ops.flashmla_decode import bench
from sparse_mla.tools import bench_flashmla, harness
from sparse_mla.tools.dev import ab_args

# (b, s_q, h, top-k): the four C128A rows of bench_flashmla (SHORT_SHAPES), then two top-k rows
# whose plans comb1 must leave alone (anchors)
ROWS = ((64, 1, 64, 64), (256, 1, 64, 64), (64, 1, 128, 64), (256, 1, 128, 64),
        (64, 1, 64, 512), (64, 1, 128, 1024))
VARIANTS = {"base": {}, "comb1": {(plan, "SPLIT_COMBINE_TILES"): 1},
            "nocl": {(tuning, "CLUSTER_V4"): False}}


def _with(settings, fn):
    old = {k: getattr(*k) for k in settings}
    for (mod, name), v in settings.items():
        setattr(mod, name, v)
    try:
        return fn()
    finally:
        for (mod, name), v in old.items():
            setattr(mod, name, v)


def _timed(fn):
    return bench_flashmla._time(fn)[0]     # graph replay; eager where capture fails


def main(argv=None):
    args = ab_args(__doc__, argv)
    print(harness.device_name("cuda"), flush=True)
    failed = False
    for b, s_q, h, topk in ROWS:
        case = bench._decode_case(b, s_q, h, topk, "cuda", check=False)
        if args.only not in case.shape:
            continue
        torch.manual_seed(0)
        a = case.make()
        mine = lambda case=case, a=a: case.run(a, "triton")  # noqa: E731
        ref = case.run(dict(a), "reference") if b * s_q <= 128 else None
        outs, plans = {}, {}
        for name, settings in VARIANTS.items():
            outs[name] = _with(settings, mine)
            plans[name] = (dispatch.last_plan().route, dispatch.last_plan().phases)
            errs = [case.compare(outs["base"], outs[name])]
            if ref is not None:
                errs.append(case.compare(ref, outs[name]))
            if not max(errs) <= case.tolerance:
                print(f"{case.shape} {name}: error {max(errs):.2e} > {case.tolerance:.2e}")
                failed = True
        vendor = None
        if not args.no_vendor:
            try:
                vendor = bench_flashmla.planned_flash_mla(a)[0]
            except Exception as exc:  # reported, the row still times ours
                print(f"FlashMLA failed on {case.shape}: {exc}", file=sys.stderr)
        t = {k: [] for k in ["fm", *VARIANTS]}
        for _ in range(args.rounds):
            if vendor is not None:
                t["fm"].append(_timed(vendor))
            for name, settings in VARIANTS.items():
                t[name].append(_with(settings, lambda mine=mine: _timed(mine)))
        fm = statistics.median(t["fm"]) if t["fm"] else None
        print(case.shape + (f"  FlashMLA {fm * 1e6:.1f} µs" if fm else ""), flush=True)
        for name in VARIANTS:
            us = statistics.median(t[name])
            rel = statistics.median(x / y for x, y in zip(t["base"], t[name]))
            print(f"  {name:5s} {us * 1e6:7.1f} µs  base/{name} {rel:.3f}"
                  + (f"  x FM {fm / us:.3f}" if fm else "")
                  + f"  {plans[name][0]} {list(plans[name][1])}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
