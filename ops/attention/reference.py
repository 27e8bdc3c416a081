"""The attention core's key lists (``KeySource``) and its PyTorch reference: the math every
decode op shares, the oracle of the Triton kernels and the CPU kernel of the ops.

A query token attends to the union of up to two key lists ("sources"), each naming rows of one
KV cache by slot id. K = V: the same row is used for q·k (all ``D_qk`` dims) and for the output
(its first 512 dims). With an attention sink the output is scaled by ``sigmoid(lse - sink)``
(docs/semantics.md §5.1, §6): sink = -inf changes nothing, +inf zeroes the output; no valid key
gives output 0 and lse = +inf whatever the sink.

Key validity in a source: column ``j < lengths[t]`` (all columns when ``lengths`` is None) and
``0 <= indices[t, j] < num_blocks * block_size``. (FlashMLA treats only -1 as invalid; other
negative or too-large ids are undefined there and are simply skipped here.)

Both op families (ops/flashmla_decode, ops/trtllm_decode) translate their own arguments into
``KeySource`` lists and call ``sparse_attention_reference`` (here) or ``sparse_attention_triton``
(ops/attention/__init__.py).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from sparse_mla.ops.common import checks, formats, quant

FORMATS = ("v4", "v32", "plain_bf16", "plain_fp8", "v41", "v41_fp4", "v41_inline",
           "v41_fp4_inline")


@dataclasses.dataclass
class KeySource:
    """One key list over one cache.

    cache: paged byte view for "v4"/"v32"/"v41"/"v41_fp4"/"v41_inline"/"v41_fp4_inline"
        (any view accepted by
        ``checks.paged_cache_block_size``), or ``[num_blocks, block_size, D]`` bf16 /
        float8_e4m3fn for "plain_bf16"/"plain_fp8" (D = 512, or 576 for a V3.2 plain cache;
        strides of dims 0, 1 free, last dim contiguous).
    indices: ``[T, K]`` int32 slot ids (``block * block_size + offset``), any strides.
    lengths: int32 number of leading columns that may be used, one entry per
        ``tokens_per_length`` consecutive tokens (``[T // tokens_per_length]``), or None; any
        stride.
    tokens_per_length: tokens sharing one ``lengths`` entry (FlashMLA's lengths are per batch
        row of s_q tokens). Kernels index ``lengths[t // tokens_per_length]``, so no per-token
        copy (a kernel launch per call) is made.
    length_offset: subtracted from every ``lengths`` entry (TRTLLM-gen's compressed columns:
        ``sparse_topk_lens`` counts the 128 window columns before them).
    causal: token i of each group of ``tokens_per_length`` (consecutive query positions of
        one request) uses ``tokens_per_length - 1 - i`` fewer columns, so only the last uses
        the whole entry (TRTLLM-gen's window: ``seq_len - q_len + i + 1``).
    Token t's usable count is ``lengths[t // tpl] - length_offset - lag`` (lag 0 unless
    ``causal``), clamped to [0, K].
    kv_scale: plain fp8 only: the per-tensor dequantization scale folded into the caller's
        scales (the kernel reads e4m3 values as they are), so it is not stored here.
    """

    cache: torch.Tensor
    fmt: str
    block_size: int
    indices: torch.Tensor
    lengths: Optional[torch.Tensor] = None
    tokens_per_length: int = 1
    length_offset: int = 0
    causal: bool = False

    @property
    def capacity(self) -> int:
        return self.cache.shape[0] * self.block_size

    def usable(self, t: int) -> int:
        """Leading columns token ``t`` may use (before slot-id validity), in [0, K]."""
        k = self.indices.shape[1]
        if self.lengths is None:
            return k
        tpl = self.tokens_per_length
        lag = tpl - 1 - t % tpl if self.causal else 0
        return max(0, min(k, int(self.lengths[t // tpl]) - self.length_offset - lag))


def head_dims(sources: Sequence[KeySource]) -> int:
    """D_qk: 576 for V3.2 (512 latent + 64 RoPE; "v32" or a 576-wide plain cache), else 512."""
    if sources and sources[0].fmt in ("plain_bf16", "plain_fp8"):
        return sources[0].cache.shape[-1]
    return formats.V32.out_dim if sources and sources[0].fmt == "v32" else formats.HEAD_DIM


def gather_rows(src: KeySource, slots: torch.Tensor) -> torch.Tensor:
    """Dequantized fp32 rows ``[n, D_qk]`` of ``slots`` (all valid) of one source."""
    if src.fmt in ("plain_bf16", "plain_fp8"):
        return src.cache[slots // src.block_size, slots % src.block_size].float()
    fmt = formats.get_format(src.fmt)
    blocks = checks.block_bytes_view(src.cache, fmt, src.block_size)
    b, o = slots // src.block_size, slots % src.block_size
    if fmt.codec == "v32":
        data = blocks[b.unsqueeze(1), fmt.token_data_addr(src.block_size, o).unsqueeze(1)
                      + torch.arange(fmt.token_data_bytes, device=b.device)]
        return quant.dequantize_v32(data).float()
    # V4 584 B, V4.1 528 B / 288 B footer or inline (docs/semantics.md §2.2, §12); the V4
    # record's bf16 RoPE dims are part of its data record
    width = fmt.token_data_bytes if fmt.scale_in_tail else fmt.data_bytes
    data = blocks[b.unsqueeze(1), fmt.token_data_addr(src.block_size, o).unsqueeze(1)
                  + torch.arange(width, device=b.device)]
    sc = blocks[b.unsqueeze(1), fmt.token_scale_addr(src.block_size, o).unsqueeze(1)
                + torch.arange(fmt.scale_bytes, device=b.device)]
    return quant.dequantize_record(data, sc, fmt.name).float()


def sparse_attention_reference(q: torch.Tensor, sources: Sequence[KeySource],
                               sink: Optional[torch.Tensor], scale: float,
                               out_scale: float = 1.0, return_max_logits: bool = False):
    """Readable oracle. ``q`` [T, H, D_qk] (bf16 or e4m3, used as its exact values).
    Returns ``(out [T, H, 512] bf16, lse [T, H] fp32)``, plus ``max_logits`` [T, H] (max of
    scale·q·k, -inf without keys) when ``return_max_logits``."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512, dtype=torch.bfloat16, device=q.device)
    lse = torch.full((T, H), float("inf"), dtype=torch.float32, device=q.device)
    mx = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    for t in range(T):
        keys = []
        for src in sources:
            idx = src.indices[t].long()
            cols = torch.arange(idx.shape[0], device=idx.device)
            ok = (cols < src.usable(t)) & (idx >= 0) & (idx < src.capacity)
            if ok.any():
                keys.append(gather_rows(src, idx[ok]))
        if not keys:
            continue
        k = torch.cat(keys)                                   # [n, D_qk]
        s = scale * (q[t].float() @ k.T)                      # [H, n]
        lse_t = torch.logsumexp(s, dim=-1)
        o = torch.softmax(s, dim=-1) @ k[:, :512]
        if sink is not None:
            o = o * torch.sigmoid(lse_t - sink.float()).unsqueeze(-1)
        out[t] = (o * out_scale).to(torch.bfloat16)
        lse[t] = lse_t
        mx[t] = s.amax(dim=-1)
    return (out, lse, mx) if return_max_logits else (out, lse)
