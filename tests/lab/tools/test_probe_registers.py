"""lab/tools/probe_registers.py compiles the attention core for sm_90a without a GPU."""
import pytest

from sparse_mla.lab.tools import probe_registers


def _ptxas_or_skip():
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path
    except Exception as exc:  # a Triton build without the NVIDIA backend
        pytest.skip(f"no ptxas in this Triton: {exc}")


def test_probe_reports_a_real_register_allocation(capsys):
    _ptxas_or_skip()
    k = probe_registers.compile_split_kernel("v4", block_n=32, stages=1, warps=4, dv=2)
    regs, spill_st, spill_ld, smem = probe_registers.ptxas_report(k)
    assert 16 <= regs <= 255
    assert spill_st >= 0 and spill_ld >= 0
    # q (64 x 512 bf16) and the joined key tile (32 x 512 bf16) live in shared memory
    assert smem >= 64 * 512 * 2 + 32 * 512 * 2
    assert "wgmma" in k.asm["ptx"]           # Hopper tensor-core path, not a fallback
    # the form without the key loop (splits of one tile) holds no loop-carried tiles
    one = probe_registers.compile_split_kernel("v4", block_n=32, stages=1, warps=4, dv=2,
                                               one_tile=True)
    one_regs, one_st, _, one_smem = probe_registers.ptxas_report(one)
    assert one_regs <= regs and one_st <= spill_st and one_smem == smem
    probe_registers.main(["--fmt", "plain_bf16", "--block-n", "32", "--stages", "1"])
    assert "registers" in capsys.readouterr().out
