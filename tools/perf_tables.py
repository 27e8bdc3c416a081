"""docs/PERF.md's tables, generated from the benchmark results in docs/perf/*.csv.

Each CSV holds one table: leading ``#`` lines are its caption (machine, date, method; printed
as a paragraph above the table), then a header row and the rows, numbers as the benchmark
printed them. In PERF.md a table stands between ``<!-- perf-table: NAME -->`` and
``<!-- /perf-table -->``, NAME being the CSV's stem; this tool rewrites those blocks and
nothing else, so the prose around them is edited by hand and the numbers only in the CSVs.

  python3 -m sparse_mla.tools.perf_tables            # rewrite docs/PERF.md's tables
  python3 -m sparse_mla.tools.perf_tables --check    # exit 1 naming every stale table
"""
from __future__ import annotations

import argparse
import csv
import io
import pathlib
import re
import sys

DOCS = pathlib.Path(__file__).parent.parent / "docs"
BLOCK = re.compile(r"<!-- perf-table: ([\w-]+) -->\n(.*?)<!-- /perf-table -->", re.S)
# A cell that is a number (or numbers split by " / "), maybe with a unit sign: right-aligned.
NUMERIC = re.compile(r"^[-—]$|^[\d.,]+(?:-[\d.,]+)?(?: ?[%×x])?(?: / [\d.,]+(?: ?[%×x])?)*$")


def read(path: pathlib.Path) -> tuple[list, list, list]:
    """(caption lines, header, rows) of one CSV."""
    lines = path.read_text(encoding="utf-8").splitlines()
    caption = [line[1:].strip() for line in lines if line.startswith("#")]
    table = list(csv.reader(io.StringIO("\n".join(
        line for line in lines if line.strip() and not line.startswith("#")))))
    if not table:
        raise ValueError(f"{path}: no header row")
    header, rows = table[0], table[1:]
    for i, row in enumerate(rows, 2):
        if len(row) != len(header):
            raise ValueError(f"{path}: row {i} has {len(row)} cells, the header {len(header)}")
    return caption, header, rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(path: pathlib.Path) -> str:
    """The markdown of one CSV: its caption paragraph, a blank line, the table."""
    caption, header, rows = read(path)
    right = [bool(rows) and all(NUMERIC.match(r[i]) or not r[i] for r in rows)
             for i in range(len(header))]
    out = [" ".join(caption), ""] if caption else []
    out.append("| " + " | ".join(_cell(h) for h in header) + " |")
    out.append("|" + "|".join("---:" if r else "---" for r in right) + "|")
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def update(text: str, perf_dir: pathlib.Path) -> str:
    """``text`` with every table block regenerated from ``perf_dir``."""
    def block(m):
        table = render(perf_dir / f"{m.group(1)}.csv")
        return f"<!-- perf-table: {m.group(1)} -->\n{table}<!-- /perf-table -->"
    return BLOCK.sub(block, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc", type=pathlib.Path, default=DOCS / "PERF.md",
                   help="the markdown file to rewrite (default: docs/PERF.md)")
    p.add_argument("--csv-dir", type=pathlib.Path, default=DOCS / "perf",
                   help="where the CSVs are (default: docs/perf)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if a table differs from its CSV")
    args = p.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    new = update(text, args.csv_dir)
    stale = [m.group(1) for m, n in zip(BLOCK.finditer(text), BLOCK.finditer(new))
             if m.group(0) != n.group(0)]
    if args.check:
        if stale:
            print(f"{args.doc}: stale tables: {', '.join(stale)} (run without --check)")
            return 1
    elif stale:
        args.doc.write_text(new, encoding="utf-8")
    print(f"{args.doc}: {len(BLOCK.findall(new))} tables, "
          f"{'rewritten: ' + ', '.join(stale) if stale and not args.check else 'current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
