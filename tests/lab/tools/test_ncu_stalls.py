"""lab/tools/ncu_stalls.py on a hand-made export in Nsight Compute's source-page CSV layout."""
import pytest

from sparse_mla.lab.tools import ncu_stalls

COLUMNS = ",".join(f'"{c}"' for c in (
    "Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
    "stall_barrier", "stall_long_sb", "stall_barrier (Not Issued)"))
EXPORT = f'''"Kernel Name","sm90_kernel",
{COLUMNS}
"0x10","      LDG.E.128 R4, desc[UR4][R2.64]","10","100","0","10","0"
"0x20","      @!P2  SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R17+URZ+0x31210], RZ","30","100","25","5","25"
"0x30","      WARPGROUP.DEPBAR.LE gsb0, 0x0","60","100","60","0","60"
'''


def test_summary_shares_reasons_opcodes_and_ranges(tmp_path, capsys):
    path = tmp_path / "source.csv"
    path.write_text(EXPORT)
    header, rows = ncu_stalls.load(str(path))
    assert len(rows) == 3
    out = ncu_stalls.summarize(header, rows, top=2, ranges=[(1, 3)])
    assert "3 instructions, 100 samples" in out
    assert "stall_barrier" in out and " 85.0%" in out          # 25 + 60 of 100
    assert "Not Issued" not in out.split("samples per opcode")[0]
    assert "WARPGROUP" in out and " 60.0%" in out and "SYNCS" in out
    assert "range [1, 3):  90.0%" in out
    hottest = out.split("hottest instructions")[1]
    assert "LDG" not in hottest and "DEPBAR" in hottest         # top 2 of 3
    ncu_stalls.main([str(path), "--range", "0:1"])
    assert "range [0, 1):  10.0%" in capsys.readouterr().out


def test_opcode_drops_predicates_and_modifiers():
    assert ncu_stalls.opcode("@!P2  SYNCS.ARRIVE.TRANS64.A1T0 RZ, [R17]") == "SYNCS"
    assert ncu_stalls.opcode("HGMMA.64x256x16.F32.BF16 R24, R152") == "HGMMA"


def test_export_without_samples_is_refused(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Section Name"\n"0","SpeedOfLight"\n')
    with pytest.raises(ValueError, match="Warp Stall Sampling"):
        ncu_stalls.load(str(path))
