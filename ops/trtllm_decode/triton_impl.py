"""The TRTLLM-gen-semantics ops' Triton implementations: the same problems as reference.py's
(key sources of the shared attention core, ops/attention/) run by the core's Triton launcher,
with a varlen batch's per-token column counts from triton_kernels.py's one launch. Triton
itself is imported only when a varlen batch needs that launch."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sparse_mla.ops.common import checks
from sparse_mla.ops.attention import plan_attention, sparse_attention_triton
from sparse_mla.ops.trtllm_decode import reference

LENGTHS_BLOCK = 128                   # tokens per program of the lengths kernel


def device_scale(value: float, tensor: Optional[Tensor]):
    """The scale for the Triton core: the tensor itself when given (read on the device: no
    host sync, so a CUDA graph replay sees the tensor's current value), else the float."""
    return value if tensor is None else tensor


def dsv4(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens, seq_lens,
         out, bmm1_scale, bmm1_scale_tensor, bmm2_scale, bmm2_scale_tensor, sinks, kv_layout,
         cum_seq_lens_q, max_q_len, workspace_buffer):
    q, sources, o = reference.dsv4_problem(query, swa_kv_cache, sparse_indices,
                                           compressed_kv_cache, sparse_topk_lens, seq_lens, out,
                                           kv_layout, cum_seq_lens_q, max_q_len, dsv4_lengths)
    sparse_attention_triton(q, sources, sinks, device_scale(bmm1_scale, bmm1_scale_tensor), o,
                            out_scale=device_scale(bmm2_scale, bmm2_scale_tensor))


def plan_dsv4(query, swa_kv_cache, sparse_indices, compressed_kv_cache, sparse_topk_lens,
              seq_lens, out, bmm1_scale, bmm1_scale_tensor, bmm2_scale, bmm2_scale_tensor, sinks,
              kv_layout, cum_seq_lens_q, max_q_len, workspace_buffer):
    """What ``dsv4`` would launch on these arguments (``plan.LaunchPlan``), not launched."""
    q, sources, _ = reference.dsv4_problem(query, swa_kv_cache, sparse_indices,
                                           compressed_kv_cache, sparse_topk_lens, seq_lens, out,
                                           kv_layout, cum_seq_lens_q, max_q_len, _unlaunched(2))
    return plan_attention(q, sources)


def plan_v32(query, kv_cache, block_tables, seq_lens, out, bmm1_scale, bmm1_scale_tensor,
             bmm2_scale, bmm2_scale_tensor, sinks, cum_seq_lens_q, max_q_len, workspace_buffer):
    """What ``v32`` would launch on these arguments (``plan.LaunchPlan``), not launched."""
    q, sources, _ = reference.v32_problem(query, kv_cache, block_tables, seq_lens, out,
                                          cum_seq_lens_q, max_q_len, _unlaunched(1))
    return plan_attention(q, sources)


def _unlaunched(n):
    """A stand-in for a lengths function: ``n`` uncomputed int32 [T] buffers (a plan reads
    their shape, never their values), so planning launches nothing."""
    def lengths(T, B, Q, lens, *args):
        dev = lens.device
        bufs = tuple(torch.empty(T, dtype=torch.int32, device=dev) for _ in range(n))
        return bufs if n > 1 else bufs[0]
    return lengths


def v32(query, kv_cache, block_tables, seq_lens, out, bmm1_scale, bmm1_scale_tensor, bmm2_scale,
        bmm2_scale_tensor, sinks, cum_seq_lens_q, max_q_len, workspace_buffer):
    q, sources, o = reference.v32_problem(query, kv_cache, block_tables, seq_lens, out,
                                          cum_seq_lens_q, max_q_len, v32_lengths)
    sparse_attention_triton(q, sources, sinks, device_scale(bmm1_scale, bmm1_scale_tensor), o,
                            out_scale=device_scale(bmm2_scale, bmm2_scale_tensor))


def _launch(T, B, Q, K, seq_lens, cum_seq_lens_q, topk_lens, dsv4):
    import triton

    from sparse_mla.ops.common.triton_utils import pdl_supported
    from sparse_mla.ops.trtllm_decode.triton_kernels import lengths_kernel
    # the kernel reads each list by base pointer
    seq_lens, cum_seq_lens_q, topk_lens = map(checks.unit_stride,
                                              (seq_lens, cum_seq_lens_q, topk_lens))
    dev = seq_lens.device
    a = torch.empty(T, dtype=torch.int32, device=dev)
    b = torch.empty(T if dsv4 else 0, dtype=torch.int32, device=dev)
    if T:
        cu = cum_seq_lens_q if cum_seq_lens_q is not None else seq_lens
        lengths_kernel[(triton.cdiv(T, LENGTHS_BLOCK),)](
            seq_lens, cu, topk_lens if topk_lens is not None else seq_lens, a,
            b if dsv4 else a, T, B, Q, K, HAS_CU=cum_seq_lens_q is not None, DSV4=dsv4,
            SWA=reference.SWA_COLS, BLOCK=LENGTHS_BLOCK, CHUNK=64, PDL=pdl_supported(dev),
            num_warps=4)
    return a, b


def dsv4_lengths(T, B, Q, sparse_topk_lens, seq_lens, cum_seq_lens_q, topk):
    """(swa_len, cmp_len) int32 [T]: the same values as ``reference.dsv4_lengths``."""
    return _launch(T, B, Q, topk, seq_lens, cum_seq_lens_q, sparse_topk_lens, True)


def v32_lengths(T, B, Q, seq_lens, cum_seq_lens_q, K):
    """n int32 [T]: the same values as ``reference.v32_lengths``."""
    return _launch(T, B, Q, K, seq_lens, cum_seq_lens_q, None, False)[0]
