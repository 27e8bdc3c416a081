"""Registers, spills and shared memory of the attention core's split kernel for sm_90a,
compiled on this machine: no GPU needed (Triton's own ptxas does the register allocation).

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.lab.tools.probe_registers \\
      [--fmt v4|v32|plain_bf16|plain_fp8] [--block-n 64] [--stages 2] [--warps 8] [--dv 1] \\
      [--one-tile] [--dump DIR]

Integer strides are marked divisible by 16 and pointers 16-byte aligned, as Triton's JIT
specializes them for the production shapes. The numbers depend on the Triton version: the
lent H100/H200 has triton 3.6 (pip install --target a directory and put it first on
PYTHONPATH to match). --dump writes the TTGIR and PTX (where the layouts, async copies and
register-resident dot operands show). lab/perf-log.md has the history of these numbers.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparse_mla.ops.attention import launch as core
from sparse_mla.ops.attention.policy import DEFAULT
from sparse_mla.ops.attention import portable as kernels
from sparse_mla.ops.attention import records

POINTERS = {"q_ptr": "*bf16", "c0_ptr": "*u8", "c1_ptr": "*u8", "i0_ptr": "*i32",
            "i1_ptr": "*i32", "l0_ptr": "*i32", "l1_ptr": "*i32", "part_o": "*fp32",
            "part_ml": "*fp32", "scale_ptr": "*fp32"}
FLOATS = {"scale2": "fp32"}
DIVISIBLE = {"q_s0", "q_s1", "c0_s0", "c1_s0", "c0_s1", "c1_s1", "c0_bs", "c1_bs", "i0_s0",
             "i1_s0", "K0", "K1"}


def compile_split_kernel(fmt="v4", block_n=64, stages=2, warps=8, dv=1, heads=64,
                         one_tile=False):
    fn = kernels._split_kernel
    constexprs = dict(FMT=core.FMT_CODES[fmt], HAS_L0=True, HAS_L1=True, HAS_SRC1=True,
                      Q_FP8=False, HB=heads, BN=block_n, D576=fmt == "v32", TRACK_MAX=False,
                      PREFETCH=True, DV=dv, N_UNITS=2 * dv, SCALE64=fmt == "v4", SCALE_T=False,
                      DOT_F32=False, PDL=False, F16=False, ONE_TILE=one_tile, SOFT=False,
                      FMT1=-1)
    # run-time parameters defaulting to None: constexpr None, as a launch without them
    # passes them
    constexprs.update({p.name: None for p in fn.params
                       if not p.is_constexpr and p.has_default and p.default is None})
    unset = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if unset:   # compiled as runtime i32s they would not prune their branches
        raise ValueError(f"compile_split_kernel: no value for constexpr parameters {unset}")
    sig, by_path, attrs = records.signature(fn, constexprs, POINTERS, set(FLOATS), DIVISIBLE)
    src = ASTSource(fn, sig, constexprs=by_path, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def ptxas_report(kernel, arch="sm_90a"):
    """(registers per thread, spill store bytes, spill load bytes, shared memory bytes)."""
    from triton.backends.nvidia.compiler import get_ptxas   # the ptxas Triton itself uses
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        res = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", path, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas failed: {res.stderr[-500:]}")
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    return regs, int(spills.group(1)), int(spills.group(2)), kernel.metadata.shared


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fmt", default="v4", choices=sorted(core.FMT_CODES))
    p.add_argument("--block-n", type=int, default=DEFAULT.general.block_n)
    p.add_argument("--stages", type=int, default=DEFAULT.general.num_stages)
    p.add_argument("--warps", type=int, default=DEFAULT.general.num_warps)
    p.add_argument("--dv", type=int, default=1, choices=(1, 2))
    p.add_argument("--one-tile", action="store_true",
                   help="the form without a key loop (runs of at most one tile)")
    p.add_argument("--dump", help="write k.ttgir and k.ptx here")
    a = p.parse_args(argv)
    k = compile_split_kernel(a.fmt, a.block_n, a.stages, a.warps // a.dv, a.dv,
                             one_tile=a.one_tile)
    regs, st, ld, smem = ptxas_report(k)
    form = " one tile" if a.one_tile else ""
    print(f"triton {triton.__version__} sm_90a fmt={a.fmt} BN={a.block_n} stages={a.stages} "
          f"warps={a.warps // a.dv} dv={a.dv}{form}: {regs} registers, spills {st} B stored / "
          f"{ld} B loaded, {smem} B shared memory")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(a.dump, f"k.{ext}"), "w") as f:
                f.write(k.asm[ext])


if __name__ == "__main__":
    main(sys.argv[1:])
