"""The cluster kernel's inline PTX text (pure Python, no GPU): what each CTA copies into its
peer's stage must be exactly what the peer's ready barrier expects, or the kernel hangs (too
few bytes) or completes a phase early (too many)."""
import re

import pytest

from sparse_mla.ops.attention.sm90 import cluster_ptx as cp

COPY = re.compile(r"cp\.async\.bulk\.shared::cluster\.shared::cta\.mbarrier::complete_tx::bytes"
                  r" \[dst\], \[src\], (\d+), \[rbar\];")


def _copied_panels(ptx):
    """Panel numbers of the copies in one send's PTX, in order, and their byte counts."""
    offsets = [int(m) for m in re.findall(r"add\.u32 src, src, (\d+);", ptx)]
    sizes = [int(m) for m in COPY.findall(ptx)]
    assert len(offsets) == len(sizes)
    assert all(o % cp.PANEL == 0 for o in offsets)
    return [o // cp.PANEL for o in offsets], sizes


@pytest.mark.parametrize("sends,panels", [(cp.V4_SENDS, range(7)), (cp.V32_SENDS, range(8))])
def test_each_panel_is_sent_once_and_expected(sends, panels):
    """V4 sends latent panels 0-6 (its RoPE panel 7 comes from the cache), V3.2 all eight;
    the count the peer expects is the count sent, and no panel goes twice."""
    sent = []
    for first, n in sends:
        got, sizes = _copied_panels(cp.send_panels(first, n))
        assert got == list(range(first, first + n))
        assert sizes == [cp.PANEL_TX] * n
        sent += got
    assert sorted(sent) == list(panels)
    assert cp.sent_panels(sends) == len(panels)


def test_v32_batches_are_the_kernels_pairs():
    """The V3.2 producer stores its two staged pairs of panels (panels 0-3) and sends them as
    batch 0, then stores and sends pairs 2 and 3 one at a time: batch k > 0 must be panels
    2k + 2 and 2k + 3."""
    assert cp.V32_SENDS == ((0, 4), (4, 2), (6, 2))


def test_only_thread_zero_copies():
    """The copies sit on thread 0's own path (every other thread branches around them, to a
    label unique to each asm instance); a predicated copy would be wrapped by ptxas in a
    uniform-datapath loop that every producer warp runs."""
    ptx = cp.send_panels(0, 7)
    assert "@!leader bra SMLA_SKIP_${:uid};" in ptx
    assert ptx.count("SMLA_SKIP_${:uid}:") == 1
    assert ptx.index("@!leader bra") < ptx.index("cp.async.bulk") < ptx.index("SMLA_SKIP_${:uid}:")
    assert "@leader cp.async" not in ptx


def test_every_placeholder_names_a_buffer():
    """The compile hook replaces each SMLA_OFF_* with its buffer's shared-memory offset; one
    it does not know is a compile error on the GPU."""
    texts = [cp.send_panels(f, n) for f, n in cp.V4_SENDS + cp.V32_SENDS]
    texts += [cp.REMOTE_ARRIVE, cp.CLUSTER_ARRIVE_INIT, cp.CLUSTER_ARRIVE, cp.CLUSTER_WAIT]
    used = set()
    for t in texts:
        assert t.count("{") == t.count("}")
        used |= set(re.findall(r"SMLA_OFF_[A-Z_]+", t))
    assert used == set(cp.OFFSET_NAMES)
