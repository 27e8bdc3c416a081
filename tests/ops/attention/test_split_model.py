"""The split-count cost model of the sparse-attention launch (pure Python, no kernel)."""
import pytest

from sparse_mla.ops.attention import launch as core
from sparse_mla.ops.attention import plan
from sparse_mla.ops.attention.plan import choose_splits, plan_phases


@pytest.mark.parametrize("units,tiles,want", [
    (74, 10, 5),     # one split would leave 58 of 132 SMs idle
    (64, 10, 2),     # 128 programs: one wave
    (128, 10, 1),    # already one full wave
    (2, 10, 10),     # tiny batch: one tile per program
    (148, 18, 3),
])
def test_choose_splits_examples(units, tiles, want):
    assert choose_splits(units, tiles, 132, 1) == want      # the model at overhead 1


@pytest.mark.parametrize("units,tiles,max_splits,want", [
    (2, 36, 32, 18),    # batch 1 (two output-dim halves), window 128 + 1024 in 32-key tiles
    (2, 36, None, 36),
    (2, 20, 32, 20),
    (8, 20, 32, 10),    # 20 splits would make 160 programs: two waves
])
def test_choose_splits_caps_splits(units, tiles, max_splits, want):
    """Tiny launches cap the splits where one combine program merges them in one step."""
    assert choose_splits(units, tiles, 132, 3, max_splits) == want


