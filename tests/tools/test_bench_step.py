"""The layer-step benchmark on CPU at tiny shapes: its table and CSV carry every column with
values that agree with each other and with the floor recomputed here, the V4.1 rows need the
two-level indexer's ops (and say so), and the GPU-only path exits naming the GPU."""
import contextlib
import io

import pytest
import torch

from sparse_mla.backends.v4 import LayerKind
from sparse_mla.tools import bench_step as bs
from sparse_mla.tools import perf_tables

TINY = ["--device", "cpu", "--impl", "reference", "--contexts", "255", "--batch", "2",
        "--sq", "2", "--heads", "2"]


@pytest.fixture(scope="module")
def v4_run(tmp_path_factory):
    """One tiny run of both V4 kinds (MTP at positions 255 and 256: the first completes a
    compressed entry of both kinds, so every insert has work)."""
    path = tmp_path_factory.mktemp("bench_step") / "step.csv"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = bs.main(TINY + ["--kinds", "C4A", "C128A", "--csv", str(path)])
    return rc, buf.getvalue(), _rows(path)


def _rows(path):
    """The CSV as docs/PERF.md's generator reads it (caption lines, then the table)."""
    caption, header, rows = perf_tables.read(path)
    assert caption and "bench_step" in caption[0] and "GB/s" in caption[0]
    return [dict(zip(header, r)) for r in rows]


def _num(cell):
    return None if cell == "-" else float(cell)


def test_table_and_csv_have_every_column(v4_run):
    rc, out, rows = v4_run
    assert rc == 0
    header = next(line for line in out.splitlines() if not line.startswith("#")).split()
    assert header == list(bs.COLUMNS[:-2])
    assert [(r["kind"], r["ctx"], r["batch"], r["s_q"]) for r in rows] == \
        [("C4A", "255", "2", "2"), ("C128A", "255", "2", "2")]
    assert list(rows[0]) == list(bs.COLUMNS)
    assert "indexer_topk_decode=reference" in out and "flashmla_sparse_decode=reference" in out


def test_values_are_sane(v4_run):
    """Cells as printed (2 decimals below 100, whole numbers above): sums and ratios agree
    within that rounding."""
    _, _, rows = v4_run
    for r in rows:
        indexer = r["kind"] == "C4A"
        for part in ("idx_insert", "idx_topk"):
            assert (_num(r[part]) is not None) == indexer, (r["kind"], part)
        assert r["idx_in_cand"] == "-"       # V4.1 "in-cand" rows only
        timed = [_num(r[p]) for p in bs.PARTS if _num(r[p]) is not None]
        assert all(t > 0 for t in timed)
        assert _num(r["parts_sum"]) == pytest.approx(sum(timed), rel=1e-2, abs=4)
        step, floor, bw = _num(r["step"]), _num(r["floor"]), _num(r["copy_GBps"]) * 1e9
        assert step > 0 and bw > 0
        assert floor == pytest.approx(int(r["floor_bytes"]) / bw * 1e6, rel=1e-2)
        assert _num(r["step/floor"]) == pytest.approx(step / floor, rel=2e-2, abs=1)


def _floor_by_hand(name, ratio, topk, index_heads, role, h, ctx, b, s_q):
    """The docstring's floor, token by token (an independent count of what the step moves)."""
    n, window, cand = ctx + s_q, 128, 2048 * 8
    entries = n // ratio if ratio else 0
    total = 0
    for _ in range(b):
        for pos in range(ctx, ctx + s_q):
            total += h * 512 * 2 + h * 512 * 2          # q in, out
            total += 512 * 2 + 584                      # kv row in, SWA record out
            if ratio and (pos + 1) % ratio == 0:
                total += 512 * 2 + 584
                if index_heads and role != "in-cand":
                    total += 128 * 2 + 132
            if index_heads:
                total += index_heads * (128 * 2 + 4) + topk * 4
                if role == "cand":
                    total += 2048 * 4
        listed = entries if name == "C128A" else min(entries, topk)
        total += (listed + min(n, window + s_q - 1)) * 584
        if index_heads:
            total += (min(entries, cand) if role == "in-cand" else entries) * 132
    return total


@pytest.mark.parametrize("layer", list(bs.layers(("C4A", "C128A", "C1A", "C2A"))),
                         ids=lambda x: f"{x.name}-{x.role or 'v4'}")
