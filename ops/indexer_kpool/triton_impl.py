"""The kpool indexer family's Triton route: not written yet.

Every op's Triton entry is registered with ``unavailable`` as its check, so ``impl="auto"``
takes the reference and ``impl="triton"`` fails with the reason instead of running
something else under the Triton name.
"""
from __future__ import annotations

REASON = "the kpool indexer's Triton kernels are not written yet (reference route only)"


def unavailable(*args, **kwargs):
    return REASON


def _missing(*args, **kwargs):
    raise NotImplementedError(REASON)


k_insert = topk_prefill = topk_decode = _missing
