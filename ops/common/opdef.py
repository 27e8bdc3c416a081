"""``custom_op``: ``torch.library.custom_op`` in the ``sparse_mla::`` namespace, documented, with
every op's tensor arguments brought to the strides its kernels read (one path for all ops).

``torch.library.custom_op`` returns a ``CustomOpDef`` object, and ``help()`` on it shows
torch's generic ``CustomOpDef`` class text. This decorator gives each op object its own
``__doc__`` (the op's signature, then the function's docstring) and ``__signature__``, so
``help(op)`` and ``inspect.signature(op)`` describe the op itself.

Strides (docs/semantics.md §1, "Strides"). The kernels address every tensor as rows: a base
pointer, ``stride(0)`` between rows (a cache's block stride, a padded q row), and every other
dimension packed. Any other view would be read as if it were packed, with other tokens' values
(Triton inserts read a strided ``positions`` that way and rotated with the wrong angles). So
before an op validates or runs, :func:`_normalize` turns each tensor argument into that form:

* an argument the op only reads is copied (``contiguous()``) when it is not in row form: small
  lists and per-token inputs; a cache that is only read is in row form whenever its blocks
  are, so no cache is ever copied;
* an argument the op writes cannot be copied (the caller's tensor must receive the bytes), so
  one that is not in row form is refused with a ValueError naming it, before anything is
  written.

The fake (meta) implementation sees the same arguments, so torch.compile traces accept and
refuse exactly what eager calls do. tests/ops/test_stride_fuzz.py holds every registered op to
this: a non-contiguous view of any argument gives the contiguous call's bytes, or the error.
"""
from __future__ import annotations

import functools
import inspect

import torch

NAMESPACE = "sparse_mla"


def in_row_form(t: torch.Tensor) -> bool:
    """Whether the kernels can read ``t`` through its base pointer and ``stride(0)`` alone:
    1-D with unit stride; or rows of packed inner dimensions, ``stride(0)`` at least a row's
    extent (rows may be padded, never overlap). Sizes 0 and 1 make any stride harmless."""
    if t.dim() == 0 or t.numel() <= 1:
        return True
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    if t.dim() == 1:
        return t.stride(0) == 1
    return t.shape[0] == 1 or t.stride(0) >= expected


def _row_form_error(op: str, name: str, t: torch.Tensor) -> ValueError:
    return ValueError(
        f"{op}: {name} is written by the op, so it must be rows of packed elements (every "
        f"dimension but the first contiguous, stride(0) >= one row, no overlap); got shape "
        f"{list(t.shape)} with strides {t.stride()}. Pass a tensor in that form (a padded "
        f"block or row stride is fine), or copy into it afterwards")


def _normalizer(op: str, fn, mutates_args):
    """``fn`` with its tensor arguments in row form (module docstring): read-only ones
    copied where needed, written ones refused by name where not."""
    names = list(inspect.signature(fn).parameters)
    written = set(mutates_args)
    unknown = written - set(names)
    if unknown:
        raise ValueError(f"{op}: mutates_args names {sorted(unknown)}, not parameters of "
                         f"{fn.__name__}")

    def normalize(name, value):
        if not isinstance(value, torch.Tensor) or in_row_form(value):
            return value
        if name in written:
            raise _row_form_error(op, name, value)
        return value.contiguous()

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args = tuple(normalize(n, a) for n, a in zip(names, args))
        kwargs = {n: normalize(n, a) for n, a in kwargs.items()}
        return fn(*args, **kwargs)
    return wrapped


def custom_op(name: str, *, mutates_args):
    """``@custom_op("sparse_mla::x", mutates_args=(...))`` on a function, as torch's decorator;
    the function and the fake implementation registered on the op (``register_fake``) see
    their tensor arguments in row form (module docstring)."""
    if not name.startswith(NAMESPACE + "::"):
        raise ValueError(f"op name must start with '{NAMESPACE}::', got {name!r}")

    def wrap(fn):
        # the schema comes from ``fn`` itself: its annotations resolve in its own module
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        op = torch.library.custom_op(name, _normalizer(name, fn, mutates_args),
                                     mutates_args=mutates_args, schema=schema)
        register_fake = op.register_fake

        def register_normalized_fake(fake_fn):
            register_fake(_normalizer(name, fake_fn, mutates_args))
            return fake_fn
        op.register_fake = register_normalized_fake
        sig = inspect.signature(fn)
        op.__signature__ = sig
        op.__doc__ = (f"{name}{sig}\n\n{inspect.cleandoc(fn.__doc__ or '')}\n\n"
                      f"Also callable as torch.ops.{name.replace('::', '.')}; a torch.library "
                      f"custom op (CustomOpDef).")
        return op
    return wrap
