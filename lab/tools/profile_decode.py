"""Resource use of the decode core on FlashMLA shapes: registers, spills, shared memory,
grid; run under Nsight Compute for counters:

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.lab.tools.profile_decode
  ncu --clock-control none -k regex:_split_kernel -c 2 --section SpeedOfLight \\
      --section WarpStateStats python3 -m sparse_mla.lab.tools.profile_decode
"""
import torch

import dataclasses

from sparse_mla.ops.attention import policy
from sparse_mla.ops.common import dispatch
from sparse_mla.ops.flashmla_decode import bench


def main():
    import sys
    changes = {}
    for arg in sys.argv[1:]:                 # e.g. block_n=128 num_stages=1 (policy.Shape)
        key, _, value = arg.partition("=")
        changes[key] = int(value)
    with policy.using(general=dataclasses.replace(policy.DEFAULT.general, **changes)):
        _profile()


def _profile():
    for h, topk, s_q, b in ((64, 512, 1, 64), (128, 1024, 2, 64)):
        case = bench._decode_case(b, s_q, h, topk, "cuda", check=False)
        torch.manual_seed(0)
        a = case.make()
        case.run(a, "triton")
        torch.cuda.synchronize()
        k = dispatch.last_plan().kernel
        meta = getattr(k, "metadata", None)
        print(f"{case.shape}: regs={getattr(k, 'n_regs', '?')} spills={getattr(k, 'n_spills', '?')}"
              f" shared={getattr(meta, 'shared', '?')} warps={getattr(meta, 'num_warps', '?')}",
              flush=True)


if __name__ == "__main__":
    main()