@pytest.mark.parametrize("units", [1, 3, 64, 74, 132, 133, 256, 4096])
@pytest.mark.parametrize("tiles", [1, 2, 9, 18, 32])
def test_choose_splits_is_the_cheapest_and_in_range(units, tiles):
    def cost(s):
        return -(-units * s // 132) * (-(-tiles // s) + 1)

    got = choose_splits(units, tiles, 132, 1)
    assert 1 <= got <= tiles
    assert cost(got) == min(cost(s) for s in range(1, tiles + 1))
    assert all(cost(s) > cost(got) for s in range(1, got))   # ties go to fewer splits


@pytest.mark.parametrize("T,n_hb,tiles,want", [
    # 148 units of 18 tiles: 132 unsplit, then 16 in 6 splits (cost 36 vs 42 in one launch)
    (74, 2, 18, [(0, 66, 1), (66, 74, 6)]),
    (148, 2, 18, [(0, 132, 1), (132, 148, 4)]),
    (128, 2, 18, [(0, 128, 1)]),     # 256 units: two nearly full waves, one launch
    (64, 2, 18, [(0, 64, 1)]),       # one wave
    (2, 2, 18, [(0, 2, 18)]),        # tiny: split only
    (148, 1, 10, [(0, 132, 1), (132, 148, 5)]),
])
def test_plan_phases_examples(T, n_hb, tiles, want):
    assert plan_phases(T, n_hb, tiles, 132, 5) == want


@pytest.mark.parametrize("T", [1, 2, 37, 66, 67, 74, 131, 132, 133, 148, 256, 296, 1000])
@pytest.mark.parametrize("n_hb", [1, 2])
@pytest.mark.parametrize("tiles", [1, 3, 10, 18, 34])
def test_plan_phases_cover_every_token_once(T, n_hb, tiles):
    """Phases are contiguous token ranges covering [0, T); a two-launch plan's first launch is
    unsplit and fills whole waves, its second is split and cheaper than one launch."""
    phases = plan_phases(T, n_hb, tiles, 132, 5)
    assert phases[0][0] == 0 and phases[-1][1] == T
    assert all(a[1] == b[0] for a, b in zip(phases, phases[1:]))
    assert all(1 <= s <= tiles for _, _, s in phases)
    if len(phases) == 2:
        (t0, t1, s1), (_, _, s2) = phases
        assert s1 == 1 and s2 > 1 and (t1 - t0) * n_hb % 132 == 0


@pytest.mark.parametrize("ctas,sms,pdl,want", [
    (512, 132, True, 4), (256, 132, True, 2), (132, 132, True, 1), (1056, 132, True, 8),
    (1057, 132, True, None), (4096, 132, True, None), (512, 132, False, None)])
def test_combine_residency(ctas, sms, pdl, want):
    """Early-launched combines of up to ``COMBINE_SPREAD`` CTAs per SM are capped at
    ceil(CTAs / SMs) per SM; larger ones and those launched after the split are not."""
    assert core.combine_residency(ctas, sms, pdl) == want


def test_combine_residency_off(monkeypatch):
    monkeypatch.setattr(core, "COMBINE_SPREAD", None)
    assert core.combine_residency(512, 132, True) is None


# bench_flashmla's V4 decode rows as (tokens, head blocks, 64-key tiles): window 128 (2 tiles)
# + top-k (ops/flashmla_decode/bench.py: DECODE_SHAPES, SHARD_SHAPES, SHORT_SHAPES), V3.2's
# top-k 2048 row and the V4.1 row (window 128 + 512)
_BENCH_ROWS = {
    **{f"v4 b={b} s_q={s} h={h} +{k}": (b * s, -(-h // 64), 2 + k // 64)
       for h, k in ((64, 512), (128, 1024)) for s in (1, 2)
       for b in (2, 64, 74, 128, 148, 256)},
    **{f"v4 b={b} s_q=2 h={h} +512": (b * 2, 1, 10) for h in (32, 16) for b in (2, 64)},
    **{f"v4 b={b} s_q=1 h={h} +64": (b, -(-h // 64), 3) for h in (64, 128) for b in (64, 256)},
    "v32 b=64 s_q=2 h=128 2048": (128, 2, 32), "v41 b=64 s_q=1 h=64 +512": (64, 1, 10)}


def test_combine_is_charged_one_tile_by_default():
    assert plan.SPLIT_COMBINE_TILES == 1
    for T, n_hb, tiles in _BENCH_ROWS.values():
        assert plan_phases(T, n_hb, tiles, 132, 5) == plan_phases(T, n_hb, tiles, 132, 5, 1)


def test_combine_charge_of_one_tile_moves_only_the_short_b64_h64_row():
    """Charged one tile, the combine makes V4 b64 s_q1 h64 over 3 tiles (C128A) one split
    (3 tiles, no combine) instead of two (2 + 1 tiles and a combine); every other row of
    bench_flashmla keeps the plan of no charge."""
    moved = {name: plan_phases(*row, 132, 5, combine=1)
             for name, row in _BENCH_ROWS.items()
             if plan_phases(*row, 132, 5, combine=1) != plan_phases(*row, 132, 5, combine=0)}
    assert moved == {"v4 b=64 s_q=1 h=64 +64": [(0, 64, 1)]}


def _persist(T, n_hb, **kw):
    args = dict(sms=132, fmt="v4", staged=True, q_fp8=False, n_splits=1)
    args.update(kw)
    return plan.persist_programs(T, n_hb, **args)


def test_persistent_programs_where_they_pay():
    """Persistent sm_90 launches (ops/attention/sm90/persist.py): V4 rows staged, a bf16 q,
    one split, more units than SMs; as many programs a head block as fit,
    more where a program would get over ``tuning.PERSIST_TOKENS`` tokens."""
    from sparse_mla.ops.attention.sm90 import tuning
    assert tuning.PERSIST_V4 and tuning.PERSIST_TOKENS == 8
    assert _persist(256, 1) == 132 and _persist(256, 2) == 66 and _persist(133, 1) == 132
    assert _persist(132, 1) == 0 and _persist(66, 2) == 0      # one wave: nothing to gain
    assert _persist(8 * 132 + 1, 1) == 133                     # 8 tokens a program at most
    for kw in (dict(fmt="v32"), dict(fmt="v41", staged=False), dict(staged=False),
               dict(fmt="plain_fp8", staged=False), dict(q_fp8=True),
               dict(n_splits=2)):
        assert _persist(256, 1, **kw) == 0, kw


def test_persistent_programs_over_v41_rows_in_clusters(monkeypatch):
    """V4.1 rows (528 B main rows) take persistent programs in 2-CTA clusters
    (``tuning.PERSIST_V41``), not at 64 heads (Triton 3.7 / 3.8 spill that form), nor where it
    is off."""
    from sparse_mla.ops.attention.sm90 import tuning
    assert tuning.PERSIST_V41 is True
    assert _persist(256, 2, fmt="v41", cluster=True) == 66
    assert _persist(256, 1, fmt="v41") == 0
    assert _persist(256, 2, fmt="v41_fp4", cluster=True) == 0  # 288 B main rows: portable
    monkeypatch.setattr(tuning, "PERSIST_V41", False)
    assert _persist(256, 2, fmt="v41", cluster=True) == 0


def test_persistent_programs_over_v32_clusters(monkeypatch):
    """V3.2 rows take persistent programs only in 2-CTA clusters (their pair producer) and
    only where ``tuning.PERSIST_V32``."""
    from sparse_mla.ops.attention.sm90 import tuning
    assert tuning.PERSIST_V32 is True
    assert _persist(128, 2, fmt="v32", staged=False, cluster=True) == 66
    assert _persist(66, 2, fmt="v32", staged=False, cluster=True) == 0      # one wave
    assert _persist(256, 1, fmt="v32", staged=False) == 0       # 64 heads: no pair producer
    assert _persist(128, 2, fmt="v32", staged=False, cluster=True, n_splits=2) == 0
    monkeypatch.setattr(tuning, "PERSIST_V32", False)
    assert _persist(128, 2, fmt="v32", staged=False, cluster=True) == 0


def test_clusters_where_they_pay():
    """2-CTA clusters: not in tiny launches; not for V4 rows in one wave over fewer than 4
    tiles a token (C128A's 192 keys at batch 64 and 128 heads: 128 units on 132 SMs), but at
    batch 256 (two waves), over longer lists, and for V3.2 rows."""
    from sparse_mla.ops.attention.sm90 import tuning
    assert tuning.CLUSTER_V4_MIN_TILES == 4
    assert not plan.cluster_pays("v4", 8, 18, 132)
    assert not plan.cluster_pays("v4", 128, 3, 132)
    assert plan.cluster_pays("v4", 512, 3, 132)
    assert plan.cluster_pays("v4", 128, 4, 132) and plan.cluster_pays("v4", 128, 18, 132)
    assert plan.cluster_pays("v32", 128, 3, 132) and plan.cluster_pays("v41", 128, 3, 132)


def test_persistent_programs_off(monkeypatch):
    from sparse_mla.ops.attention.sm90 import tuning
    monkeypatch.setattr(tuning, "PERSIST_V4", False)
    assert _persist(256, 1) == 0


def test_bench_rows_that_run_persistent_programs():
    """Of bench_flashmla's V4 rows, those whose plan is one launch of one split over more
    units than SMs run persistent programs (2-8 tokens a program); two-launch plans (b 74 /
    148) and rows of one wave do not."""
    persistent = {}
    for name, (T, n_hb, tiles) in _BENCH_ROWS.items():
        phases = plan_phases(T, n_hb, tiles, 132, 5)
        fmt = name.split()[0]
        if len(phases) == 1:
            progs = _persist(T, n_hb, fmt=fmt, n_splits=phases[0][2])
            if progs:
                persistent[name] = progs
    h64 = ["v4 b=256 s_q=1 h=64 +512", "v4 b=128 s_q=2 h=64 +512", "v4 b=256 s_q=2 h=64 +512",
           "v4 b=256 s_q=1 h=64 +64"]
    h128 = ["v4 b=128 s_q=1 h=128 +1024", "v4 b=256 s_q=1 h=128 +1024",
            "v4 b=64 s_q=2 h=128 +1024", "v4 b=128 s_q=2 h=128 +1024",
            "v4 b=256 s_q=2 h=128 +1024", "v4 b=256 s_q=1 h=128 +64"]
    assert persistent == {**{n: 132 for n in h64}, **{n: 66 for n in h128}}
