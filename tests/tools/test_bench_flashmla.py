"""tools/bench_flashmla.py: the alternating rounds' arithmetic and argument checks (CPU)."""
import pytest

from sparse_mla.tools import bench_flashmla


def test_rounds_alternate_and_report_median_ratio(monkeypatch):
    calls = []
    # (vendor, ours) seconds per round; the per-round ratios are 1.2, 0.9, 1.0
    script = iter([12.0, 10.0, 9.0, 10.0, 10.0, 10.0])

    def fake_time(fn):
        calls.append(fn())
        return next(script), "graph"

    monkeypatch.setattr(bench_flashmla, "_time", fake_time)
    tv, to, ratio, lo, hi = bench_flashmla._alternate(lambda: "v", lambda: "o", 3)
    assert calls == ["v", "o"] * 3          # taken in turn, not all of one then the other
    assert (tv, to) == (10.0, 10.0)
    assert ratio == pytest.approx(1.0)
    assert (lo, hi) == (pytest.approx(0.9), pytest.approx(1.2))


def test_rounds_below_one_are_refused_before_anything_is_timed(monkeypatch, capsys):
    monkeypatch.setattr(bench_flashmla.harness, "copy_bandwidth",
                        lambda *_: pytest.fail("timed before checking --rounds"))
    with pytest.raises(SystemExit):
        bench_flashmla.main(["--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
