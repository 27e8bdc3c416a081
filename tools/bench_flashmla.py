"""FlashMLA-semantics decode / prefill: our Triton kernel and FlashMLA side by side, one run.

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.tools.bench_flashmla [--quick]
      [--only TEXT] [--rounds N] [--decode] [--soft]

Times are CUDA-graph replays (GPU time per call). FlashMLA is called directly (legacy SM90
kernels); ours goes through the op. "FlashMLA µs" reuses one filled scheduler metadata
object, as vLLM does for every layer of a type within a step (and FlashMLA's own benchmark
does): the per-layer cost. "+sched µs" gives each call a fresh one, so it also runs
FlashMLA's scheduler: the first such layer of a step. Ratio = FlashMLA µs / ours µs (> 1:
ours is faster). "route" is the kernel route ours ran (``dispatch.last_plan``: sm90,
sm90_cluster, tiny, portable). "portable µs" is the same op with the sm_90 warp-specialized kernel
turned off (``SPARSE_MLA_SM90=0``: the portable Triton kernel). Roofline: this run's copy
bandwidth and bf16 matmul rate. Each shape is also checked: max |ours - FlashMLA| on the output.
``--rounds N`` times FlashMLA and ours alternately N times per shape: the µs columns are then
medians over the rounds, the ratio is the median of the rounds' own ratios, and "range" gives
their lowest and highest (the V3.2 row's rounds spread 4-9 % within one process:
lab/perf-log.md, "Parity in alternating rounds").
``--soft`` adds the software e4m3 route (``SPARSE_MLA_SOFT_FP8=1``: the portable kernel decoding
e4m3 in integer arithmetic, what GPUs below sm_89 run): "soft µs", its time over the portable
kernel's with hardware e4m3 ("soft/hw": the cost of the software decode alone) and over ours
("soft/ours": what an Ampere-class route would give up against this card's best), and
max |soft - ours|. Prefill rows read a bf16 kv, with no e4m3 to decode: their soft columns are
"n/a*", explained under the table.
Tensor-parallel shard rows (h 16 / 32) give FlashMLA, which takes 64 or 128 heads, a q padded
with zero heads once, outside the timing.
"""
import argparse
import os
import statistics
import sys
from unittest import mock

import torch
import triton

from sparse_mla.ops.common import dispatch
from sparse_mla.ops.flashmla_decode import bench
from sparse_mla.tools import harness


def _fresh_meta():
    """An empty FlashMLA scheduler metadata object: the first decode call given it runs
    FlashMLA's scheduler and fills it; later calls given it reuse it."""
    import flash_mla
    return flash_mla.get_mla_metadata()[0]


def _flash_mla_decode(a, meta):
    """FlashMLA's decode with scheduler metadata ``meta`` (``_fresh_meta``)."""
    import flash_mla
    four_d = lambda c: c.unsqueeze(-2)  # noqa: E731  [nb, bs, 584] -> [nb, bs, 1, 584]
    kw = {}
    if "extra_k_cache" in a:
        kw = dict(extra_k_cache=four_d(a["extra_k_cache"]),
                  extra_indices_in_kvcache=a["extra_indices_in_kvcache"],
                  topk_length=a["topk_length"], extra_topk_length=a["extra_topk_length"],
                  attn_sink=a["attn_sink"])
    return flash_mla.flash_mla_with_kvcache(
        a["q"], four_d(a["k_cache"]), None, None, 512, meta, softmax_scale=a["q"].shape[-1] ** -0.5,
        is_fp8_kvcache=True, indices=a["indices"], use_legacy=True,
        kv_format="V4" if a.get("kv_format", "v4") == "v4" else "V32", **kw)


def planned_flash_mla(a):
    """(FlashMLA's decode of inputs ``a`` as a no-argument call, its first output): heads
    padded once (``_padded_for_flash_mla``), one scheduler metadata planned by this first,
    untimed call and reused by every later one (the per-layer cost vLLM pays). Raises what
    FlashMLA raises."""
    pa = _padded_for_flash_mla(a)
    meta = _fresh_meta()
    first = _flash_mla_decode(pa, meta)     # fills meta: reused from here on
    return (lambda: _flash_mla_decode(pa, meta)), first


def _padded_for_flash_mla(a):
    """FlashMLA's sparse decode takes 64 or 128 heads: a tensor-parallel shard's q is padded
    with zero heads (and its sinks with -inf) once, outside the timing, so FlashMLA is timed
    without the per-call padding its callers pay."""
    from sparse_mla.ops.flashmla_decode.vendor import pad_for_flash_mla
    a = dict(a)
    a["q"], a["attn_sink"] = pad_for_flash_mla(a["q"], a.get("attn_sink"), head_dim=2)
    return a


def _flash_mla_prefill(a):
    import flash_mla
    return flash_mla.flash_mla_sparse_fwd(a["q"], a["kv"], a["indices"], a["sm_scale"], 512,
                                          a["attn_sink"], None, use_legacy=True)


