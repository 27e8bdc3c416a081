"""paper_estimate: a bench_flashmla --soft table read back, and the estimate's arithmetic."""
import pytest

from sparse_mla.ops.flashmla_decode import bench
from sparse_mla.lab.tools import paper_estimate as pe

COLS = ["shape", "route", "portable µs", "ours µs", "soft µs"]


def _run(tmp_path, times, soft=True):
    cols = COLS if soft else COLS[:-1]
    lines = ["NVIDIA H200: copy 4,000 GB/s, matmul 800 TFLOP/s (measured now); torch x",
             "  ".join(cols)]
    for shape, (portable, softt) in times.items():
        cells = [shape, "sm90", f"{portable}", "1.0"] + ([f"{softt}"] if soft else [])
        lines.append("  ".join(cells))
    path = tmp_path / "run.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_estimate_scales_the_measured_efficiency_to_each_card(tmp_path):
    case = next(c for c in bench.cases("cpu", False) if "prefill" not in c.op)
    path = _run(tmp_path, {case.shape: (20.0, 30.0)})
    (line,) = pe.estimates(path)
    floor_here = max(case.bytes / 4000e9, case.flops / 800e12)
    for card, (arch, bw, rate) in pe.CARDS.items():
        measured = (30.0 if arch < 89 else 20.0) * 1e-6
        floor = max(case.bytes / (bw * 1e9), case.flops / (rate * 1e12))
        assert line[card] == pytest.approx(floor * measured / floor_here * 1e6)
    # a slower card gets a longer estimate than a faster one of the same route
    assert line["RTX 3090"] > line["A100 80GB SXM"]


def test_a_run_without_the_soft_column_is_refused(tmp_path):
    case = next(c for c in bench.cases("cpu", False) if "prefill" not in c.op)
    with pytest.raises(ValueError, match="--soft"):
        pe.estimates(_run(tmp_path, {case.shape: (20.0, 30.0)}, soft=False))
