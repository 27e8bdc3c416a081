"""sparse_mla — run every op's implementations on DeepSeek-V4-shaped inputs and print a table.

For each op that exists, each implementation that can run on this machine (vendor, triton,
reference) runs on random inputs sized to the device (small on CPU, production sizes on a GPU),
is compared with the reference, and is timed: "graph µs" replays the op captured in a CUDA
graph (its GPU time in a captured decode step; throughput and % roofline use it when present),
"eager µs" includes Python, validation and launch overhead. Bandwidth and FLOP rates are shown
next to the card's own copy bandwidth and matmul rate, measured in the same run. Then the
model section (``--no-model`` skips it): a small random-weight HF transformers DeepSeek-V4
generates greedily with eager attention and with ``attn_implementation="sparse_mla"`` (same
tokens required) and prints both times per token.

  bazel run //tools:sparse_mla                    # all ops, auto device
  bazel run //tools:sparse_mla -- --ops cache_insert --impls triton
  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.tools.cli   # without Bazel
"""
from __future__ import annotations

import argparse
import importlib
import sys

import torch

from sparse_mla.ops.common.dispatch import IMPLS, OPS_BY_FAMILY
from sparse_mla.ops.common.errors import ImplementationUnavailable
from sparse_mla.tools import harness

FAMILIES = tuple(OPS_BY_FAMILY)
# Vendor routes whose row is not the vendor kernel as an engine runs it, and why: printed under
# the table, and the rows' impl says so
VENDOR_CAVEATS = {
    "flashmla_sparse_decode": (
        "vendor (op route: planner, checks, copy per call)",
        "the op is stateless, so its FlashMLA route runs FlashMLA's scheduler (a separate "
        "launch), sanitises the index lists and lengths (two launches) and copies FlashMLA's "
        "output and lse into the op's on every call (heads below 64 also pad q and the sinks); "
        "vLLM plans once per step per layer kind and hands FlashMLA's output on as it is. "
        "tools/bench_flashmla.py times FlashMLA called directly with its metadata reused (the "
        "fair column)."),
    "flashmla_sparse_prefill": (
        "vendor (op route: copy per call)",
        "the op's FlashMLA route copies FlashMLA's output, max logits and lse into the op's "
        "tensors (an estimated 6 % of the call at 4,096 tokens x 128 heads, from its bytes); "
        "an engine calling FlashMLA directly keeps FlashMLA's own."),
}


def _load_families(names):
    mods = []
    for name in names:
        try:
            mods.append((name, importlib.import_module(f"sparse_mla.ops.{name}.bench")))
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith(f"sparse_mla.ops.{name}"):
                continue                        # this op family does not exist yet
            raise
    return mods


def _where_differs(ref, out):
    """Which outputs differ from the reference, bytewise, and where (first flat byte
    offsets): enough to tell a kernel's mismatch from a reference that is not reproducible
    (the reference row is checked against a second reference run)."""
    parts = []
    for k, (r, o) in enumerate(zip(ref, out)):
        r8 = r.detach().reshape(-1).contiguous().view(torch.uint8)
        o8 = o.detach().reshape(-1).contiguous().view(torch.uint8)
        bad = (r8 != o8).nonzero().flatten()
        if len(bad):
            parts.append(f"output {k} ({r.dtype}, {list(r.shape)}): {len(bad)} bytes differ, "
                         f"first at byte offsets {bad[:6].tolist()}")
    return "; ".join(parts) or "no byte differs (outside tolerance by value)"


def _fresh(case):
    """The same inputs every time: each implementation sees exactly the reference's data."""
    torch.manual_seed(20261122)
    return case.make()


def run(args) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU, and torch sees none here "
                         "(--device cpu runs on the CPU)")
    small = args.small if args.small is not None else device == "cpu"
    print(f"device: {harness.device_name(device)}   torch {torch.__version__}", flush=True)
    copy_bw = harness.copy_bandwidth(device)
    mm = harness.matmul_rate(device)
    print(f"roofline (measured now): copy {copy_bw / 1e9:,.0f} GB/s (read+write), "
          f"matmul {mm / 1e12:,.1f} TFLOP/s", flush=True)
    rows = []
    failures = 0
    for _family, mod in _load_families(args.ops or FAMILIES):
        for case in mod.cases(device, small):
            ref_out = None
            if case.reference:
                inputs = _fresh(case)
                ref_out = [t.clone() for t in case.run(inputs, "reference")]
            for impl in args.impls:
                inputs = _fresh(case)
                try:
                    out = case.run(inputs, impl)
                except ImplementationUnavailable as exc:   # cannot run here: say why in full
                    rows.append((case.op, impl, case.shape, "-", "-", "-", "-",
                                 "n/a: " + exc.reason))
                    continue
                err = "-" if ref_out is None else case.compare(ref_out, out)
                if ref_out is not None and err > case.tolerance:
                    failures += 1
                    print(f"  {case.op} {impl} {case.shape} differs: "
                          f"{_where_differs(ref_out, out)}", file=sys.stderr, flush=True)
                def call(case=case, inputs=inputs, impl=impl):
                    return case.run(inputs, impl)
                eager = harness.time_fn(call, device)
                graph = harness.time_graph(call) \
                    if device == "cuda" and impl != "reference" else None
                t = graph or eager
                gbs = case.bytes / t
                rate = f"{gbs / 1e9:,.1f} GB/s"
                pct = f"{100 * gbs / copy_bw:.0f}% copy"
                if case.flops:
                    rate += f", {case.flops / t / 1e12:.1f} TFLOP/s"
                    pct += f", {100 * case.flops / t / mm:.0f}% mm"
                label = VENDOR_CAVEATS[case.op][0] if (
                    impl == "vendor" and case.op in VENDOR_CAVEATS) else impl
                rows.append((case.op, label, case.shape,
                             "-" if graph is None else f"{graph * 1e6:,.1f}",
                             f"{eager * 1e6:,.1f}", rate, pct,
                             "not checked" if ref_out is None else f"{err} {case.error_unit}"))
            print(f"  done {case.op} {case.shape}", file=sys.stderr, flush=True)
    head = ("op", "impl", "shape", "graph µs", "eager µs", "throughput", "% roofline",
            "vs reference")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths))  # noqa: E731
    print(line(head))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))
    for op, (label, why) in VENDOR_CAVEATS.items():
        if any(r[0] == op and r[1] == label for r in rows):
            print(f"{op} {label}: {why}")
    if failures:
        print(f"{failures} result(s) differ from the reference", file=sys.stderr)
    if args.model and not _model_section(device):
        failures += 1
    return 1 if failures else 0


def _model_section(device) -> bool:
    """HF transformers DeepSeek-V4: the same greedy tokens with sparse_mla as with eager
    (integration/transformers/main_job.py)."""
    from sparse_mla.integration.transformers import main_job
    same = main_job.run(device)
    if not same:
        print("the model generated different tokens with sparse_mla", file=sys.stderr)
    return same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="sparse_mla", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument("--ops", nargs="+", choices=FAMILIES, help="op families (default: all)")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help="implementations to run (default: all that can run)")
    p.add_argument("--no-model", dest="model", action="store_false",
                   help="skip the model section (HF transformers DeepSeek-V4, eager vs "
                        "sparse_mla greedy tokens and ms/token)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--small", dest="small", action="store_true", default=None,
                      help="tiny shapes (default on CPU)")
    size.add_argument("--full", dest="small", action="store_false",
                      help="production shapes (default on a GPU)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
