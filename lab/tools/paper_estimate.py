"""Paper estimates of the decode time on GPUs not lent here (A100, RTX 3090 / 4090 / 5090),
from a ``bench_flashmla --soft`` run on a Hopper.

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.lab.tools.paper_estimate RUN.txt

For each decode row of the run: the row's bytes and FLOPs (the bench case's own accounting)
give a roofline floor on each card, max(bytes / bandwidth, FLOPs / bf16 rate), from the card's
published numbers (``CARDS``). The estimate divides that floor by the efficiency the same
route reached on the measured Hopper: its time there against that run's measured copy
bandwidth and matmul rate (the same max). Cards below sm_89 take the software e4m3 route
("soft µs" column), the others the portable kernel with hardware e4m3 ("portable µs"). It
assumes the kernel keeps that efficiency on the other card — it ignores shared memory per SM
(99-163 KB there against 227 KB), register spills (tests/ops/test_arch_compile.py) and SM count.
An estimate, not a measurement: no such card is lent here.
"""
from __future__ import annotations

import argparse
import re

from sparse_mla.ops.flashmla_decode import bench

# name: (arch, memory bandwidth GB/s, dense bf16 tensor TFLOP/s with fp32 accumulation), as
# published: NVIDIA A100 datasheet (80 GB SXM), GeForce RTX 3090 (GA102 whitepaper), RTX 4090
# (Ada whitepaper), RTX 5090 (Blackwell GeForce whitepaper)
CARDS = {
    "A100 80GB SXM": (80, 2039, 312.0),
    "RTX 3090": (86, 936, 71.0),
    "RTX 4090": (89, 1008, 165.2),
    "RTX 5090": (120, 1792, 209.5),
}
_HEADER = re.compile(r"copy ([\d,]+) GB/s, matmul ([\d,]+) TFLOP/s")


def _number(text):
    return float(text.replace(",", ""))


def read_run(path):
    """(copy GB/s, matmul TFLOP/s, {shape: {column: value}}) of a bench_flashmla output."""
    lines = open(path, encoding="utf-8").read().splitlines()
    copy = mm = None
    rows, head = {}, None
    for line in lines:
        m = _HEADER.search(line)
        if m:
            copy, mm = _number(m.group(1)), _number(m.group(2))
            continue
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0] == "shape":
            head = cells
        elif head and len(cells) == len(head):
            rows[cells[0]] = dict(zip(head, cells))
    if copy is None or head is None or "soft µs" not in head:
        raise ValueError(f"{path}: not a bench_flashmla --soft run (header or soft column "
                         "missing)")
    return copy, mm, rows


def estimates(path):
    copy, mm, rows = read_run(path)
    out = []
    for case in bench.cases("cpu", False):
        row = rows.get(case.shape)
        if row is None or "prefill" in case.op:
            continue
        floor_here = max(case.bytes / (copy * 1e9), case.flops / (mm * 1e12))
        line = {"shape": case.shape}
        for card, (arch, bw, rate) in CARDS.items():
            measured = _number(row["soft µs" if arch < 89 else "portable µs"]) * 1e-6
            floor = max(case.bytes / (bw * 1e9), case.flops / (rate * 1e12))
            line[card] = floor / (floor_here / measured) * 1e6
        out.append(line)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="the output of bench_flashmla --decode --soft")
    args = p.parse_args(argv)
    table = estimates(args.run)
    cols = ["shape"] + list(CARDS)
    print("| " + " | ".join(c if c == "shape" else f"{c} µs (est.)" for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for line in table:
        print("| " + " | ".join(line["shape"] if c == "shape" else f"{line[c]:.0f}"
                                for c in cols) + " |")


if __name__ == "__main__":
    main()
