"""Sweep the fused insert kernel's heads-per-program and warps on the GPU (graph-timed).

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.lab.tools.tune_insert
"""
import torch

from sparse_mla.ops.cache_insert import bench, triton_impl
from sparse_mla.tools import harness


def main():
    copy = harness.copy_bandwidth("cuda")
    print(f"copy {copy / 1e9:,.0f} GB/s")
    wanted = {("fused_qnorm_rope_insert_v4", "N=4096 H=64"), ("fused_qnorm_rope_insert_v4",
              "N=65536 H=64"), ("fused_qnorm_rope_insert_v4", "N=4096 H=128"),
              ("quantize_insert_v4", "N=65536"), ("quantize_insert_v4", "N=4096")}
    cases = [c for c in bench.cases("cuda", False) if (c.op, c.shape) in wanted]
    def sweep(label, **cfg):
        triton_impl.CONFIG.update(cfg)
        cells = []
        for c in cases:
            torch.manual_seed(0)
            a = c.make()
            t = harness.time_graph(lambda c=c, a=a: c.run(a, "triton"))
            cells.append(f"{c.op[:9]} {c.shape}: {t * 1e6:7.1f} µs {c.bytes / t / copy:4.0%}")
        print(f"{label} | " + " | ".join(cells), flush=True)

    for hb, warps in ((2, 1), (4, 1), (8, 1), (4, 2)):
        sweep(f"fused HB={hb} warps={warps}", heads_per_program=hb, num_warps=warps)
    triton_impl.CONFIG.update(heads_per_program=4, num_warps=1)
    for iw, tpp in ((1, 1), (1, 4), (2, 4), (1, 8), (4, 8)):
        sweep(f"insert warps={iw} tokens/program={tpp}", insert_warps=iw, tokens_per_program=tpp)
    gcases = [c for c in bench.cases("cuda", False) if c.op == "gather_dequant"]
    for tb in (2, 4, 8):
        triton_impl.CONFIG.update(gather_tokens=tb)
        for c in gcases:
            torch.manual_seed(0)
            a = c.make()
            t = harness.time_graph(lambda c=c, a=a: c.run(a, "triton"))
            print(f"gather_tokens={tb} {c.shape}: {t * 1e6:.1f} µs {c.bytes / t / copy:.0%}")

if __name__ == "__main__":
    main()
