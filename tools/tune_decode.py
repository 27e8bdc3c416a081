"""Sweep the sparse-attention core's launch shape on FlashMLA decode shapes (graph-timed).

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.tools.tune_decode
"""
import itertools
import sys

import torch

from sparse_mla.ops.common import sparse_attention_triton as core
from sparse_mla.ops.flashmla_decode import bench
from sparse_mla.tools import harness

SHAPES = [(64, 512, 1, 2), (64, 512, 1, 64), (128, 1024, 2, 64), (128, 1024, 2, 2)]


def main(argv):
    grid = dict(dv_split=(1, 2), block_n=(32, 64), num_warps=(4, 8), min_programs=(132, 264),
                max_heads=(64,), num_stages=(1,))
    if "--quick" in argv:
        grid = dict(block_n=(64,), num_warps=(8,), min_programs=(132,), max_heads=(64,),
                    num_stages=(None,))
    cases = [bench._decode_case(b, s_q, h, topk, "cuda", check=False)
             for h, topk, s_q, b in SHAPES]
    inputs = []
    for c in cases:
        torch.manual_seed(0)
        inputs.append(c.make())
    for values in itertools.product(*grid.values()):
        cfg = dict(zip(grid, values))
        core.CONFIG.update(cfg)
        core.SMALL_CONFIG = {}                 # sweep the one config on every shape
        cells = []
        for c, a in zip(cases, inputs):
            try:
                t = harness.time_graph(lambda: c.run(a, "triton"))
                cells.append(f"{c.shape.split(' win')[0]}: {t * 1e6:7.1f}")
            except Exception as exc:  # noqa: BLE001 - a config may not compile (registers)
                cells.append(f"{c.shape.split(' win')[0]}: failed ({str(exc)[:40]})")
        print(" ".join(f"{k}={v}" for k, v in cfg.items()), "|", " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