@pytest.mark.parametrize("ctx,b,s_q", [(255, 2, 2), (4096, 1, 1), (1 << 20, 8, 2)])
def test_floor_counts_every_byte_once(layer, ctx, b, s_q):
    expect = _floor_by_hand(layer.name, layer.kind.ratio if layer.kind.compressed else 0,
                            layer.topk, layer.index_heads, layer.role, 64, ctx, b, s_q)
    assert bs.floor_bytes(layer, 64, ctx, b, s_q) == expect


def test_level_two_reads_fewer_keys_than_level_one_at_long_context():
    cand, in_cand = [lay for lay in bs.layers(("C1A",))]
    assert bs.floor_bytes(in_cand, 64, 1 << 18, 8, 1) < bs.floor_bytes(cand, 64, 1 << 18, 8, 1)
    assert cand.kind.ratio == 1 and LayerKind.C4A.ratio == 4


def test_v41_rows_need_the_two_level_ops(monkeypatch, capsys):
    """Without the ops the rows are skipped with the ops' names and the run fails (never a
    row of made-up numbers)."""
    monkeypatch.setattr(bs, "V41_OPS", ("indexer_v41_no_such_op",) + bs.V41_OPS[1:])
    assert bs.main(TINY + ["--kinds", "C2A"]) == 1
    out, err = capsys.readouterr()
    assert "indexer_v41" in err and "C2A cand" in out and "C2A in-cand" in out
    with pytest.raises(RuntimeError, match="needs? ops .*indexer_v41"):
        bs.run_case(next(bs.layers(("C1A",))), 2, 64, 1, 1, "cpu", "reference")


def test_v41_rows_run_when_the_ops_exist(tmp_path, capsys):
    try:
        bs.v41_ops()
    except RuntimeError as e:
        pytest.skip(str(e))
    path = tmp_path / "v41.csv"
    assert bs.main(TINY + ["--kinds", "C1A", "--contexts", "40", "--csv", str(path)]) == 0
    rows = _rows(path)
    assert [(r["kind"], r["role"]) for r in rows] == [("C1A", "cand"), ("C1A", "in-cand")]
    filled = [[_num(r[p]) is not None for p in ("idx_insert", "idx_topk", "idx_in_cand")]
              for r in rows]
    assert filled == [[True, True, False], [False, False, True]]
    assert "indexer_v41_candidates_decode=reference" in capsys.readouterr().out


def test_a_context_too_big_is_skipped_with_a_note(monkeypatch, capsys):
    monkeypatch.setattr(bs, "free_bytes", lambda device: 1 << 20)
    assert bs.main(TINY + ["--kinds", "C128A", "--contexts", "1M"]) == 0
    out = capsys.readouterr().out
    assert "# skipped C128A" in out and "GiB free" in out


def test_contexts_parse():
    assert [bs.parse_context(c) for c in ("4k", "64k", "256k", "1M", "300")] == \
        [4096, 65536, 262144, 1 << 20, 300]
    for bad in ("0", "4q", "-1"):
        with pytest.raises(Exception, match="context"):
            bs.parse_context(bad)


def test_cuda_without_a_gpu_exits_naming_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda needs a CUDA GPU"):
        bs.main(["--quick"])


def test_mtp_ratios_pair_each_draft_with_its_s_q_1_steps():
    """``--mtp-ratios`` adds s_q 1 at b and b * s_q requests (once each) and divides each
    MTP step's time by both; a missing partner prints "-"."""
    assert bs.step_shapes([1, 8], [1, 8], mtp_ratios=True) == \
        [(1, 1), (1, 8), (8, 1), (8, 8), (64, 1)]
    assert bs.step_shapes([2], [4]) == [(2, 4)]
    row = lambda b, s, t: dict(kind="C4A", role="-", ctx="64k", batch=b, s_q=s, step=t)  # noqa: E731
    lines = bs.mtp_summary([row(2, 1, 10.0), row(2, 4, 15.0), row(8, 1, 30.0),
                            row(3, 8, 40.0)])
    assert lines[0].endswith("15.0 µs = 1.50 x s_q 1 (b2), 0.50 x 8 requests of s_q 1")
    assert lines[1].endswith("40.0 µs = - x s_q 1 (b3), - x 24 requests of s_q 1")
    assert len(lines) == 2
