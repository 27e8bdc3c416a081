"""A digest of the PTX of every launch variant of the attention core, compiled on this machine
(no GPU: Triton compiles for a target architecture), with the debug-line noise stripped.

  PYTHONPATH=$(bash tools/pyroot.sh) python3 lab/tools/ptx_digest.py [--out FILE] \\
      [--save-ptx DIR] [--only REGEX] [--rename NEW=OLD ...]
  python3 lab/tools/ptx_digest.py --compare BEFORE AFTER [--dropped REGEX]

Moving a kernel to another file changes its ``.loc`` / ``.file`` directives and debug
sections, not its instructions; this strips them, so two trees (say before and after a
refactor) compare by instructions alone. Run as a file, the script imports the attention core
from whatever checkout PYTHONPATH makes importable as ``sparse_mla``, in the package layout of
either side of the move to ``ops/attention`` (``MODULES``). The variants:

* the sm_90 Gluon kernel: every variant of ``sm90/variants.py`` (what the launcher can pick);
* the portable split kernel for each cache format at sm_80, 86, 89, 90, 100 and 120 in the
  general launch shape, and the fp16-operand and tiny (output-dim split, one-tile and looped)
  shapes at sm_80, 90 and 120;
* the combine kernel with bf16 and fp32 partials at sm_80 and sm_90;
* the software-e4m3 route (``SOFT``, what sm_80 / sm_86 run) of the split kernel for each
  e4m3 cache format at sm_80 and sm_90 (named ``..._soft_...``; absent from a tree older than
  that route: ``--compare`` lists variants only the AFTER file has, and fails only on variants
  it lost).

Each run compiles into a fresh Triton cache (``TRITON_CACHE_DIR``), so a kernel is never
taken from a cache filled by the other tree. ``--compare`` prints the variants whose digests
differ (and exits 1 if any does, or if AFTER lost a variant). ``--dropped REGEX``: variants of
BEFORE whose name matches were removed from the code on purpose; their loss is listed, not
failed.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import os
import re
import sys
import tempfile

# (new layout, old layout) of each module the script compiles from
MODULES = {
    "portable": ("sparse_mla.ops.attention.portable",
                 "sparse_mla.ops.common.sparse_attention_portable"),
    "sm90_variants": ("sparse_mla.ops.attention.sm90.variants",
                      "sparse_mla.ops.common.sm90_variants"),
}
FMT_CODES = {"v4": 0, "v32": 1, "plain_bf16": 2, "plain_fp8": 3}
ARCHS = (80, 86, 89, 90, 100, 120)
FEW_ARCHS = (80, 90, 120)
DIVISIBLE = {"q_s0", "q_s1", "c0_s0", "c1_s0", "c0_s1", "c1_s1", "c0_bs", "c1_bs", "i0_s0",
             "i1_s0", "K0", "K1", "out_s0", "out_s1"}


def load(name):
    """The module ``name`` of ``MODULES`` from whichever layout the checkout has."""
    errors = []
    for path in MODULES[name]:
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError as exc:
            errors.append(str(exc))
    raise ModuleNotFoundError(f"{name}: none of {MODULES[name]} imports ({errors})")


def strip_debug(ptx: str) -> str:
    """PTX without what a file move changes: ``.loc`` / ``.file`` directives, the debug
    sections, the labels only line info refers to, and comment lines."""
    out, skip = [], False
    for line in ptx.splitlines():
        s = line.strip()
        if skip:
            skip = s != "}"
            continue
        if s.startswith(".section") and ".debug" in s:
            skip = not s.endswith("}")
            continue
        if (s.startswith((".loc", ".file", "//")) or re.fullmatch(r"\$L__(tmp|func_\w+)\d*:", s)
                or not s):
            continue
        out.append(line.rstrip())
    return "\n".join(out) + "\n"


def _compile(fn, constexprs, pointers, floats, arch, options, source_cls=None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(inspect.signature(fn.fn).parameters)
    # constexprs the caller leaves out take their defaults (``SOFT``: the hardware route); one
    # the kernel lacks (``SOFT`` in an older tree) fails the variant
    constexprs = dict(constexprs)
    for p in fn.params:
        if p.is_constexpr and p.has_default and p.name not in constexprs:
            constexprs[p.name] = p.default
        # run-time parameters defaulting to None are constexpr None where the variant leaves
        # them out, as the JIT makes them
        if not p.is_constexpr and p.has_default and p.default is None \
                and p.name not in pointers:
            constexprs[p.name] = None
    try:    # a tree with argument records (ops/attention/records.py)
        from sparse_mla.ops.attention import records
    except ModuleNotFoundError:
        records = None
    if records is not None:
        sig, by_path, attrs = records.signature(fn, constexprs, pointers, floats, DIVISIBLE)
    else:   # an older tree: loose arguments only
        sig = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n in floats
                                                                    else "i32")
               for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if n in pointers or n in DIVISIBLE}
        by_path = {(names.index(k),): v for k, v in constexprs.items()}
    src = (source_cls or ASTSource)(fn, sig, constexprs=by_path, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _split(fmt, arch, *, f16=False, tiny=False, one_tile=False, soft=False):
    kernels = load("portable")
    pointers = {"q_ptr": "*fp16" if f16 else "*bf16", "i0_ptr": "*i32", "i1_ptr": "*i32",
                "l0_ptr": "*i32", "l1_ptr": "*i32", "part_o": "*fp32", "part_ml": "*fp32",
                "scale_ptr": "*fp32"}
    pointers["c0_ptr"] = pointers["c1_ptr"] = "*bf16" if fmt == "plain_bf16" else "*u8"
    dv = 2 if tiny else 1
    cx = dict(FMT=FMT_CODES[fmt], HAS_L0=True, HAS_L1=True, HAS_SRC1=True, Q_FP8=False,
              HB=64 if arch == 90 or not tiny else 16, BN=32 if tiny else 64,
              D576=fmt == "v32", TRACK_MAX=False, PREFETCH=True, DV=dv, N_UNITS=2 * dv,
              SCALE64=fmt == "v4", SCALE_T=False, DOT_F32=False, PDL=arch >= 90, F16=f16,
              ONE_TILE=one_tile, FMT1=-1)
    if soft:
        cx["SOFT"] = True
    stages = 1 if tiny else (3 if fmt == "v32" else 2)
    return _compile(kernels._split_kernel, cx, pointers, {"scale2"}, arch,
                    {"num_warps": 8 // dv, "num_stages": stages})


def _combine(arch, bf16):
    kernels = load("portable")
    pointers = {"part_o": "*i16" if bf16 else "*fp32", "part_ml": "*fp32", "sink_ptr": "*fp32",
                "out_ptr": "*bf16", "lse_ptr": "*fp32", "mx_ptr": "*fp32",
                "out_scale_ptr": "*fp32"}
    cx = dict(OUT_SCALE_T=False, HAS_SINK=True, HAS_LSE=True, HAS_MAX=True, SPLITS=8,
              SOFT=False, PDL=arch >= 90)
    return _compile(kernels._combine_kernel, cx, pointers, {"out_scale"}, arch,
                    {"num_warps": 2 if bf16 else 4})


def variants():
    """{name: zero-argument compile function} of every variant, in a fixed order."""
    out = {}
    sm90 = load("sm90_variants")
    for name in sm90.VARIANTS:
        out[f"sm90/{name}"] = lambda name=name: sm90.compile_variant(name)
    for fmt in FMT_CODES:
        for arch in ARCHS:
            out[f"portable/split_{fmt}_sm{arch}"] = (
                lambda fmt=fmt, arch=arch: _split(fmt, arch))
    for arch in FEW_ARCHS:
        out[f"portable/split_plain_fp8_f16_sm{arch}"] = (
            lambda arch=arch: _split("plain_fp8", arch, f16=True))
        for one_tile in (False, True):
            out[f"portable/tiny_v4_{'one_tile' if one_tile else 'loop'}_sm{arch}"] = (
                lambda arch=arch, one_tile=one_tile: _split("v4", arch, tiny=True,
                                                            one_tile=one_tile))
    for fmt in ("v4", "v32", "plain_fp8"):
        for arch in (80, 90):
            out[f"portable/split_{fmt}_soft_sm{arch}"] = (
                lambda fmt=fmt, arch=arch: _split(fmt, arch, soft=True))
    for arch in (80, 90):
        for bf16 in (True, False):
            out[f"portable/combine_{'bf16' if bf16 else 'fp32'}_sm{arch}"] = (
                lambda arch=arch, bf16=bf16: _combine(arch, bf16))
    return out


def digests(only=None, save_ptx=None, renames=()):
    """[(variant, sha256 of its stripped PTX, or "error: ...")] of every variant.
    ``renames``: (new, old) kernel names; the PTX's ``new`` (its ``.entry`` and the
    ``new_param_N`` names derived from it) is written ``old`` before the digest, so a tree
    that renamed a kernel compares by instructions with one from before the rename."""
    rows = []
    for name, build in variants().items():
        if only and not re.search(only, name):
            continue
        try:
            ptx = strip_debug(build().asm["ptx"])
            for new, old in renames:
                ptx = re.sub(rf"\b{re.escape(new)}(?=\b|_param_)", old, ptx)
            digest = hashlib.sha256(ptx.encode()).hexdigest()
            if save_ptx:
                path = os.path.join(save_ptx, name.replace("/", "__") + ".ptx")
                os.makedirs(save_ptx, exist_ok=True)
                with open(path, "w") as f:
                    f.write(ptx)
        except Exception as exc:    # recorded: the other tree must fail the same way
            digest = f"error: {type(exc).__name__}"
        rows.append((name, digest))
        print(f"{name} {digest}", file=sys.stderr, flush=True)
    return rows


def read(path):
    with open(path) as f:
        lines = [line.split() for line in f if line.strip() and not line.startswith("#")]
    return {parts[0]: " ".join(parts[1:]) for parts in lines}


def compare(before, after, dropped=None) -> int:
    a, b = read(before), read(after)
    bad = 0
    lost, new = [n for n in a if n not in b], [n for n in b if n not in a]
    if dropped:
        gone = [n for n in lost if re.search(dropped, n)]
        lost = [n for n in lost if n not in gone]
        if gone:
            print(f"variants only BEFORE has, dropped on purpose (--dropped): {gone}")
    if lost:
        print(f"variants only BEFORE has (lost): {lost}")
        bad = 1
    if new:
        print(f"variants only AFTER has (new, not compared): {new}")
    diff = [n for n in a if n in b and a[n] != b[n]]
    for n in diff:
        print(f"DIFFERS {n}: {a[n]} -> {b[n]}")
    errors = [n for n in b if b[n].startswith("error")]
    print(f"{len(set(a) & set(b))} variants compared, {len(diff)} differ; "
          f"{len(errors)} failed to compile in both trees alike: {errors}")
    return 1 if bad or diff else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="write the digests here (default: stdout)")
    p.add_argument("--save-ptx", help="also write each variant's stripped PTX into this folder")
    p.add_argument("--only", help="only the variants whose name matches this regex")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="compare two digest files instead")
    p.add_argument("--rename", action="append", default=[], metavar="NEW=OLD",
                   help="digest kernel NEW's PTX under its old name OLD (a renamed kernel)")
    p.add_argument("--dropped", help="with --compare: variants matching this regex may be "
                   "missing from AFTER (removed on purpose)")
    a = p.parse_args(argv)
    if a.compare:
        return compare(*a.compare, dropped=a.dropped)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ptx_digest_cache_")
    import triton
    rows = digests(a.only, a.save_ptx, [tuple(r.split("=", 1)) for r in a.rename])
    text = f"# triton {triton.__version__}\n" + "".join(f"{n} {d}\n" for n, d in rows)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
