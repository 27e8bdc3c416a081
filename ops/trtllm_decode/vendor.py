"""FlashInfer (``flashinfer-python``, module ``flashinfer.decode``) as the vendor implementation
of the TRTLLM-gen-semantics ops: the argument translation and the runner.

The translation (``dsv4_vendor_arguments``, ``v32_vendor_arguments``) is a pure function of
validated op arguments, unit-tested on CPU. **FlashInfer's kernel itself was never run by this
project (its DSv4 / V3.2 sparse decode runs on SM100/SM103 only, and no such GPU was
available), so this path is unverified.** FlashInfer is imported lazily, only where it runs.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from sparse_mla.ops.common import checks, dispatch
from sparse_mla.ops.trtllm_decode import canary
from sparse_mla.ops.common.vendor_heads import pad_heads
from sparse_mla.ops.common.formats import HEAD_DIM as V_DIM
from sparse_mla.ops.trtllm_decode.reference import pool_view

FLASHINFER_DSV4_HEADS = (8, 16, 32, 64, 128)   # _check_dsv4_sparse_mla_inputs
FLASHINFER_V32_PAGE_SIZES = (32, 64)           # trtllm-gen MLA decode block sizes
VENDOR_CCS = ((10, 0), (10, 3))
VENDOR_NEEDS = ("needs an SM100/SM103 GPU (compute capability 10.0 / 10.3) and the flashinfer "
                "package (flashinfer-python); FlashInfer's kernel was never run by this "
                "project's tests (no SM100 available), so this path is unverified")
# where this project's tests ran FlashInfer's kernels: nowhere yet, so the automatic choice
# runs a canary against Triton first on every device (dispatch's module docstring)
VERIFIED_CCS = ()
WORKSPACE_BYTES = 128 * 1024 * 1024   # vLLM's zero-initialised FlashInfer workspace


def vendor_env(device) -> Optional[str]:
    """None when FlashInfer could run on ``device`` (the query's), else why not."""
    if not torch.cuda.is_available():
        return VENDOR_NEEDS + " (no CUDA device)"
    cc = dispatch.device_capability(device)
    if cc is None:
        return VENDOR_NEEDS + " (tensors are not on CUDA)"
    if cc not in VENDOR_CCS:
        return VENDOR_NEEDS + f" (this GPU is SM{cc[0]}{cc[1]})"
    try:
        import flashinfer.decode  # noqa: F401
    except Exception as exc:   # any import failure means "not available"
        return VENDOR_NEEDS + f" (flashinfer is not importable: {exc})"
    return None


_WORKSPACES: dict = {}


def workspace(device) -> Tensor:
    """One zero-initialised 128 MiB FlashInfer workspace per CUDA device (as vLLM allocates);
    elsewhere a 0-element placeholder, which the ops read as "none" (no vendor route there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.empty(0, dtype=torch.uint8, device=device)
    key = str(device)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[key]


def _pad_heads(H: int, allowed) -> int:
    for a in allowed:
        if H <= a:
            return a
    raise ValueError(f"{H} heads exceed the largest head count {allowed[-1]} FlashInfer accepts")


def dsv4_vendor_arguments(query, swa_kv_cache, sparse_indices, compressed_kv_cache,
                          sparse_topk_lens, seq_lens, out, bmm1_scale=1.0,
                          bmm1_scale_tensor=None, bmm2_scale=1.0, bmm2_scale_tensor=None,
                          sinks=None, kv_layout="HND", cum_seq_lens_q=None, max_q_len=None,
                          workspace_buffer=None) -> dict:
    """Pure translation of validated op arguments into the call FlashInfer would receive.

    Returns ``{"function": name in flashinfer.decode, "kwargs": {...}, "copy_out":
    (padded_out, out) or None}``. Heads are padded up to the next count FlashInfer's DSv4 check
    accepts (8, 16, 32, 64, 128): q pad heads are zeros, sink pad heads -inf, and the padded
    output's first ``H`` heads are copied into ``out`` afterwards. Caches and the layout pass
    unchanged (3-D stays 3-D); indices, lengths and sinks too, unless strided in their last
    dimension (then as unit-stride copies: whether FlashInfer reads them by base pointer is
    unverified, it does not run on SM90). A tensor ``bmm1_scale`` is passed as the tensor
    in natural units: FlashInfer multiplies it by log2(e) itself (a float is converted in C++).
    Makes only those copies (no other allocation or launch); imports nothing.
    """
    H = query.shape[-2]
    Hp = _pad_heads(H, FLASHINFER_DSV4_HEADS)
    q, s, padded_out = pad_heads(query, sinks, Hp, out_dim=V_DIM)
    o, copy_out = (out, None) if padded_out is None else (padded_out, (padded_out, out))
    us = checks.unit_stride     # strided lists reach FlashInfer as unit-stride copies
    kwargs = dict(
        query=q, swa_kv_cache=swa_kv_cache, workspace_buffer=workspace_buffer,
        sparse_indices=us(sparse_indices), compressed_kv_cache=compressed_kv_cache,
        sparse_topk_lens=us(sparse_topk_lens), seq_lens=us(seq_lens), out=o,
        bmm1_scale=bmm1_scale if bmm1_scale_tensor is None else bmm1_scale_tensor,
        bmm2_scale=bmm2_scale if bmm2_scale_tensor is None else bmm2_scale_tensor,
        sinks=us(s), kv_layout=kv_layout, cum_seq_lens_q=us(cum_seq_lens_q),
        max_q_len=max_q_len, backend="trtllm-gen")
    return {"function": "trtllm_batch_decode_sparse_mla_dsv4", "kwargs": kwargs,
            "copy_out": copy_out}


def _run_vendor(plan):
    import flashinfer.decode as fi_decode
    getattr(fi_decode, plan["function"])(**plan["kwargs"])
    if plan["copy_out"] is not None:
        padded, out = plan["copy_out"]
        out.copy_(padded[..., :out.shape[-2], :])


def runner(arguments):
    """The vendor implementation: translate (pure ``arguments``), then call FlashInfer. The
    last argument is the workspace; a process-wide zeroed one is used when it is None or the
    0-element placeholder (ops.workspace_arg)."""
    def run(*args):
        a = list(args)
        if a[-1] is None or a[-1].numel() == 0:
            a[-1] = workspace(args[0].device)
        _run_vendor(arguments(*a))
    return run


def cuda_reason(query) -> Optional[str]:
    return vendor_env(query.device)


def _v32_vendor_heads(H: int) -> int:
    """TRTLLM-gen MLA decode rejects 64 < H < 128 (FlashInfer ``trtllm_gen_not_supported_
    reason``): pad those to 128. Other counts pass unchanged (whether cubins exist for every
    H <= 64 is UNCONFIRMED; vLLM does not pad for this backend)."""
    return 128 if 64 < H < 128 else H


def v32_vendor_arguments(query, kv_cache, block_tables, seq_lens, out, bmm1_scale=1.0,
                         bmm1_scale_tensor=None, bmm2_scale=1.0, bmm2_scale_tensor=None,
                         sinks=None, cum_seq_lens_q=None, max_q_len=None,
                         workspace_buffer=None) -> dict:
    """Pure translation into ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla`` kwargs,
    the way vLLM's ``FlashInferMLASparseImpl.forward_mqa`` calls it: a 3-D query without
    ``cum_seq_lens_q`` becomes ``[T, 1, H, 576]`` (one token per batch row) with block tables
    ``[T, 1, K]``; the cache becomes 4-D ``[pages, 1, page_size, 576]``; ``max_seq_len =
    sparse_mla_top_k = K``; dims (128, 512, 64). Heads 65..127 are padded to 128 (zeros in q,
    -inf sinks, output copied back). ``sinks`` is passed as a one-element list (FlashInfer's
    type ``Optional[List[Tensor]]``)."""
    H = query.shape[-2]
    T = math.prod(query.shape[:-2])
    q, o, bt = query, out, block_tables
    if query.dim() == 3 and cum_seq_lens_q is None:
        q, o, bt = query.unsqueeze(1), out.unsqueeze(1), block_tables.reshape(T, 1, -1)
    elif query.dim() == 4 and block_tables.dim() == 2:
        bt = block_tables.reshape(query.shape[0], query.shape[1], -1)
    K = bt.shape[-1]
    Hp = _v32_vendor_heads(H)
    q, s, padded_out = pad_heads(q, sinks, Hp, out_dim=V_DIM)
    copy_out = None if padded_out is None else (padded_out, o)
    o = o if padded_out is None else padded_out
    cache = kv_cache.unsqueeze(1) if kv_cache.dim() == 3 else kv_cache
    kwargs = dict(
        query=q, kv_cache=cache, workspace_buffer=workspace_buffer, qk_nope_head_dim=128,
        kv_lora_rank=512, qk_rope_head_dim=64, block_tables=checks.unit_stride(bt),
        seq_lens=checks.unit_stride(seq_lens), max_seq_len=K, sparse_mla_top_k=K, out=o,
        bmm1_scale=bmm1_scale if bmm1_scale_tensor is None else bmm1_scale_tensor,
        bmm2_scale=bmm2_scale if bmm2_scale_tensor is None else bmm2_scale_tensor,
        sinks=None if s is None else [checks.unit_stride(s)], backend="trtllm-gen")
    if cum_seq_lens_q is not None:
        kwargs.update(cum_seq_lens_q=checks.unit_stride(cum_seq_lens_q), max_q_len=max_q_len)
    return {"function": "trtllm_batch_decode_with_kv_cache_mla", "kwargs": kwargs,
            "copy_out": copy_out}


def dsv4_check(query, *args) -> Optional[str]:
    return cuda_reason(query)


def v32_check(query, kv_cache, *args) -> Optional[str]:
    reason = cuda_reason(query)
    if reason is None:
        ps = pool_view(kv_cache, "HND").shape[1]
        if ps not in FLASHINFER_V32_PAGE_SIZES:
            reason = f"TRTLLM-gen MLA decode needs page_size 32 or 64, got {ps}"
    return reason


# The routes ops.py registers (dispatch.implementations).
DSV4 = dispatch.VendorRoute(runner(dsv4_vendor_arguments), dsv4_check,
                            verified_ccs=VERIFIED_CCS, canary=canary.DSV4)
V32 = dispatch.VendorRoute(runner(v32_vendor_arguments), v32_check,
                           verified_ccs=VERIFIED_CCS, canary=canary.V32)
