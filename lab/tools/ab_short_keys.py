"""A/B of the launch plan on short key lists (C128A-shaped rows: window 128 + 64 compressed
rows, 3 key tiles a token) and on the top-k rows that run persistent programs, against
FlashMLA, in one process.

  PYTHONPATH=$(bash tools/pyroot.sh):<flash_mla> python3 -m sparse_mla.lab.tools.ab_short_keys \\
      [--rounds N] [--only TEXT] [--no-vendor]

Variants (attention policies, ``policy.using`` around each call):
* ``base``: the default policy (persistent programs where ``plan.persist_programs`` gives them);
* ``one``: ``persistent=False``, one program a token (the launch before persistent programs);
* ``comb0``: ``split_combine_tiles=0``, the combine launch not charged to plans that split (V4
  b64 s_q1 h64 window 128 + 64: two splits of 2 + 1 tiles and a combine, where the default,
  1, runs one split of 3 tiles);
* ``nocl``: ``clusters=False``, one CTA per head block at h128 (rows at 65-128 heads).

Then bench_flashmla's batch-2 rows: ``base`` against ``nosplit`` (``splits=1``: one launch,
one program a token and head block, no combine). Then DeepSeek-V3.2 rows at 128 heads (2-CTA
clusters) of more units than SMs, against FlashMLA: ``base`` (persistent programs over the
V3.2 pair producer) against ``one32``, them off. Then DeepSeek-V4.1 rows (528 B main + 288 B
extra records, window 128 + 512) in 2-CTA clusters of more units than SMs, without FlashMLA
(it reads no V4.1 record): ``base`` (persistent programs over V4.1 rows) against ``one41``,
them off.

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

from sparse_mla.ops.attention import policy
from sparse_mla.ops.common import dispatch
from sparse_mla.ops.flashmla_decode import bench
from sparse_mla.tools import bench_flashmla, harness
from sparse_mla.lab.tools import ab_args

# (b, s_q, h, top-k): the four C128A rows of bench_flashmla (SHORT_SHAPES), two top-k rows
# whose plans comb0 must leave alone (anchors), then the top-k rows that run persistent
# programs (tests/ops/attention/test_split_model.py)
ROWS = ((64, 1, 64, 64), (256, 1, 64, 64), (64, 1, 128, 64), (256, 1, 128, 64),
        (64, 1, 64, 512), (64, 1, 128, 1024),
        (256, 1, 64, 512), (128, 2, 64, 512), (256, 2, 64, 512), (128, 1, 128, 1024),
        (256, 1, 128, 1024), (64, 2, 128, 1024), (128, 2, 128, 1024), (256, 2, 128, 1024))
VARIANTS = {"base": {}, "one": {"persistent": False}, "comb0": {"split_combine_tiles": 0},
            "nocl": {"clusters": False}}
# (b, s_q, h): V4.1 rows (528 + 288 B) at 128 heads whose one-split launches have more units
# than SMs
V41_ROWS = ((256, 1, 128), (128, 2, 128))
V41_VARIANTS = {"base": {}, "one41": {"persistent": False}}
# (b, s_q, h, top-k): V3.2 rows in 2-CTA clusters of more units than SMs (bench_flashmla's
# decode row first)
V32_ROWS = ((64, 2, 128, 2048), (128, 1, 128, 2048), (128, 2, 128, 512))
V32_VARIANTS = {"base": {}, "one32": {"persistent": False}}
# (b, s_q, h, top-k): bench_flashmla's batch-2 rows, split over the card and combined by a
# second launch, against one split a token (one launch; issue 55 item 4's "no split")
B2_ROWS = ((2, 1, 64, 512), (2, 2, 64, 512), (2, 1, 128, 1024), (2, 2, 128, 1024),
           (2, 2, 32, 512), (2, 2, 16, 512))
B2_VARIANTS = {"base": {}, "nosplit": {"splits": 1}}


def _cases():
    """(case, its variants, whether FlashMLA reads its inputs) for every row."""
    for b, s_q, h, topk in ROWS:
        yield bench._decode_case(b, s_q, h, topk, "cuda", check=False), VARIANTS, True
    for b, s_q, h, topk in B2_ROWS:
        yield bench._decode_case(b, s_q, h, topk, "cuda", check=True), B2_VARIANTS, True
    for b, s_q, h, topk in V32_ROWS:
        yield (bench._decode_case(b, s_q, h, topk, "cuda", fmt="v32", check=False),
               V32_VARIANTS, True)
    for b, s_q, h in V41_ROWS:
        yield (bench.v41_decode_case(b, s_q, h, "v41", "v41_fp4", "cuda", check=False),
               V41_VARIANTS, False)


def _with(settings, fn):
    with policy.using(**settings):
        return fn()


def _same(x, y):
    """Whether two outputs (tensors or tuples of them) are bit-identical."""
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    return all(_same(a, b) for a, b in zip(x, y))


def _timed(fn):
    return bench_flashmla._time(fn)[0]     # graph replay; eager where capture fails


def main(argv=None):
    args = ab_args(__doc__, argv)
    print(harness.device_name("cuda"), flush=True)
    failed = False
    for case, variants, fm_reads in _cases():
        if args.only not in case.shape:
            continue
        torch.manual_seed(0)
        a = case.make()
        mine = lambda case=case, a=a: case.run(a, "triton")  # noqa: E731
        tokens = a["q"].shape[0] * a["q"].shape[1]     # b · s_q
        ref = case.run(dict(a), "reference") if tokens <= 128 else None
        outs, plans = {}, {}
        for name, settings in variants.items():
            outs[name] = _with(settings, mine)
            lp = dispatch.last_plan()
            plans[name] = (lp.route, lp.phases, lp.persist)
            errs = [case.compare(outs["base"], outs[name])]
            if ref is not None:
                errs.append(case.compare(ref, outs[name]))
            if not max(errs) <= case.tolerance:
                print(f"{case.shape} {name}: error {max(errs):.2e} > {case.tolerance:.2e}")
                failed = True
        vendor = None
        if fm_reads and not args.no_vendor:
            try:
                vendor = bench_flashmla.planned_flash_mla(a)[0]
            except Exception as exc:  # reported, the row still times ours
                print(f"FlashMLA failed on {case.shape}: {exc}", file=sys.stderr)
        t = {k: [] for k in ["fm", *variants]}
        for _ in range(args.rounds):
            if vendor is not None:
                t["fm"].append(_timed(vendor))
            for name, settings in variants.items():
                t[name].append(_with(settings, lambda mine=mine: _timed(mine)))
        fm = statistics.median(t["fm"]) if t["fm"] else None
        print(case.shape + (f"  FlashMLA {fm * 1e6:.1f} µs" if fm else ""), flush=True)
        for name in variants:
            us = statistics.median(t[name])
            rel = statistics.median(x / y for x, y in zip(t["base"], t[name]))
            print(f"  {name:5s} {us * 1e6:7.1f} µs  base/{name} {rel:.3f}"
                  + (f"  x FM {fm / us:.3f}" if fm else "")
                  + f"  {plans[name][0]} {list(plans[name][1])}"
                  + (f" persist {plans[name][2]}" if plans[name][2] else "")
                  + ("  == base" if _same(outs[name], outs["base"]) else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