NEEDS_GPU = "bench_flashmla needs a CUDA GPU (FlashMLA and the CUDA-graph timings run there)"
SOFT_COLUMNS = ("soft µs", "soft/hw", "soft/ours", "max |soft-ours|")


def soft_skip_reason(case):
    """Why ``--soft`` does not apply to ``case``, or None where it does."""
    if "prefill" in case.op:
        return ("prefill reads a bf16 kv: there is no e4m3 to decode, so "
                "SPARSE_MLA_SOFT_FP8=1 changes nothing there")
    return None


def soft_columns(case, a, tp, to, ours):
    """``--soft``'s cells for ``case`` (inputs ``a``; ``tp`` / ``to`` the portable and our
    times, ``ours`` our outputs): "n/a*" where the software route does not apply
    (``soft_skip_reason``). Raises where the switch did not reach a case it applies to."""
    if soft_skip_reason(case) is not None:
        return ("n/a*",) * len(SOFT_COLUMNS)
    with mock.patch.dict(os.environ, {"SPARSE_MLA_SOFT_FP8": "1"}):
        ts, _ = _time(lambda: case.run(a, "triton"))
        soft = case.run(a, "triton")
    soft_route = getattr(dispatch.last_plan(), "label", "?")
    if "software" not in soft_route:      # the timing above is then not the soft route
        raise RuntimeError(f"{case.shape}: SPARSE_MLA_SOFT_FP8=1 ran {soft_route!r}")
    return (f"{ts * 1e6:.1f}", f"{ts / tp:.2f}", f"{ts / to:.2f}",
            f"{float((soft[0].float() - ours[0].float()).abs().max()):.2e}")


E4M3_COLUMNS = ("e4m3-q µs", "e4m3/bf16", "max |e4m3-bf16|")


def e4m3_q_inputs(a):
    """``a`` with q as e4m3 and one fp32 scale for the tensor (amax / 448), as an fp8 q
    projection hands it over."""
    q = a["q"].float()
    scale = (q.abs().amax() / 448).clamp(min=2 ** -20).reshape(1)
    return dict(a, q=(q / scale).to(torch.float8_e4m3fn), q_scale=scale)


def e4m3_columns(case, a, to, ours):
    """``--q-e4m3``'s cells for ``case``: ours with the same q as e4m3 (half the q bytes),
    its time over the bf16-q time ``to`` and its largest difference from the bf16-q outputs
    ``ours`` (the q quantization's); "n/a*" for prefill (bf16 q only)."""
    if "prefill" in case.op:
        return ("n/a*",) * len(E4M3_COLUMNS)
    a8 = e4m3_q_inputs(a)
    t8, _ = _time(lambda: case.run(a8, "triton"))
    out = case.run(a8, "triton")
    return (f"{t8 * 1e6:.1f}", f"{t8 / to:.2f}",
            f"{float((out[0].float() - ours[0].float()).abs().max()):.2e}")


def _time(fn):
    t = harness.time_graph(fn)
    return (t, "graph") if t is not None else (harness.time_fn(fn, "cuda"), "eager")


def _alternate(vendor, ours, rounds):
    """``rounds`` (vendor, ours) timings taken in turn, so the card's drift between runs falls
    on both alike: medians of each, the median of the per-round ratios vendor / ours, and
    the rounds' lowest and highest ratio."""
    pairs = [(_time(vendor)[0], _time(ours)[0]) for _ in range(rounds)]
    ratios = [v / o for v, o in pairs]
    return (statistics.median(v for v, _ in pairs), statistics.median(o for _, o in pairs),
            statistics.median(ratios), min(ratios), max(ratios))


MTP_SHAPES = ((64, 512), (128, 1024))     # (heads, topk) of the decode rows


def mtp_rows(batches, sqs, time_of):
    """``--mtp``'s rows: for each (heads, topk), batch and s_q, our decode time
    ``time_of(b, s_q, h, topk)`` and its ratio to s_q 1 at b requests and to s_q 1 at
    b * s_q requests (below 1: a draft token costs less than an independent request)."""
    rows = []
    for h, topk in MTP_SHAPES:
        for b in batches:
            one = time_of(b, 1, h, topk)
            for s_q in sqs:
                t = one if s_q == 1 else time_of(b, s_q, h, topk)
                alone = one if s_q == 1 else time_of(b * s_q, 1, h, topk)
                rows.append((f"v4 b={b} s_q={s_q} h={h} win=128+{topk}", f"{t * 1e6:.1f}",
                             f"{t / one:.2f}", f"{b * s_q}", f"{t / alone:.2f}"))
    return rows


