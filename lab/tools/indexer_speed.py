"""Lab: the indexer decode op's stages under CUDA graphs on the shapes the speed targets name
(b 64 x 16k at s_q 1 / 2 / 4, long rows at small batch), the scores kernel under a few launch
shapes, and the select checked exactly against ``torch.topk`` over the same keys.

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.lab.tools.indexer_speed [--sweep]
"""
from __future__ import annotations

import argparse
import itertools

import torch

from sparse_mla.ops.common.benchcase import time_graph
from sparse_mla.ops.indexer import bench, ops, triton_impl, triton_select
from sparse_mla.ops.indexer import format as fmt

SHAPES = ((64, 16384, 1), (64, 16384, 2), (64, 16384, 4), (1, 65536, 1), (1, 262144, 1),
          (8, 65536, 1), (8, 262144, 1), (1, 262144, 2))
SWEPT = ((64, 16384, 1), (64, 16384, 2), (64, 16384, 4), (1, 65536, 1), (1, 262144, 1),
         (8, 262144, 1))


def copy_bw(device):
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / time_graph(lambda: dst.copy_(src))


def stages(x, cand):
    width = fmt.decode_width(x["block_table"], bench.BLOCK, None)
    keys, lim = triton_impl.decode_keys(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                        x["block_table"], bench.RATIO, x["next_n"], bench.BLOCK,
                                        width)
    spare = keys.clone()

    def scores():
        triton_impl.decode_keys(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                x["block_table"], bench.RATIO, x["next_n"], bench.BLOCK, width)

    def select():
        spare.copy_(keys)
        triton_select.select_topk(spare, x["out"], lim)

    def copy_only():
        spare.copy_(keys)

    def whole():
        ops.indexer_topk_decode(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                x["block_table"], x["out"], bench.RATIO, x["next_n"])
    return keys, lim, scores, select, copy_only, whole


def check_select(keys, lim, k):
    """The kernel's ids equal torch.topk's over the same keys (exact)."""
    want = torch.empty(keys.shape[0], k, dtype=torch.int32, device=keys.device)
    masked = torch.where(torch.arange(keys.shape[1], device=keys.device)[None, :] <
                         lim[:, None].long(), keys, triton_impl.NOT_A_CANDIDATE)
    vals, ids = torch.topk(masked, k, dim=1)
    want = torch.where(vals == triton_impl.NOT_A_CANDIDATE, -1, ids).to(torch.int32)
    got = torch.empty_like(want)
    triton_select.select_topk(keys.clone(), got, lim)
    return bool(torch.equal(got, want))


def _with(cfg, fn, **kw):
    saved = dict(cfg)
    cfg.update(kw)
    try:
        return time_graph(fn)
    except Exception as e:          # a shape that does not compile: say so, go on
        return type(e).__name__
    finally:
        cfg.clear()
        cfg.update(saved)


def sweep(scores, select, copy_only, floor):
    """The scores kernel's tile and warps, the select's chunk and one-program row limit."""
    for bn, warps in itertools.product((64, 128), (4, 8)):
        s = _with(triton_impl.CONFIG, scores, decode_bn=bn, decode_warps=warps)
        print(f"   scores bn={bn} warps={warps}: {s if isinstance(s, str) else s * 1e6:.6}")
    c = time_graph(copy_only)
    for chunk, row_max, warps in itertools.product((4096, 8192), (4096, 8192, 16384), (8, 16)):
        s = _with(triton_select.CONFIG, select, chunk=chunk, row_max=row_max, warps=warps)
        print(f"   select chunk={chunk} row_max={row_max} warps/4k={warps}: "
              f"{s if isinstance(s, str) else (s - c) * 1e6:.6}", flush=True)


