"""Which part of DeepSeek-V4.1's two-level indexer a layer runs (docs/semantics.md §11.6).

vLLM 0.32.0 / 0.33.0 (``models/deepseek_v41/attention.py``) read the topology from the HF
config: ``compress_ratios`` (0 / 1 / 2 per layer), ``kv_source_layer_ids`` (layers owning a
compressed cache and, when they also index, the index K cache), ``index_source_layer_ids``
(layers with an indexer: their own q / weights), ``candidate_source_layer_id`` (the one indexer
writing candidate blocks; -1: none), ``candidate_topk_blocks``, ``candidate_block_size`` and
``index_topk``. A compressed layer reads the compressed cache and index K of the latest kv
source at or below it and, without an indexer, the top-k of the latest index source at or below
it (vLLM keeps one top-k buffer, so "latest" is simply the buffer's content).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

# source: single-level top-k (V4's §11 op); candidate_source: level 1 (own top-k + candidate
# blocks); candidate_user: level 2 (top-k inside the candidates); reuse: no indexer
INDEX_ROLES = ("source", "candidate_source", "candidate_user", "reuse")


@dataclasses.dataclass(frozen=True)
class V41IndexerConfig:
    """One compressed layer's indexer. ``k_source_layer_id``: the layer whose index K cache it
    scores (itself when it owns one; None for ``reuse``). ``candidate_source_layer_id``: the
    layer whose candidates a ``candidate_user`` masks with (itself for the candidate source).
    ``topk_source_layer_id``: for ``reuse``, the index source whose top-k it reads."""

    layer_id: int
    index_role: str
    index_topk: int = 512
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    k_source_layer_id: Optional[int] = None
    candidate_source_layer_id: Optional[int] = None
    topk_source_layer_id: Optional[int] = None

    def __post_init__(self):
        if self.index_role not in INDEX_ROLES:
            raise ValueError(f"index_role must be one of {INDEX_ROLES}, got "
                             f"{self.index_role!r}")
        if self.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {self.index_topk}")
        scoring = self.index_role != "reuse"
        if scoring != (self.k_source_layer_id is not None):
            raise ValueError(f"k_source_layer_id must be {'set' if scoring else 'None'} for "
                             f"index_role {self.index_role!r} (layer {self.layer_id})")
        if scoring and not 0 <= self.k_source_layer_id <= self.layer_id:
            raise ValueError(f"k_source_layer_id must be a layer at or below {self.layer_id}, "
                             f"got {self.k_source_layer_id}")
        if (self.topk_source_layer_id is None) == (self.index_role == "reuse"):
            raise ValueError(f"topk_source_layer_id must be {'set' if not scoring else 'None'} "
                             f"for index_role {self.index_role!r} (layer {self.layer_id}): "
                             f"only a reuse layer reads another layer's top-k")
        if self.index_role == "reuse" and not 0 <= self.topk_source_layer_id < self.layer_id:
            raise ValueError(f"topk_source_layer_id must be a layer below {self.layer_id}, got "
                             f"{self.topk_source_layer_id}")
        if self.uses_candidates:
            if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
                raise ValueError(f"index_role {self.index_role!r} needs candidate_topk_blocks "
                                 f"and candidate_block_size >= 1, got "
                                 f"{self.candidate_topk_blocks}, {self.candidate_block_size}")
            src = self.candidate_source_layer_id
            want = self.layer_id if self.index_role == "candidate_source" else None
            if src is None or (want is not None and src != want) or src > self.layer_id or \
                    (want is None and src >= self.layer_id):
                raise ValueError(f"candidate_source_layer_id must be "
                                 f"{'the layer itself' if want is not None else 'a layer below'} "
                                 f"{self.layer_id} for index_role {self.index_role!r}, got {src}")
        elif self.candidate_source_layer_id is not None:
            raise ValueError(f"candidate_source_layer_id is for the candidate roles, not "
                             f"{self.index_role!r}")

    @property
    def uses_candidates(self) -> bool:
        return self.index_role in ("candidate_source", "candidate_user")

    @property
    def owns_index_k(self) -> bool:
        """Its step writes the index K (a kv source that indexes)."""
        return self.k_source_layer_id == self.layer_id


def _get(cfg: Any, key: str, default=None):
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


def indexer_roles(hf_config: Any) -> Dict[int, V41IndexerConfig]:
    """Every compressed backbone layer's :class:`V41IndexerConfig` from a V4.1 HF config (a
    dict or an object with the keys as attributes, as vLLM reads it). Layers past
    ``compress_ratios`` (MTP) are SWA only, as vLLM makes them, and get no entry."""
    ratios = [int(r) for r in _get(hf_config, "compress_ratios", None) or ()]
    n_layers = int(_get(hf_config, "num_hidden_layers", len(ratios)))
    kv_src = sorted(int(x) for x in _get(hf_config, "kv_source_layer_ids", None) or ())
    ix_src = sorted(int(x) for x in _get(hf_config, "index_source_layer_ids", None) or ())
    cand = int(_get(hf_config, "candidate_source_layer_id", -1))
    nb = int(_get(hf_config, "candidate_topk_blocks", 0))
    bsz = int(_get(hf_config, "candidate_block_size", 0))
    topk = _get(hf_config, "index_topk", None)
    if topk is None:
        raise ValueError("the config has no index_topk")
    bad = [r for r in ratios if r not in (0, 1, 2)]
    if bad:
        raise ValueError(f"compress_ratios must hold 0, 1 or 2 (DeepSeek-V4.1), got {bad}")
    # vLLM allocates the candidate buffer only with both set (amd/model.py, nvidia/model.py)
    if cand >= 0 and nb <= 0:
        cand = -1
    if cand >= 0 and (cand not in ix_src or bsz < 1):
        raise ValueError(f"candidate_source_layer_id {cand} must be in index_source_layer_ids "
                         f"{ix_src}, with candidate_block_size >= 1 (got {bsz})")
    roles = {}
    for layer, ratio in enumerate(ratios[:n_layers]):
        if ratio == 0:
            continue
        kv = [s for s in kv_src if s <= layer]
        ix = [s for s in ix_src if s <= layer]
        if not kv or not ix:
            raise ValueError(f"compressed layer {layer} has no kv source / index source at or "
                             f"below it (kv_source_layer_ids {kv_src}, index_source_layer_ids "
                             f"{ix_src})")
        common = dict(layer_id=layer, index_topk=int(topk))
        if layer not in ix_src:
            _same_ratio(ratios, layer, ix[-1], "reads the top-k of")
            roles[layer] = V41IndexerConfig(index_role="reuse", topk_source_layer_id=ix[-1],
                                            **common)
            continue
        _same_ratio(ratios, layer, kv[-1], "scores the index K of")
        role = "source"
        if layer == cand:
            role = "candidate_source"
        elif 0 <= cand < layer:
            role = "candidate_user"
            _same_ratio(ratios, layer, cand, "masks with the candidates of")
        cands = dict(candidate_topk_blocks=nb, candidate_block_size=bsz,
                     candidate_source_layer_id=cand) if role != "source" else {}
        roles[layer] = V41IndexerConfig(index_role=role, k_source_layer_id=kv[-1], **cands,
                                        **common)
    return roles


def _same_ratio(ratios, layer, source, what):
    """Positions are compressed positions of the source's ratio: a reader of another ratio
    would address other tokens."""
    if ratios[layer] != ratios[source]:
        raise ValueError(f"layer {layer} (compress ratio {ratios[layer]}) {what} layer "
                         f"{source} (compress ratio {ratios[source]}): the ratios must match")
