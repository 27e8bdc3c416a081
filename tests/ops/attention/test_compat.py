"""The sm_90 kernel's Triton-version shims (ops/attention/sm90/compat.py): the panel-view
switch follows the Triton release unless SPARSE_MLA_GLUON_PANEL_VIEWS forces it."""
import os
import subprocess
import sys

import pytest

from sparse_mla.ops.attention import plan

pytestmark = pytest.mark.skipif(
    not plan.sm90_triton_supported(),
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


def test_rank_views_is_on_for_triton_37_only_and_read_at_each_launch(monkeypatch):
    """``compat.RANK_VIEWS`` (the V4 cluster producer's rank-indexed stores) defaults to on
    for Triton 3.7 only, and ``tuning.launch_constexprs`` reads it at each call, for V4
    clusters only: flipping it between launches builds the other kernel (the 3.7 A/B,
    lab/tools/ab_triton37.py)."""
    from sparse_mla.ops.attention.sm90 import compat
    from sparse_mla.ops.attention.sm90 import variants as sm90_variants
    assert compat.RANK_VIEWS is (compat.TRITON == (3, 7))
    for flag in (False, True):
        monkeypatch.setattr(compat, "RANK_VIEWS", flag)
        for name in sm90_variants.VARIANTS:
            v = sm90_variants.VARIANTS[name]
            want = flag and v["fmt"] == 0 and v.get("cluster", False)
            assert sm90_variants.constexprs(name)["RANK_VIEWS"] is want, name
