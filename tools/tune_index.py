"""Sweep the prefill-combine launch shape on the GPU (graph-timed).

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.tools.tune_index
"""
import torch

from sparse_mla.ops.index_combine import bench, triton_kernels
from sparse_mla.tools import harness


def main():
    copy = harness.copy_bandwidth("cuda")
    print(f"copy {copy / 1e9:,.0f} GB/s")
    cases = [c for c in bench.cases("cuda", False) if c.op == "combine_topk_swa_indices"]
    for block in (None, 64, 128, 256):
        for warps in (1, 2, 4, 8):
            triton_kernels.COMBINE_CONFIG.update(block=block, num_warps=warps)
            for c in cases:
                torch.manual_seed(0)
                a = c.make()
                t = harness.time_graph(lambda: c.run(a, "triton"))
                print(f"block={block} warps={warps} {c.shape}: {t * 1e6:6.1f} µs "
                      f"{c.bytes / t / copy:4.0%} of copy (read+write)", flush=True)


if __name__ == "__main__":
    main()
