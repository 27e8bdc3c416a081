"""Warp-stall samples of one kernel, from Nsight Compute's SASS source page, summarised.

  ncu --clock-control none --kernel-name sm90_kernel --launch-skip 2 --launch-count 1 \\
      --set full -o rep python3 <script that runs the op a few times>
  ncu -i rep.ncu-rep --page source --csv --print-source sass > source.csv
  python3 -m sparse_mla.lab.tools.ncu_stalls source.csv [--top 30]

Prints the stall reasons over the whole kernel, the samples per SASS opcode, and the
hottest instructions with their index, so a warp-specialized kernel's regions (producer
loop, consumer loop, epilogue: find them by their barriers) can be summed by index range
(``--range A:B`` prints one range's share). lab/perf-log.md ("Three kernel changes dropped") shows
a reading.
"""
from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"


def load(path):
    """(header, instruction rows) of a ``--page source --csv`` export."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for i, row in enumerate(rows):
        if SAMPLES in row:
            return row, [r for r in rows[i + 1:] if len(r) == len(row)]
    raise ValueError(f"{path}: no '{SAMPLES}' column (export with --page source --csv)")


def _num(text):
    return float(text.replace(",", "")) if text.strip() else 0.0


def opcode(sass):
    """'@!P2 SYNCS.ARRIVE.TRANS64.A1T0 RZ, ...' -> 'SYNCS'."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def summarize(header, rows, top=30, ranges=()):
    ix = {h: i for i, h in enumerate(header)}
    samples = [_num(r[ix[SAMPLES]]) for r in rows]
    total = sum(samples) or 1.0
    lines = [f"{len(rows)} instructions, {int(total)} samples"]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    by_reason = {h: sum(_num(r[ix[h]]) for r in rows) for h in reasons}
    lines.append("stall reasons:")
    lines += [f"  {h:28} {100 * v / total:5.1f}%"
              for h, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v]
    by_op = collections.Counter()
    for r, s in zip(rows, samples):
        by_op[opcode(r[ix["Source"]])] += s
    lines.append("samples per opcode:")
    lines += [f"  {op:14} {100 * v / total:5.1f}%" for op, v in by_op.most_common(15) if v]
    for a, b in ranges:
        lines.append(f"range [{a}, {b}): {100 * sum(samples[a:b]) / total:5.1f}%")
    lines.append("hottest instructions (index, share, executions, main reason, SASS):")
    hot = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
    for i in sorted(hot):
        r = rows[i]
        main = max(reasons, key=lambda h: _num(r[ix[h]])) if reasons else "-"
        executed = r[ix["Instructions Executed"]] if "Instructions Executed" in ix else "-"
        lines.append(f"  {i:5} {100 * samples[i] / total:5.1f}% "
                     f"{executed:>9}"
                     f" {main:22} {r[ix['Source']].strip()[:70]}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--range", action="append", default=[], metavar="A:B",
                   help="instruction index range [A, B) to total (repeatable)")
    args = p.parse_args(argv)
    ranges = [tuple(int(x) for x in r.split(":")) for r in args.range]
    header, rows = load(args.csv)
    print(summarize(header, rows, args.top, ranges))


if __name__ == "__main__":
    main()
