"""The sm_90 kernel's Triton-version shims (ops/attention/sm90/compat.py): the panel-view
switch follows the Triton release unless SPARSE_MLA_GLUON_PANEL_VIEWS forces it."""
import os
import subprocess
import sys

import pytest

from sparse_mla.ops.attention import plan

pytestmark = pytest.mark.skipif(
    not plan.gluon_triton_supported(),
    reason="the Gluon shims are imported only on the tested Triton releases")

PROBE = ("from sparse_mla.ops.attention.sm90 import compat; "
         "print(bool(compat.PANEL_VIEWS.value), compat.TRITON >= (3, 7))")


def _panel_views(**env):
    clean = {k: v for k, v in os.environ.items() if "PANEL_VIEWS" not in k}
    out = subprocess.run([sys.executable, "-c", PROBE], env=dict(clean, **env),
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", out[1] == "True"


@pytest.mark.parametrize("value,want", [("0", False), ("1", True)])
def test_the_variable_forces_panel_views(value, want):
    assert _panel_views(SPARSE_MLA_GLUON_PANEL_VIEWS=value)[0] is want


def test_default_follows_the_triton_release_and_the_old_name_is_gone():
    views, new_triton = _panel_views()
    assert views is new_triton
    # the pre-rename spelling is not read any more (no alias)
    assert _panel_views(SMLA_GLUON_PANEL_VIEWS="0" if new_triton else "1")[0] is new_triton
