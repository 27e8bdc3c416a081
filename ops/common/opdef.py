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

* an argument the op only reads is copied (``contiguous()``) when it is not in row form: index
  lists, positions, slot maps, per-token inputs;
* an argument the op writes cannot be copied (the caller's tensor must receive the bytes), and
  a cache the op reads (named in ``caches=``) is not copied either (a copy would cost the
  whole cache on every call, silently): one that is not in row form is refused with a
  ValueError naming it, before anything is written;
* an argument named in ``strided=`` is one whose every stride the kernels take (a plain cache
  with padded token rows, FlashMLA's transposed ``lse``): it goes to the op as given, and the
  op's own checks refuse, by name, what its kernels cannot address.

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


# ``{op: names}``: the arguments each op takes as given, never copied (``custom_op``'s
# ``mutates_args``, ``caches`` and ``strided``); the stride fuzz reads it to know which may be
# refused. Its keys are every op made here.
AS_GIVEN: dict = {}


def _row_form_error(op: str, name: str, t: torch.Tensor, why: str) -> ValueError:
    return ValueError(
        f"{op}: {name} {why}, so it must be rows of packed elements (every dimension but "
        f"the first contiguous, stride(0) >= one row, no overlap); got shape "
        f"{list(t.shape)} with strides {t.stride()}. A padded block or row stride is fine")


def _normalizer(op: str, fn, mutates_args, caches, strided):
    """``fn`` with its tensor arguments in row form (module docstring): read-only ones
    copied where needed, written ones and caches refused by name where not, ``strided`` ones
    as given."""
    names = list(inspect.signature(fn).parameters)
    why = {**{n: "is a cache the op reads in place (a copy would cost the whole cache)"
              for n in caches},
           **{n: "is written by the op" for n in mutates_args}}
    unknown = (set(why) | set(strided)) - set(names)
    if unknown:
        raise ValueError(f"{op}: mutates_args / caches / strided name {sorted(unknown)}, not "
                         f"parameters of {fn.__name__}")
    as_given = frozenset(strided)

    def normalize(name, value):
        if not isinstance(value, torch.Tensor) or name in as_given or in_row_form(value):
            return value
        if name in why:
            raise _row_form_error(op, name, value, why[name])
        return value.contiguous()

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args = tuple(normalize(n, a) for n, a in zip(names, args))
        kwargs = {n: normalize(n, a) for n, a in kwargs.items()}
        return fn(*args, **kwargs)
    return wrapped


def custom_op(name: str, *, mutates_args, caches=(), strided=()):
    """``@custom_op("sparse_mla::x", mutates_args=(...), caches=(...), strided=(...))`` on a
    function, as torch's decorator; the function and the fake implementation registered on
    the op (``register_fake``) see their tensor arguments in row form (module docstring).
    ``caches``: the read-only cache arguments, never copied; ``strided``: arguments whose
    every stride the kernels take, passed as given."""
    if not name.startswith(NAMESPACE + "::"):
        raise ValueError(f"op name must start with '{NAMESPACE}::', got {name!r}")
    AS_GIVEN[name.removeprefix(NAMESPACE + "::")] = (
        frozenset(mutates_args) | frozenset(caches) | frozenset(strided))

    def wrap(fn):
        # the schema comes from ``fn`` itself: its annotations resolve in its own module
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        op = torch.library.custom_op(name, _normalizer(name, fn, mutates_args, caches, strided),
                                     mutates_args=mutates_args, schema=schema)
        register_fake = op.register_fake

        def register_normalized_fake(fake_fn):
            register_fake(_normalizer(name, fake_fn, mutates_args, caches, strided))
            return fake_fn
        op.register_fake = register_normalized_fake
        sig = inspect.signature(fn)
        op.__signature__ = sig
        op.__doc__ = (f"{name}{sig}\n\n{inspect.cleandoc(fn.__doc__ or '')}\n\n"
                      f"Also callable as torch.ops.{name.replace('::', '.')}; a torch.library "
                      f"custom op (CustomOpDef).")
        return op
    return wrap
