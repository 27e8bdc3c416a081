"""Every launch variant of the sm_90 Gluon kernel compiles for sm_90a with the installed Triton
(no GPU: Triton's own ptxas allocates the registers), so a Triton upgrade that breaks the kernel
fails here, in the CPU CI, instead of silently sending Hopper GPUs to the portable kernel.

Registers and spills are reported per variant (a warning where ptxas spills: the numbers per
release are in lab/perf-history.md, "Triton 3.6-3.9"). Runs where the installed Triton is in the
tested range (``plan.SM90_TRITON``); outside it the kernel is not used at all, and
test_sm90_gate checks that the reason says so.
"""
import warnings

import pytest

from sparse_mla.ops.attention import plan
from sparse_mla.ops.attention.sm90 import variants as sm90_variants

pytestmark = pytest.mark.skipif(
    not plan.sm90_triton_supported() or plan.triton_interpreting(),
    reason="the installed Triton is outside the Gluon kernel's tested range (or interpreted)")

SM90_SHARED = 232448        # bytes of shared memory a CTA may use on sm_90


def test_every_launch_variant_is_listed():
    """The variants cover every cache format, both 576-wide routes, staging, clusters and
    the one-split epilogue, so no launch ``run`` can make goes unchecked."""
    v = sm90_variants.VARIANTS
    # 5: V4.1 528 B rows; 7 / 8: 528 B main rows with 288 B / 584 B extra rows
    assert {x["fmt"] for x in v.values()} == {0, 1, 2, 3, 5, 7, 8}
    assert {x["fmt"] for x in v.values() if x.get("cluster")} >= {5, 7, 8}
    assert any(x.get("cluster") and x["fmt"] == 0 for x in v.values())
    assert any(x.get("cluster") and x["fmt"] == 1 for x in v.values())
    assert any(x.get("final") for x in v.values())
    assert any(x.get("f16") for x in v.values())


@pytest.mark.parametrize("name", list(sm90_variants.VARIANTS))
def test_variant_compiles_for_sm90a(name):
    r = sm90_variants.ptxas_report(name, sm90_variants.compile_variant(name))
    print(r)
    v = sm90_variants.VARIANTS[name]
    assert r.counts["wgmma"] > 0 and r.counts["mbarrier"] > 0
    assert r.counts["setmaxnreg"] > 0       # the partitions' register budgets survived
    assert (r.counts["cp.async.bulk"] > 0) == bool(v.get("cluster"))
    if v.get("staged") or v["fmt"] == 2:
        assert r.counts["cp.async"] > 0
    assert 0 < r.shared <= SM90_SHARED
    if r.spill_stores or r.spill_loads:
        warnings.warn(f"sm_90 kernel variant {name} spills: {r}", stacklevel=1)


def test_cluster_offsets_were_filled_in():
    """The cluster variant's shared-memory placeholders became numbers (the compile hook's
    edit); a placeholder left in the PTX would not even assemble, but say so plainly."""
    k = sm90_variants.compile_variant("v4_cluster")
    assert "SMLA_OFF_" not in k.asm["ptx"]
    assert not any(line.startswith(".maxnreg") for line in k.asm["ptx"].splitlines())


def test_rank_views_build_compiles_without_spills(monkeypatch):
    """The V4 cluster producer's rank-indexed stores (``compat.RANK_VIEWS``, the default on
    Triton 3.7 only) compile on whatever Triton is installed: one e4m3 conversion per byte
    pair of the chunk (56 a thread: no copy per rank), 168 registers, no spills."""
    from sparse_mla.ops.attention.sm90 import compat
    monkeypatch.setattr(compat, "RANK_VIEWS", True)
    k = sm90_variants.compile_variant("v4_cluster")
    r = sm90_variants.ptxas_report("v4_cluster", k)
    print(r)
    assert k.asm["ptx"].count("cvt.rn.f16x2.e4m3x2") == 56
    assert r.registers <= 168 and r.spill_stores == 0 and r.spill_loads == 0
