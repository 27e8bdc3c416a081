"""GLM-5.2's indexer cadence: which V3.2 layers run the Lightning indexer ("full") and which
attend over the previous full layer's top-k with no selection of their own ("shared").

The rule, identical in both sources (layer ``i`` of ``num_hidden_layers``):

* ``index_topk_pattern`` given (a string of ``F`` / ``S``, or a list of "full" / "shared"):
  layer ``i`` is its ``i``-th letter.
* otherwise ``full`` iff ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0``,
  defaults ``index_topk_freq = 1`` (every layer full), ``index_skip_topk_offset = 2``.
* an explicit ``indexer_types`` list (HF) wins over both.

Sources: transformers 5.17 ``models/glm_moe_dsa/configuration_glm_moe_dsa.py:137-148``
(``__post_init__``; HF clamps ``freq`` to >= 1, we reject it instead) and
``modeling_glm_moe_dsa.py:374-375`` (a shared layer builds no indexer); vLLM 0.33.0
``model_executor/models/deepseek_v2.py:1145-1156`` (``_skip_topk``; MTP layers, ids past
``num_hidden_layers``, always run a full indexer).

A shared layer before any full layer would have no top-k to reuse, so it is an error here
(both sources would fail later, at the first step).
"""
from __future__ import annotations

from typing import Any, List, Mapping

FULL, SHARED = "full", "shared"
_LETTERS = {"F": FULL, "S": SHARED}


def _get(cfg: Any, key: str, default=None):
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def layer_roles(cfg: Any, num_layers: int | None = None) -> List[str]:
    """Per-layer roles ("full" / "shared") of a GLM-5.2 / V3.2 config (an HF config object
    or a dict with HF's / vLLM's key names). ``num_layers`` overrides
    ``num_hidden_layers``."""
    n = num_layers if num_layers is not None else _get(cfg, "num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"num_hidden_layers must be an int >= 0, got {n!r}")
    explicit = _get(cfg, "indexer_types")
    pattern = _get(cfg, "index_topk_pattern")
    if explicit is not None:
        roles = list(explicit)
        bad = [r for r in roles if r not in (FULL, SHARED)]
        if bad:
            raise ValueError(f"indexer_types: unknown role {bad[0]!r} (expected 'full' or "
                             f"'shared')")
    elif pattern is not None:
        if isinstance(pattern, str):
            bad = [c for c in pattern if c not in _LETTERS]
            if bad:
                raise ValueError(f"index_topk_pattern: unknown letter {bad[0]!r} (expected "
                                 f"'F' or 'S') in {pattern!r}")
            roles = [_LETTERS[c] for c in pattern]
        else:
            roles = list(pattern)
            bad = [r for r in roles if r not in (FULL, SHARED)]
            if bad:
                raise ValueError(f"index_topk_pattern: unknown role {bad[0]!r}")
    else:
        freq = _get(cfg, "index_topk_freq", 1)
        offset = _get(cfg, "index_skip_topk_offset", 2)
        if freq is None:
            freq = 1
        if offset is None:
            offset = 2
        if not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
            raise ValueError(f"index_topk_freq must be an int >= 1, got {freq!r}")
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise ValueError(f"index_skip_topk_offset must be an int, got {offset!r}")
        roles = [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(n)]
    if len(roles) != n:
        raise ValueError(f"indexer pattern has {len(roles)} layers, num_hidden_layers is {n}")
    if roles and roles[0] == SHARED:
        raise ValueError("layer 0 is 'shared' but no earlier 'full' layer computed a top-k "
                         "to reuse")
    return roles


def topk_source(roles: List[str]) -> List[int]:
    """For each layer, the layer whose indexer top-k it attends over (itself when full)."""
    src, last = [], None
    for i, r in enumerate(roles):
        if r == FULL:
            last = i
        elif last is None:
            raise ValueError(f"layer {i} is 'shared' before any 'full' layer")
        src.append(last)
    return src
