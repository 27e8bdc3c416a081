"""The split kernels' argument records.

Both split kernels (``portable._split_kernel``, ``sm90.kernel.sm90_kernel``) take q, each key
source, and each output as one tuple argument: Triton flattens a tuple into its scalar
parameters, in order, and specializes each element as it would a loose argument, so the
compiled kernel is the one the loose arguments made. ``RECORDS`` names every record's fields
(the kernels unpack them into these names); ``source`` and the other builders make the
records the launcher passes; ``signature`` gives compile-only tools (``sm90.variants``,
lab/tools/ptx_digest.py, tests/ops/test_arch_compile.py) the flattened signature a launch
would have.
"""
from __future__ import annotations

import inspect


def _source_fields(n):
    # cache pointer, its two strides, block size, block capacity; index list pointer, row
    # stride, width; lengths pointer and how a length maps to usable columns (semantics:
    # reference.KeySource.usable)
    return (f"c{n}_ptr", f"c{n}_s0", f"c{n}_s1", f"c{n}_bs", f"c{n}_cap", f"i{n}_ptr",
            f"i{n}_s0", f"K{n}", f"l{n}_ptr", f"l{n}_div", f"l{n}_off", f"l{n}_lag")


RECORDS = {
    "q": ("q_ptr", "q_s0", "q_s1", "H"),
    "src0": _source_fields(0),
    "src1": _source_fields(1),
    "scale": ("scale2", "scale_ptr"),            # float, or a device scalar (SCALE_T)
    "part": ("part_o", "part_ml"),
    "out": ("out_ptr", "out_s0", "out_s1"),
    "lse": ("lse_ptr", "lse_s0", "lse_s1"),
    "mx": ("mx_ptr", "mx_s0", "mx_s1"),
    "out_scale": ("out_scale", "out_scale_ptr"),  # float, or a device scalar (OUT_SCALE_T)
}


def takes_records(fn):
    """Mark a ``triton.jit`` / ``gluon.jit`` kernel whose parameters named in ``RECORDS`` are
    records (``signature`` types only those kernels' parameters field by field)."""
    fn.records = RECORDS
    return fn


def query(q, heads):
    return (q, q.stride(0), q.stride(1), heads)


def source(view, src, indices, k, lengths):
    """One key source's record: ``view`` = (cache tensor, stride0, stride1) as the kernels
    address it (``plan.cache_view``), ``src`` its KeySource (None: an absent second source,
    never read), ``lengths`` = (pointer, div, offset, lag) (``launch._length_args``)."""
    block_size, capacity = (src.block_size, src.capacity) if src is not None else (1, 0)
    return (*view, block_size, capacity, indices, indices.stride(0), k, *lengths)


def rows(t, dummy):
    """(pointer, stride0, stride1) of an optional [T, H] output; ``dummy`` where it is absent
    (never written)."""
    return (t, t.stride(0), t.stride(1)) if t is not None else (dummy, 0, 0)


def signature(fn, constexprs, pointers, floats=(), divisible=()):
    """(signature, constexprs by path, attrs) for compiling ``fn`` (a ``triton.jit`` or
    ``gluon.jit`` function; its records if ``takes_records`` marked it) without launching it:
    ``constexprs`` by parameter name, ``pointers`` / ``floats`` / ``divisible`` by field name
    (a record's fields, or a loose parameter's own name). Integers are i32; pointers and
    ``divisible`` fields are marked 16-byte divisible, as the JIT marks the production
    arguments."""
    names = list(inspect.signature(fn.fn).parameters)
    recs = getattr(fn, "records", {})

    def leaf(name):
        return pointers.get(name, "fp32" if name in floats else "i32")

    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in recs:
            sig[n] = tuple(leaf(f) for f in recs[n])
            for j, f in enumerate(recs[n]):
                if f in pointers or f in divisible:
                    attrs[(i, j)] = [["tt.divisibility", 16]]
        else:
            sig[n] = leaf(n)
            if n in pointers or n in divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, {(names.index(k),): v for k, v in constexprs.items()}, attrs
