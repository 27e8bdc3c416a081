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


class _Case:
    def __init__(self, op, run=None):
        self.op, self.shape, self.run = op, f"{op} shape", run


def test_soft_columns_are_na_with_a_reason_on_prefill_rows(monkeypatch):
    """Prefill reads bf16: --soft skips its columns (it used to stop the whole run there)."""
    case = _Case("flashmla_sparse_prefill", run=lambda a, impl: pytest.fail("ran prefill soft"))
    assert bench_flashmla.soft_columns(case, {}, 1.0, 1.0, None) == ("n/a*",) * 4
    assert "no e4m3 to decode" in bench_flashmla.soft_skip_reason(case)


def test_soft_columns_still_refuse_a_decode_row_the_switch_did_not_reach(monkeypatch):
    monkeypatch.setattr(bench_flashmla, "_time", lambda fn: (fn() or 1.0, "graph"))
    monkeypatch.setattr(bench_flashmla.dispatch, "last_plan", lambda: None)
    case = _Case("flashmla_sparse_decode", run=lambda a, impl: None)
    assert bench_flashmla.soft_skip_reason(case) is None
    with pytest.raises(RuntimeError, match="SPARSE_MLA_SOFT_FP8=1 ran '\\?'"):
        bench_flashmla.soft_columns(case, {}, 1.0, 1.0, None)


def test_the_footnote_names_why_prefill_soft_is_na(monkeypatch, capsys):
    """A whole --soft run over one decode and one prefill row with the GPU parts faked: the run
    reaches the table and its footnote."""
    import os
    import types

    import torch
    out, last = [torch.zeros(2)], {}

    def runner(label):
        """As the op does: the software route only where there is e4m3 to decode."""
        def run(a, impl):
            soft = os.environ.get("SPARSE_MLA_SOFT_FP8") == "1" and label == "decode"
            last["label"] = "portable, software e4m3" if soft else "portable"
            return out
        return run
    decode = types.SimpleNamespace(op="flashmla_sparse_decode", shape="b=2 decode",
                                   make=lambda: {"q": torch.zeros(1, 1, 4, 1)},
                                   run=runner("decode"), flops=1.0, bytes=1.0)
    prefill = types.SimpleNamespace(op="flashmla_sparse_prefill", shape="prefill",
                                    make=lambda: {}, run=runner("prefill"), flops=1.0,
                                    bytes=1.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_flashmla.bench, "cases", lambda device, small: [decode, prefill])
    for name, value in (("copy_bandwidth", 1e12), ("matmul_rate", 1e15),
                        ("device_name", "fake GPU")):
        monkeypatch.setattr(bench_flashmla.harness, name, lambda *_, v=value: v)
    monkeypatch.setattr(bench_flashmla, "_time", lambda fn: (fn() and 1e-5, "graph"))
    monkeypatch.setattr(bench_flashmla, "planned_flash_mla",
                        lambda a: (lambda: out, [torch.zeros(1, 1, 4)]))
    monkeypatch.setattr(bench_flashmla, "_padded_for_flash_mla", lambda a: a)
    monkeypatch.setattr(bench_flashmla, "_flash_mla_prefill", lambda a: out)
    monkeypatch.setattr(bench_flashmla.dispatch, "last_plan",
                        lambda: types.SimpleNamespace(route="portable", label=last["label"]))
    bench_flashmla.main(["--soft"])
    table = capsys.readouterr().out
    assert "n/a*" in table
    assert "* n/a (flashmla_sparse_prefill): prefill reads a bf16 kv" in table


def test_e4m3_q_inputs_stand_for_the_same_q():
    """--q-e4m3 hands the op an e4m3 q whose values times its scale are the bf16 q's within
    e4m3's rounding (3 mantissa bits)."""
    import torch
    q = torch.randn(2, 1, 8, 512).to(torch.bfloat16)
    a8 = bench_flashmla.e4m3_q_inputs({"q": q, "k_cache": None})
    assert a8["q"].dtype == torch.float8_e4m3fn and a8["q_scale"].shape == (1,)
    back = a8["q"].float() * a8["q_scale"]
    torch.testing.assert_close(back, q.float(), rtol=2 ** -3, atol=a8["q_scale"].item() * 2 ** -9)
    assert a8["k_cache"] is None                  # the rest of the inputs as they were


def test_e4m3_columns_are_na_on_prefill_rows():
    case = _Case("flashmla_sparse_prefill", run=lambda a, impl: pytest.fail("ran prefill e4m3"))
    assert bench_flashmla.e4m3_columns(case, {}, 1.0, None) == ("n/a*",) * 3


def test_e4m3_columns_time_and_compare_decode_rows(monkeypatch):
    import torch
    monkeypatch.setattr(bench_flashmla, "_time", lambda fn: (fn() and 2e-6, "graph"))
    seen = []
    case = _Case("flashmla_sparse_decode",
                 run=lambda a, impl: seen.append(a["q"].dtype) or (a["q"].float()[..., :4],))
    q = torch.ones(1, 1, 2, 8, dtype=torch.bfloat16)
    cells = bench_flashmla.e4m3_columns(case, {"q": q}, 1e-6, (torch.zeros(1, 1, 2, 4),))
    assert seen and set(seen) == {torch.float8_e4m3fn}
    assert cells[0] == "2.0" and cells[1] == "2.00" and float(cells[2]) > 0


def test_mtp_rows_divide_by_s_q_1_and_by_independent_requests():
    """``--mtp``: each s_q's time over s_q 1 at b requests and at b * s_q requests (a fake
    timer: a fixed cost per request plus a cost per token)."""
    calls = []

    def fake(b, s_q, h, topk):
        calls.append((b, s_q, h))
        return (b * 10 + b * s_q * 2) * 1e-6
    rows = bench_flashmla.mtp_rows([2], [1, 8], fake)
    assert [r[0] for r in rows] == ["v4 b=2 s_q=1 h=64 win=128+512",
                                    "v4 b=2 s_q=8 h=64 win=128+512",
                                    "v4 b=2 s_q=1 h=128 win=128+1024",
                                    "v4 b=2 s_q=8 h=128 win=128+1024"]
    assert rows[0][1:] == ("24.0", "1.00", "2", "1.00")
    assert rows[1][1:] == ("52.0", f"{52 / 24:.2f}", "16", f"{52 / 192:.2f}")
    assert (16, 1, 64) in calls and (2, 8, 128) in calls


def test_mtp_flags_are_checked_before_the_gpu(monkeypatch):
    monkeypatch.setattr(bench_flashmla.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench_flashmla.main(["--mtp", "9"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        bench_flashmla.main(["--mtp", "8", "--mtp-batch", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        bench_flashmla.main(["--mtp", "4", "8", "--mtp-batch", "2"])
    assert exc.value.code == bench_flashmla.NEEDS_GPU
