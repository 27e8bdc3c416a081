"""lab/tools/probe_cluster.py: the 2-CTA cluster route (DSMEM bulk copy, remote mbarrier arrive)
compiles for sm_90a on the tested Triton releases (3.6-3.9) and, on an sm_90 GPU, every CTA
gets its peer's half."""
import pytest

from sparse_mla.ops.attention.plan import sm90_triton_supported
from sparse_mla.tests.helpers import hopper_with_sm90

pytestmark = pytest.mark.skipif(not sm90_triton_supported(),
                                reason="the Triton release is outside the tested Gluon range")


def test_compiles_for_sm90a():
    from sparse_mla.lab.tools import probe_cluster
    assert probe_cluster.compile_only() == 0


@pytest.mark.skipif(not hopper_with_sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("graph", [False, True])
def test_every_cta_gets_its_peers_half(graph, capsys):
    from sparse_mla.lab.tools import probe_cluster
    assert probe_cluster.run(264, graph) == 0
    assert "264 with both halves, 0 without" in capsys.readouterr().out
