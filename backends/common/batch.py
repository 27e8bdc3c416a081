"""The batch description a caller fills once per step (engine-neutral; vLLM's metadata and a
test's simulator both map onto it).

Token order: decode tokens first (``num_decode_tokens``, MTP decodes have several per request),
then prefill tokens (``num_prefill_tokens``); any rows of ``q`` past those two are padding
(CUDA-graph padding) and come out as zeros. Decode requests come before prefill requests.
Counts are Python ints, so the planner never reads them back from the device.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from torch import Tensor


@dataclasses.dataclass
class BatchDescription:
    """One step's metadata. Device tensors unless named ``*_cpu``.

    - ``query_start_loc`` int32 ``[R + 1]`` (absolute, starts at 0), ``seq_lens`` int32 ``[R]``
      (context + this step's tokens), ``R = num_decodes + num_prefills``.
    - ``positions`` int64 ``[T]``: token ``j`` of request ``r`` is at
      ``seq_lens[r] - query_len[r] + j``.
    - ``swa_block_table`` int32 ``[R, *]`` and ``swa_slot_mapping`` int64 ``[T]`` (-1: no
      write, a padding token) address the SWA cache (block size = the backend's spec).
    - ``compressed_block_table`` int32 ``[R, *]`` (compressed layers): blocks of the compressed
      cache, whose block size counts compressed entries (vLLM: 256 // ratio).
    - ``compressed_slot_mapping`` int64 ``[N_c]``: where this step's compressor rows go (-1: the
      row's token completes no entry).
    - ``topk_indices`` int32 ``[T, K]`` (C4A): the indexer's request-local top-k, valid ids a
      left-aligned prefix, -1 after; ``K`` is the layer's ``topk``. DeepSeek-V3.2 layers
      (backends/v32): request-local token positions, the same shape.
    - ``max_decode_query_len`` / ``max_prefill_query_len``: Python ints (no host sync).
    - ``query_start_loc_cpu`` / ``seq_lens_cpu``: host copies used to plan prefill chunks; when
      absent and there are prefills, the planner copies them once (a sync, prefill only).
    """

    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    query_start_loc: Tensor
    seq_lens: Tensor
    positions: Tensor
    swa_block_table: Tensor
    swa_slot_mapping: Tensor
    compressed_block_table: Optional[Tensor] = None
    compressed_slot_mapping: Optional[Tensor] = None
    topk_indices: Optional[Tensor] = None
    max_decode_query_len: int = 1
    max_prefill_query_len: int = 0
    query_start_loc_cpu: Optional[Tensor] = None
    seq_lens_cpu: Optional[Tensor] = None

    # DeepSeek-V3.2 layers have one cache of every token (no window, no compression): its
    # block table and slot mapping travel in the swa_* fields; these names read better there.
    @property
    def block_table(self) -> Tensor:
        return self.swa_block_table

    @property
    def slot_mapping(self) -> Tensor:
        return self.swa_slot_mapping

    @property
    def num_reqs(self) -> int:
        return self.num_decodes + self.num_prefills

    @property
    def num_tokens(self) -> int:
        """Real tokens (decode + prefill), padding excluded."""
        return self.num_decode_tokens + self.num_prefill_tokens
