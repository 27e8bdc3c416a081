"""Every launch variant of the sm_90 kernel, compiled for sm_90a without a GPU.

A Triton upgrade that breaks the sm_90 kernel would otherwise only show on a Hopper GPU,
and there only as the portable kernel running instead (the version gate falls back). This
compiles each variant the launcher (ops/attention/launch.py) can pick with the installed
Triton and its own ptxas, and reports registers and spills per thread
(tests/ops/attention/test_sm90_compile.py runs it in the CPU CI;
``python3 -m sparse_mla.ops.attention.sm90.variants`` prints the table; lab/tools/ptx_digest.py
digests their PTX).

The constexprs come from ``tuning.launch_constexprs``, the function the launch itself uses;
pointer and stride arguments are marked 16-byte divisible as the JIT marks the production
ones; records (``ops/attention/records.py``) are typed field by field.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
import tempfile

from sparse_mla.ops.attention import fmt_codes as fc
from sparse_mla.ops.attention import records

# (fmt code (ops/attention/fmt_codes.py), q fp8, d576, staged, cluster, f16, final): the
# variants run() can pick
VARIANTS = {
    "v4_staged": dict(fmt=fc.V4.value, staged=True),
    "v4_staged_final": dict(fmt=fc.V4.value, staged=True, final=True),
    "v4_unstaged": dict(fmt=fc.V4.value),
    "v4_cluster": dict(fmt=fc.V4.value, staged=True, cluster=True),
    "v41_staged": dict(fmt=fc.V41.value, staged=True),
    "v41_staged_final": dict(fmt=fc.V41.value, staged=True, final=True),
    "v41_fp4_staged": dict(fmt=fc.V41_WITH_FP4.value, staged=True),
    "v41_cluster": dict(fmt=fc.V41.value, staged=True, cluster=True),
    "v41_fp4_cluster": dict(fmt=fc.V41_WITH_FP4.value, staged=True, cluster=True),
    "v41_v4_staged": dict(fmt=fc.V41_WITH_V4.value, staged=True),
    "v41_v4_cluster": dict(fmt=fc.V41_WITH_V4.value, staged=True, cluster=True),
    "v32": dict(fmt=fc.V32.value, d576=True),
    "v32_cluster": dict(fmt=fc.V32.value, d576=True, cluster=True),
    "bf16_512": dict(fmt=fc.PLAIN_BF16.value),
    "bf16_576": dict(fmt=fc.PLAIN_BF16.value, d576=True),
    "fp8_512": dict(fmt=fc.PLAIN_FP8.value),
    "fp8_512_f16": dict(fmt=fc.PLAIN_FP8.value, q_fp8=True, f16=True),
    "fp8_576_f16": dict(fmt=fc.PLAIN_FP8.value, d576=True, q_fp8=True, f16=True),
    # persistent programs (sm90/persist.py)
    "v4_staged_final_persist": dict(fmt=fc.V4.value, staged=True, final=True, persist=True),
    "v4_cluster_final_persist": dict(fmt=fc.V4.value, staged=True, cluster=True, final=True,
                                     persist=True),
    # (V4.1 and V3.2 ones: clusters only, tuning.PERSIST_V41 / PERSIST_V32)
    "v41_cluster_final_persist": dict(fmt=fc.V41.value, staged=True, cluster=True, final=True,
                                      persist=True),
    "v32_cluster_final_persist": dict(fmt=fc.V32.value, d576=True, cluster=True, final=True,
                                      persist=True),
}

_FLOATS = {"scale2", "out_scale"}
_DIVISIBLE = {"q_s0", "q_s1", "c0_s0", "c1_s0", "c0_s1", "c1_s1", "c0_bs", "c1_bs", "i0_s0",
              "i1_s0", "K0", "K1", "out_s0", "out_s1"}


def _pointer_types(v):
    cache = "*bf16" if v.get("fmt") == fc.PLAIN_BF16.value else "*u8"
    final = v.get("final", False)
    return {"q_ptr": "*u8" if v.get("q_fp8") else "*bf16", "c0_ptr": cache, "c1_ptr": cache,
            "i0_ptr": "*i32", "i1_ptr": "*i32", "l0_ptr": "*i32", "l1_ptr": "*i32",
            "scale_ptr": "*fp32", "part_o": "*fp32" if final else "*bf16",
            "part_ml": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "mx_ptr": "*fp32",
            "sink_ptr": "*fp32", "out_scale_ptr": "*fp32"}


def constexprs(name):
    """The launch's compile-time parameters for variant ``name`` (decode-shaped: two
    sources with lengths, a sink, lse, PDL; 2 head blocks where the variant is a cluster)."""
    from sparse_mla.ops.attention.sm90 import tuning
    v = VARIANTS[name]
    cluster = v.get("cluster", False)
    return tuning.launch_constexprs(
        v["fmt"], has_l0=True, has_l1=True, has_src1=True, track_max=False,
        n_units=2 if cluster else 1, scale_t=False, q_fp8=v.get("q_fp8", False),
        final=v.get("final", False), has_sink=True, has_lse=True, out_scale_t=False, pdl=True,
        d576=v.get("d576", False), f16=v.get("f16", False), staged=v.get("staged", False),
        cluster=cluster, persist=v.get("persist", False))


def compile_variant(name):
    """``sm90_kernel`` compiled for sm_90a (the CompiledKernel: ``asm["ptx"]``, metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from sparse_mla.ops.attention.sm90 import kernel
    fn = kernel.sm90_kernel
    names = list(inspect.signature(fn.fn).parameters)
    cx = constexprs(name)
    num_warps = cx.pop("num_warps")
    pointers = _pointer_types(VARIANTS[name])
    unknown = [n for n in cx if n not in names]
    if unknown:
        raise ValueError(f"{name}: launch_constexprs gives parameters {unknown} that "
                         "sm90_kernel does not have")
    unset = [p.name for p in fn.params if p.is_constexpr and p.name not in cx
             and p.name != "num_warps"]
    if unset:
        raise ValueError(f"{name}: no value for sm90_kernel's constexpr parameters {unset}")
    cx["num_warps"] = num_warps
    # run-time parameters defaulting to None (n_tok without PERSIST) are constexpr None where
    # unused, as the JIT makes them
    for p in fn.params:
        if not p.is_constexpr and p.has_default and p.default is None \
                and p.name not in pointers and not (p.name == "n_tok" and cx["PERSIST"]):
            cx[p.name] = None
    sig, by_path, attrs = records.signature(fn, cx, pointers, _FLOATS, _DIVISIBLE)
    src = GluonASTSource(fn, sig, constexprs=by_path, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_ctas": 1})


@dataclasses.dataclass
class Report:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    counts: dict      # PTX instruction counts that show the kernel's structure

    def __str__(self):
        c = " ".join(f"{k}={v}" for k, v in self.counts.items())
        return (f"{self.name:16s} {self.registers:4d} regs  spills {self.spill_stores:4d} B "
                f"stored / {self.spill_loads:4d} B loaded  shared {self.shared:6d} B  {c}")


_COUNTED = {"wgmma": r"\bwgmma\.mma_async", "cp.async": r"\bcp\.async\.ca|\bcp\.async\.cg",
            "mbarrier": r"\bmbarrier\.", "bar.sync": r"\bbar\.sync|\bbarrier\.sync",
            "setmaxnreg": r"\bsetmaxnreg", "cp.async.bulk": r"\bcp\.async\.bulk\.shared"}


def ptxas_report(name, kernel, arch="sm_90a"):
    """ptxas -v on the kernel's PTX with the ptxas Triton itself uses for sm_90."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([get_ptxas(90).path, "-v", f"--gpu-name={arch}", path, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{name}: ptxas failed: {res.stderr[-800:]}")
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    counts = {k: len(re.findall(p, ptx)) for k, p in _COUNTED.items()}
    return Report(name, regs, int(spills.group(1)), int(spills.group(2)),
                  kernel.metadata.shared, counts)


def main(argv=None):
    import triton
    names = argv or list(VARIANTS)
    print(f"triton {triton.__version__}, sm90_kernel for sm_90a")
    for name in names:
        print(ptxas_report(name, compile_variant(name)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
