"""Sweep the sparse-attention core's launch shape on FlashMLA shapes (graph-timed µs).

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.lab.tools.tune_decode [--quick] [--gluon]

--gluon sweeps the sm_90 kernel's shape (``policy.Sm90``) instead: the V4 shapes plus plain
bf16 / e4m3 TRTLLM-gen shapes and the prefill shape.

Each row is one override of the policy's general launch shape (``policy.Shape``); every output
is also compared with the first row's (a config must not change the answer beyond bf16
rounding: '!' marks > 1e-2).
"""
import sys

import torch

import dataclasses

from sparse_mla.ops.attention import policy
from sparse_mla.ops.common import dispatch
from sparse_mla.ops.flashmla_decode import bench
from sparse_mla.tools import harness

DECODE = [(64, 512, 1, 2), (64, 512, 1, 64), (64, 512, 1, 74), (64, 512, 2, 148),
          (64, 512, 2, 256), (128, 1024, 2, 2), (128, 1024, 2, 64), (128, 1024, 2, 256)]
SWEEP = [dict(),                                    # the current CONFIG
         dict(num_stages=3),
         dict(block_n=32, num_stages=3),
         dict(num_stages=1),
         dict(split_overhead=2),
         dict(split_overhead=5)]


GLUON_SWEEP = [dict(), dict(producer_regs=96), dict(producer_regs=112), dict(follow_regs=176)]


def main(argv):
    quick = "--quick" in argv
    if "--gluon" in argv:
        return _sweep("sm90", GLUON_SWEEP, [c for c in DECODE if c[3] != 2], False,
                      plain=True)
    return _sweep("general", SWEEP[:2] if quick else SWEEP, DECODE[:2] if quick else DECODE,
                  not quick)


def _sweep(part, sweep, decode, extra, plain=False):
    """``part``: the policy field whose fields each override changes."""
    cases = [bench._decode_case(b, s_q, h, topk, "cuda", check=False)
             for h, topk, s_q, b in decode]
    if plain:
        from sparse_mla.tools.bench_trtllm import _trtllm_case
        cases += [_trtllm_case(torch.bfloat16, 64, 512, 64),
                  _trtllm_case(torch.bfloat16, 128, 1024, 256),
                  _trtllm_case(torch.float8_e4m3fn, 64, 512, 256),
                  bench._prefill_case(4096, 128, 32768, 2048, "cuda", False)]
    if extra:
        cases.append(bench._decode_case(64, 2, 128, 2048, "cuda", fmt="v32", check=False))
        cases.append(bench._prefill_case(4096, 128, 32768, 2048, "cuda", False))
    inputs = []
    for c in cases:
        torch.manual_seed(0)
        inputs.append(c.make())
    first = {}
    print(" | ".join(c.shape for c in cases), flush=True)
    for override in sweep:
        varied = dataclasses.replace(getattr(policy.DEFAULT, part), **override)
        with policy.using(**{part: varied}):
            cells = _row(cases, inputs, first)
        spills = getattr(dispatch.last_plan().kernel, "n_spills", "?")
        print(f"{override} spills={spills} |" + "|".join(cells), flush=True)


def _row(cases, inputs, first):
    cells = []
    for i, (c, a) in enumerate(zip(cases, inputs)):
        try:
            out = c.run(dict(a), "triton")
            o = (out[0] if isinstance(out, tuple) else out).float()
            err = (o - first.setdefault(i, o.clone())).abs().max().item()
            t = harness.time_graph(lambda c=c, a=a: c.run(a, "triton"))
            cells.append(f"{t * 1e6:8.1f}{'!' if err > 1e-2 else ''}")
        except Exception as exc:  # a config may not compile (smem, regs)
            cells.append(f"failed ({str(exc)[:30]})")
    return cells


if __name__ == "__main__":
    main(sys.argv[1:])
