"""lab/tools/ptx_digest.py's comparison: lost variants fail unless dropped on purpose, and a
renamed kernel digests as its old name (nothing compiled here)."""
from sparse_mla.lab.tools import ptx_digest


def _write(path, rows):
    path.write_text("# triton x\n" + "".join(f"{n} {d}\n" for n, d in rows.items()))
    return str(path)


def test_a_lost_variant_fails_unless_dropped(tmp_path, capsys):
    before = _write(tmp_path / "a.txt", {"sm90/v4": "aa", "sm90/v4_gone": "bb"})
    after = _write(tmp_path / "b.txt", {"sm90/v4": "aa", "sm90/v4_new": "cc"})
    assert ptx_digest.compare(before, after) == 1
    assert ptx_digest.compare(before, after, dropped="_gone$") == 0
    assert "dropped on purpose" in capsys.readouterr().out
    assert ptx_digest.compare(before, after, dropped="_other$") == 1


def test_a_changed_digest_fails_even_with_dropped(tmp_path):
    before = _write(tmp_path / "a.txt", {"sm90/v4": "aa"})
    after = _write(tmp_path / "b.txt", {"sm90/v4": "ab"})
    assert ptx_digest.compare(before, after, dropped=".*") == 1


def test_rename_maps_the_entry_and_its_params_only(monkeypatch):
    ptx = (".visible .entry sm90_kernel(\n\t.param .u64 sm90_kernel_param_0\n)\n"
           "\tld.param.u64 %rd1, [sm90_kernel_param_0];\n\tcall my_sm90_kernel_helper;\n")

    class Built:
        asm = {"ptx": ptx}
    monkeypatch.setattr(ptx_digest, "variants", lambda: {"sm90/x": lambda: Built()})
    monkeypatch.setattr(ptx_digest, "strip_debug", lambda text: text)
    renamed = dict(ptx_digest.digests(renames=[("sm90_kernel", "_ws_kernel")]))
    plain = dict(ptx_digest.digests())
    assert renamed != plain
    # the same PTX written with the old name (a helper merely containing it keeps its name)
    Built.asm = {"ptx": ".visible .entry _ws_kernel(\n\t.param .u64 _ws_kernel_param_0\n)\n"
                        "\tld.param.u64 %rd1, [_ws_kernel_param_0];\n"
                        "\tcall my_sm90_kernel_helper;\n"}
    assert dict(ptx_digest.digests()) == renamed
