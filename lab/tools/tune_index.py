"""Sweep the prefill-combine launch shape on the GPU (graph-timed).

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.lab.tools.tune_index
"""
import itertools

import torch

from sparse_mla.ops.index_combine import bench, triton_impl
from sparse_mla.tools import harness


def main():
    copy = harness.copy_bandwidth("cuda")
    print(f"copy {copy / 1e9:,.0f} GB/s")
    cases = [c for c in bench.cases("cuda", False) if c.op == "combine_topk_swa_indices"]
    default = dict(triton_impl.COMBINE_CONFIG)
    for block, warps in itertools.product((64, 128, 256, 512), (1, 2, 4)):
        triton_impl.COMBINE_CONFIG.update(block=block, num_warps=warps)
        for c in cases:
            torch.manual_seed(0)
            a = c.make()
            out = [x.clone() for x in c.run(a, "reference")]
            got = c.run(a, "triton")
            bad = c.compare(out, got)
            written = a["out"].numel() * 4 + a["lens"].numel() * 4
            t = harness.time_graph(lambda c=c, a=a: c.run(a, "triton"))
            print(f"block={block} warps={warps} {c.shape}: {t * 1e6:6.1f} µs "
                  f"{c.bytes / t / copy:4.0%} of copy (read+write), "
                  f"{written / t / copy:4.0%} on written bytes, {bad} mismatches", flush=True)
    triton_impl.COMBINE_CONFIG.update(default)


if __name__ == "__main__":
    main()
