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