def _our_decode_time(b, s_q, h, topk):
    case = bench._decode_case(b, s_q, h, topk, "cuda", check=False)
    torch.manual_seed(0)
    a = case.make()
    t, _ = _time(lambda a=a: case.run(a, "triton"))
    del a
    torch.cuda.empty_cache()
    return t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="batch 2 and 64 only, no prefill")
    p.add_argument("--only", default="", help="only the cases whose shape contains this text")
    p.add_argument("--rounds", type=int, default=1,
                   help="time FlashMLA and ours alternately this many times per shape")
    p.add_argument("--decode", action="store_true", help="decode rows only (no prefill)")
    p.add_argument("--soft", action="store_true",
                   help="also time the software e4m3 route (SPARSE_MLA_SOFT_FP8=1)")
    p.add_argument("--q-e4m3", action="store_true",
                   help="also time decode with the same q as e4m3 (per-tensor scale)")
    p.add_argument("--mtp", type=int, nargs="+", choices=range(2, 9), metavar="S_Q",
                   help="instead of the table: our V4 decode at these s_q (2..8) and s_q 1, "
                        "each over s_q 1 at b and at b * s_q requests")
    p.add_argument("--mtp-batch", type=int, nargs="+", default=[2, 64], metavar="B",
                   help="--mtp's batches (default 2 64)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if any(b < 1 for b in args.mtp_batch):
        p.error("--mtp-batch must be positive")
    if not torch.cuda.is_available():
        raise SystemExit(NEEDS_GPU)
    if args.mtp:
        head = ("shape", "ours µs", "x s_q 1", "requests", "x requests of s_q 1")
        rows = mtp_rows(args.mtp_batch, [1] + sorted(set(args.mtp)), _our_decode_time)
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        for r in [head] + rows:
            print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
        return
    copy = harness.copy_bandwidth("cuda")
    mm = harness.matmul_rate("cuda")
    print(f"{harness.device_name('cuda')}: copy {copy / 1e9:,.0f} GB/s, "
          f"matmul {mm / 1e12:,.0f} TFLOP/s (measured now); torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    head = ("shape", "route", "FlashMLA µs", "+sched µs", "portable µs", "ours µs", "ratio",
            "range",
            "ours TFLOP/s", "ours GB/s", "% mm", "% copy", "max |diff|")
    if args.soft:
        head += SOFT_COLUMNS
    if args.q_e4m3:
        head += E4M3_COLUMNS
    rows, soft_skipped = [], {}
    for case in bench.cases("cuda", False):
        if args.quick and ("prefill" in case.op or not any(f"b={b} " in case.shape
                                                           for b in (2, 64))):
            continue
        if args.only not in case.shape or (args.decode and "prefill" in case.op):
            continue
        torch.manual_seed(0)
        a = case.make()
        decode = "prefill" not in case.op
        try:
            if decode:
                vendor, v_out = planned_flash_mla(a)
                v_out = (v_out[0][:, :, :a["q"].shape[2]],)
                pa = _padded_for_flash_mla(a)
                tv_sched, _ = _time(lambda pa=pa: _flash_mla_decode(pa, _fresh_meta()))
            else:
                v_out = _flash_mla_prefill(a)
                vendor = lambda a=a: _flash_mla_prefill(a)  # noqa: E731
                tv_sched = None
        except Exception as exc:  # reported in the table
            v_out, vendor, tv_sched = None, None, None
            print(f"FlashMLA failed on {case.shape}: {exc}", file=sys.stderr)
        with mock.patch.dict(os.environ, {"SPARSE_MLA_SM90": "0"}):
            tp, _ = _time(lambda case=case, a=a: case.run(a, "triton"))
        ours = case.run(a, "triton")
        route = getattr(dispatch.last_plan(), "route", "?")
        mine = lambda case=case, a=a: case.run(a, "triton")  # noqa: E731
        if vendor is None:
            tv, to, ratio, lo, hi = None, _time(mine)[0], None, None, None
        else:
            tv, to, ratio, lo, hi = _alternate(vendor, mine, args.rounds)
        diff = ("-" if v_out is None
                else f"{float((ours[0].float() - v_out[0].float()).abs().max()):.2e}")
        rows.append((case.shape, route, "-" if tv is None else f"{tv * 1e6:.1f}",
                     "-" if tv_sched is None else f"{tv_sched * 1e6:.1f}", f"{tp * 1e6:.1f}",
                     f"{to * 1e6:.1f}",
                     "-" if ratio is None else f"{ratio:.2f}",
                     "-" if ratio is None or args.rounds == 1 else f"{lo:.3f}-{hi:.3f}",
                     f"{case.flops / to / 1e12:.0f}",
                     f"{case.bytes / to / 1e9:,.0f}", f"{100 * case.flops / to / mm:.0f}%",
                     f"{100 * case.bytes / to / copy:.0f}%", diff))
        if args.soft:
            rows[-1] += soft_columns(case, a, tp, to, ours)
            if soft_skip_reason(case) is not None:
                soft_skipped[case.op] = soft_skip_reason(case)
        if args.q_e4m3:
            rows[-1] += e4m3_columns(case, a, to, ours)
            if "prefill" in case.op:
                soft_skipped[case.op] = "the prefill op takes a bf16 q"
        print("  " + "  ".join(rows[-1]), file=sys.stderr, flush=True)
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    for op, why in soft_skipped.items():
        print(f"* n/a ({op}): {why}")


if __name__ == "__main__":
    main()
