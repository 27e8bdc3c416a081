"""The main job runs end to end on CPU, checks every result and prints its table."""
from sparse_mla.tests.helpers import INTERPRETING
from sparse_mla.tools import cli


def test_cli_prints_checked_table(capsys):
    assert cli.main(["--device", "cpu", "--small", "--ops", "cache_insert"]) == 0
    out = capsys.readouterr().out
    assert "roofline (measured now): copy" in out
    rows = [line for line in out.splitlines() if line.startswith(("quantize", "fused", "gather"))]
    ref_rows = [r for r in rows if " reference " in r]
    assert len(ref_rows) == 5 and all("0 bytes differ" in r for r in ref_rows)
    assert any(r.rstrip().endswith("n/a: no vendor wheel ships this op (vLLM's are in its own _C)")
               for r in rows)
    if not INTERPRETING:     # the whole reason, not cut at a fixed width
        assert any(r.rstrip().endswith("n/a: tensors are on CPU (Triton needs CUDA, or "
                              "TRITON_INTERPRET=1 for its interpreter)") for r in rows)


def test_an_error_is_not_taken_for_an_unavailable_implementation(monkeypatch):
    """Only ImplementationUnavailable makes an "n/a" row; any other error, whatever its
    text, stops the job (it used to be classified by the words in its message)."""
    import pytest
    from sparse_mla.ops.cache_insert import bench

    real = bench.cases

    def broken(device, small):
        out = real(device, small)[:1]

        def run(inputs, impl):
            raise RuntimeError("kernel cannot run: a real bug")
        out[0].run = run
        return out
    monkeypatch.setattr(bench, "cases", broken)
    with pytest.raises(RuntimeError, match="a real bug"):
        cli.main(["--device", "cpu", "--small", "--ops", "cache_insert"])


def test_cli_help_explains_itself(capsys):
    try:
        cli.main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    assert "compared with the reference" in capsys.readouterr().out


def test_a_differing_result_says_which_output_and_where():
    import torch
    ref = [torch.zeros(4, dtype=torch.bfloat16), torch.arange(6, dtype=torch.uint8).view(2, 3)]
    out = [ref[0].clone(), ref[1].clone()]
    assert cli._where_differs(ref, out) == "no byte differs (outside tolerance by value)"
    out[1][1, 2] = 99
    out[0].view(torch.int16)[3] = 1          # the smallest subnormal: one byte changes
    msg = cli._where_differs(ref, out)
    assert msg.startswith("output 0 (torch.bfloat16, [4]): 1 bytes differ, first at byte "
                          "offsets [6]")
    assert "output 1 (torch.uint8, [2, 3]): 1 bytes differ, first at byte offsets [5]" in msg
