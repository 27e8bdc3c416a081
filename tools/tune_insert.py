"""Sweep the fused insert kernel's heads-per-program and warps on the GPU (graph-timed).

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.tools.tune_insert
"""
import itertools

import torch

from sparse_mla.ops.cache_insert import bench, triton_kernels
from sparse_mla.tools import harness


def main():
    copy = harness.copy_bandwidth("cuda")
    print(f"copy {copy / 1e9:,.0f} GB/s")
    wanted = {("fused_qnorm_rope_insert_v4", "N=4096 H=64"), ("fused_qnorm_rope_insert_v4",
              "N=65536 H=64"), ("fused_qnorm_rope_insert_v4", "N=4096 H=128"),
              ("quantize_insert_v4", "N=65536"), ("quantize_insert_v4", "N=4096")}
    cases = [c for c in bench.cases("cuda", False) if (c.op, c.shape) in wanted]
    for hb, warps in itertools.product((1, 2, 4, 8), (2, 4, 8)):
        triton_kernels.FUSED_CONFIG.update(heads_per_program=hb, num_warps=warps)
        cells = []
        for c in cases:
            torch.manual_seed(0)
            a = c.make()
            t = harness.time_graph(lambda: c.run(a, "triton"))
            cells.append(f"{c.op[:9]} {c.shape}: {t * 1e6:7.1f} µs {c.bytes / t / copy:4.0%}")
        print(f"HB={hb} warps={warps} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
