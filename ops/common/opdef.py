"""``custom_op``: ``torch.library.custom_op`` in the ``sparse_mla::`` namespace, documented.

``torch.library.custom_op`` returns a ``CustomOpDef`` object, and ``help()`` on it shows
torch's generic ``CustomOpDef`` class text. This decorator gives each op object its own
``__doc__`` (the op's signature, then the function's docstring) and ``__signature__``, so
``help(op)`` and ``inspect.signature(op)`` describe the op itself. Nothing else changes: the
object is torch's, registered exactly as ``torch.library.custom_op`` registers it.
"""
from __future__ import annotations

import inspect

import torch

NAMESPACE = "sparse_mla"


def custom_op(name: str, *, mutates_args):
    """``@custom_op("sparse_mla::x", mutates_args=(...))`` on a function, as torch's decorator."""
    if not name.startswith(NAMESPACE + "::"):
        raise ValueError(f"op name must start with '{NAMESPACE}::', got {name!r}")

    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        sig = inspect.signature(fn)
        op.__signature__ = sig
        op.__doc__ = (f"{name}{sig}\n\n{inspect.cleandoc(fn.__doc__ or '')}\n\n"
                      f"Also callable as torch.ops.{name.replace('::', '.')}; a torch.library "
                      f"custom op (CustomOpDef).")
        return op
    return wrap
