"""The main job runs end to end on CPU, checks every result and prints its table."""
from sparse_mla.tools import cli


def test_cli_prints_checked_table(capsys):
    assert cli.main(["--device", "cpu", "--small", "--ops", "cache_insert"]) == 0
    out = capsys.readouterr().out
    assert "roofline (measured now): copy" in out
    rows = [line for line in out.splitlines() if line.startswith(("quantize", "fused", "gather"))]
    ref_rows = [r for r in rows if " reference " in r]
    assert len(ref_rows) == 5 and all("0 bytes differ" in r for r in ref_rows)
    assert any("n/a: no vendor wheel ships this op" in r for r in rows)


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
