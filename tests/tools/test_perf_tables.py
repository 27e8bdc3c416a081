"""docs/PERF.md's tables equal tools/perf_tables.py's rendering of docs/perf/*.csv, every CSV
is used once, no table stands outside a generated block, and the docs keep their size limits
and stay free of work-log material."""
from __future__ import annotations

import pathlib
import re

import pytest

import sparse_mla
from sparse_mla.tools import perf_tables

DOCS = pathlib.Path(sparse_mla.__file__).parent / "docs"
PERF = DOCS / "PERF.md"


def test_perf_tables_equal_their_csvs():
    text = PERF.read_text(encoding="utf-8")
    assert perf_tables.update(text, DOCS / "perf") == text, (
        "docs/PERF.md's tables differ from docs/perf/*.csv: run "
        "python3 -m sparse_mla.tools.perf_tables")


def test_every_csv_is_one_block_and_every_table_is_generated():
    text = PERF.read_text(encoding="utf-8")
    names = [m.group(1) for m in perf_tables.BLOCK.finditer(text)]
    assert sorted(names) == sorted(p.stem for p in (DOCS / "perf").glob("*.csv"))
    assert len(names) == len(set(names))
    outside = perf_tables.BLOCK.sub("", text)
    assert not re.search(r"^\|", outside, re.M), "a table in PERF.md not generated from a CSV"


def test_sizes():
    assert PERF.stat().st_size <= 15_000
    docs = [p for p in DOCS.rglob("*") if p.is_file() and p.suffix in (".md", ".csv")]
    assert sum(p.stat().st_size for p in docs) <= 150_000


def test_perf_md_is_for_users():
    text = PERF.read_text(encoding="utf-8")
    for pattern in (r"[Ii]ssue \d", r"Session \d", r"\btree [0-9a-f]{7}", r"\b[0-9a-f]{7}\b"):
        assert not re.search(pattern, text), f"work-log material in PERF.md: {pattern}"


def test_render_aligns_numbers_and_escapes_pipes(tmp_path):
    (tmp_path / "t.csv").write_text(
        "# Machine X,\n# date.\nshape,µs,note\n"
        "\"b 2, h 64\",\"1,234.5\",a | b\nb 64,12.0 / 3.4,—\n", encoding="utf-8")
    assert perf_tables.render(tmp_path / "t.csv") == (
        "Machine X, date.\n\n| shape | µs | note |\n|---|---:|---|\n"
        "| b 2, h 64 | 1,234.5 | a \\| b |\n| b 64 | 12.0 / 3.4 | — |\n")


def test_check_names_a_stale_table_and_rewrite_fixes_it(tmp_path, capsys):
    (tmp_path / "t.csv").write_text("a,b\n1,2\n", encoding="utf-8")
    doc = tmp_path / "P.md"
    doc.write_text("x\n<!-- perf-table: t -->\n| old |\n<!-- /perf-table -->\ny\n",
                   encoding="utf-8")
    argv = ["--doc", str(doc), "--csv-dir", str(tmp_path)]
    assert perf_tables.main(argv + ["--check"]) == 1
    assert "stale tables: t" in capsys.readouterr().out
    assert perf_tables.main(argv) == 0
    assert "rewritten: t" in capsys.readouterr().out
    assert doc.read_text(encoding="utf-8") == (
        "x\n<!-- perf-table: t -->\n| a | b |\n|---:|---:|\n| 1 | 2 |\n<!-- /perf-table -->\ny\n")
    assert perf_tables.main(argv + ["--check"]) == 0


def test_a_ragged_row_is_refused(tmp_path):
    (tmp_path / "t.csv").write_text("a,b\n1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="row 2 has 1 cells"):
        perf_tables.read(tmp_path / "t.csv")