def prefill(bw):
    """The prefill op at 8,192 x 16k: its scores, the select kernel against torch.topk over
    the same keys (exact), and the whole op, as a share of the bf16 matmul rate."""
    x = bench.prefill_inputs("cuda", 8192, 16384)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = 2 * 8192 ** 3 / time_graph(lambda: a @ a)
    flops = 2 * 128 * bench.HEADS * bench.pairs(x)
    rows = min(triton_impl.CONFIG["prefill_chunk_bytes"] // (8 * 16384), 8192)
    keys = torch.empty(rows, 16384, dtype=torch.int64, device="cuda")
    lim = torch.empty(rows, dtype=torch.int32, device="cuda")
    bench._prefill_keys(x, keys, lim) if rows == 8192 else None
    spare = keys.clone()
    got = torch.empty(rows, bench.TOPK, dtype=torch.int32, device="cuda")
    want = torch.empty_like(got)
    triton_select.select_topk(spare, got, lim)
    triton_impl.select_from_keys(torch.where(torch.arange(16384, device="cuda")[None, :] <
                                             lim[:, None].long(), keys,
                                             triton_impl.NOT_A_CANDIDATE), want)
    t = {"scores": time_graph(lambda: bench._prefill_keys(x, keys, lim)),
         "select kernel": time_graph(lambda: triton_select.select_topk(spare.copy_(keys), got,
                                                                       lim)),
         "torch.topk": time_graph(lambda: triton_impl.select_from_keys(spare.copy_(keys),
                                                                       want)),
         "copy": time_graph(lambda: spare.copy_(keys))}
    saved = dict(triton_impl.CONFIG)
    for name, max_rows in (("op, select kernel", 1 << 30), ("op, torch.topk", 0)):
        triton_impl.CONFIG["select_max_rows"] = max_rows
        t[name] = time_graph(lambda: ops.indexer_topk_prefill(
            x["q"], x["weights"], x["k"], x["k_scale"], x["cu_seqlens_q"], x["cu_seqlens_k"],
            x["positions"], x["out"], bench.RATIO, 0, x["max_seqlen_k"])) or \
            bench._time(lambda: ops.indexer_topk_prefill(
                x["q"], x["weights"], x["k"], x["k_scale"], x["cu_seqlens_q"],
                x["cu_seqlens_k"], x["positions"], x["out"], bench.RATIO, 0,
                x["max_seqlen_k"]))
    triton_impl.CONFIG.clear()
    triton_impl.CONFIG.update(saved)
    print(f"prefill 8192 x 16k (matmul {mm / 1e12:.0f} TFLOP/s): select exact "
          f"{bool(torch.equal(got, want))}")
    for name, s in t.items():
        print(f"   {name:20s} {s * 1e6:9.1f} us  {100 * flops / s / mm:5.1f}% matmul")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="also time the scores kernel under "
                   "other launch shapes")
    a = p.parse_args(argv)
    dev = "cuda"
    bw = copy_bw(dev)
    print(f"copy {bw / 1e9:,.0f} GB/s")
    rows = []
    for batch, cand, next_n in SHAPES:
        x = bench.decode_inputs(dev, batch, next_n, cand)
        moved = bench.decode_bytes(x, cand)
        floor = moved / bw
        keys, lim, scores, select, copy_only, whole = stages(x, cand)
        ok = check_select(keys, lim, bench.TOPK)
        t = {n: time_graph(f) for n, f in (("scores", scores), ("select+copy", select),
                                           ("copy", copy_only), ("op", whole))}
        t["select"] = t["select+copy"] - t["copy"]
        rows.append((f"b{batch} C{cand} s_q{next_n}", floor, t, ok))
        print(rows[-1][0], {k: round(v * 1e6, 1) for k, v in t.items()},
              f"floor {floor * 1e6:.1f}", "select exact" if ok else "SELECT MISMATCH",
              flush=True)
        if a.sweep and (batch, cand, next_n) in SWEPT:
            sweep(scores, select, copy_only, floor)
        del x, keys, lim
        torch.cuda.empty_cache()
    prefill(bw)
    print("\nshape                 floor_us scores_us select_us   op_us  op%copy  exact")
    for name, floor, t, ok in rows:
        print(f"{name:22s} {floor * 1e6:8.1f} {t['scores'] * 1e6:9.1f} "
              f"{t['select'] * 1e6:9.1f} {t['op'] * 1e6:7.1f} {100 * floor / t['op']:7.0f}% "
              f"{'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
