"""The attention core's launch policy: every tunable of its planning and kernels, in one frozen
object.

``plan.plan_launch`` reads a :class:`Policy` and nothing else that can be set: the one passed
(``sparse_attention_triton(..., policy=)``), else the one in force (``current()``: ``DEFAULT``
unless a caller up the stack entered ``using(...)``, e.g. a test or an A/B tool running the ops
under a variant). Nothing patches a module. Each value is the measured winner on the GPUs this
project runs (H100 / H200 for the sm_90 kernel; the portable kernel's low-shared-memory shape by
compilation for sm_80-sm_120); the measurements are in lab/perf-log.md under the section each
comment names. What depends on the GPU (its shared memory per block, SM count, whether its
dots run as wgmma) is a fact of the device (``plan.DeviceFacts``), not a setting here.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    """A launch shape of the portable split kernel (ops/attention/portable.py), and the split
    model's cost of one program. ``block_n``: keys per tile; ``num_stages_v32``: stages for
    V3.2's 656 B rows, which gain from a third ("Attention core rework"); ``split_overhead``:
    the fixed cost of one program (q load, partial store, its share of the combine) in key
    tiles; ``dv``: programs the 512 output dims are split over (2: both compute q·k);
    ``max_splits``: a cap on splits (None: the tile count); ``tiny``: the small-launch shape;
    ``tiled_bf16``: plain bf16 rows loaded 64 dims at a time as e4m3 rows are (GPUs with less
    shared memory per block than sm_90)."""
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    num_stages_v32: int = 3
    split_overhead: int = 3
    dv: int = 1
    max_splits: Optional[int] = None
    tiny: bool = False
    tiled_bf16: bool = False

    def stages(self, fmt: str) -> int:
        return self.num_stages_v32 if fmt == "v32" else self.num_stages


@dataclasses.dataclass(frozen=True)
class Sm90:
    """The sm_90 kernel's compile-time shape (``sm90/tuning.launch_constexprs``).
    ``block_n``: keys per ring stage (64 KB of bf16); ``sub_n``: V4 rows per staged gather chunk
    (18 KB of staging); ``stages``: q (64 KB) and two stages fill the 227 KB of shared memory;
    ``producer_regs``: setmaxnreg of the producer warps (fewer were slower: "Lead and follow
    consumers"), ``producer_regs_cluster`` in 2-CTA clusters (faster for V4 and V3.2 at h128,
    slower for one CTA at h64: "Cluster exchange"); ``follow_regs``: the follow consumer's (152
    spills; the lead gets the rest of the 12-warp budget, 216); ``persist_tokens``: tokens a
    persistent program runs at most (its token table's rows)."""
    block_n: int = 64
    sub_n: int = 32
    stages: int = 2
    producer_warps: int = 4
    producer_regs: int = 120
    producer_regs_cluster: int = 128
    follow_regs: int = 168
    persist_tokens: int = 8


@dataclasses.dataclass(frozen=True)
class Policy:
    """Every setting of the attention core's planning (``plan.py``) and launches.

    Launch shapes: ``general``; ``tiny`` for launches of at most ``small_units`` token x
    head-block units (the output dims split over two 4-warp programs: faster at batch 2,
    slower once the batch fills the card, "Attention core rework"); ``low_shared``, the
    general shape on GPUs with less shared memory per block than sm_90 (one stage; plain bf16
    rows tiled: with two stages V3.2 rows took up to 206 KB, more than sm_80's 163 KB; every
    format then fits sm_86 / sm_89 / sm_120's 99 KB, tests/ops/test_arch_compile.py).
    ``max_heads``: rows of q a program holds; wider launches are cut into head blocks.

    The sm_90 kernel: ``sm90_split_overhead`` (its programs cost more than the portable
    model's 3 tiles: ring fill and drain, partials, the combine launch; at 5 batch 74 / 148
    V4 decode keep one split where 3 chose two, faster, "V4 rows staged by cp.async");
    ``sm90_tiny_units`` / ``sm90_tiny_tiles``: tiny launches of one head block stay on the
    portable tiny shape only up to this many units and 64-key tiles (the sm_90 kernel wins
    from 4 units up and, at 1-2 units, from 17 tiles up: "Small head counts", "Tiny launches
    up to 16 tiles"); ``tiny_head_block_sm90``: tiny portable launches on sm_90 run a 64-row
    head block whatever the head count (wgmma for 64-row dots, mma.sync for smaller ones,
    which were much slower at h8-h32: "Small head counts"); ``split_combine_tiles``: the
    combine launch charged to every plan that splits (at 1, V4 b64 s_q1 h64 keeps one split,
    1.13x faster: "Short key lists"); ``cluster_v4_min_tiles``: V4 launches of one wave over
    fewer tiles a token run one CTA a head block, not clusters (C128A's 192 keys at batch 64:
    1.024 / 1.038x faster on H200 / H100, lab/perf-history.md "Issue 55").

    ``cluster_min_units``: launches of at most this many units run one CTA a head block
    (clusters were slower there: "Two-launch schedule and 2-CTA clusters").
    ``clusters`` / ``persistent``: whether the sm_90 kernel may run a token's two head blocks
    as a 2-CTA cluster (V4, V3.2 and V4.1 rows at 65-128 heads) and persistent programs (V4
    rows staged; V4.1 and V3.2 rows in clusters). Both won everywhere they apply (1.03-1.06x,
    outputs bit-identical); False is the other branch, which smaller launches take anyway,
    for tests that compare the two and for A/B runs.

    ``fp4_low_shared_block_n``: key tile over 288 B rows in the general shape below sm_90's
    shared memory (their decoded tiles take twice the others'; an sm_86 block ran out at 64
    and 32). ``combine_spread``: launched early (PDL), a combine of at most this many CTAs per
    SM is capped at ceil(CTAs / SMs) per SM so it spreads over the SMs as the split launch
    empties them (small calls faster; large ones lost under a cap: "Small-launch timeline and
    combine cap"); None never caps. ``partials``: the dtype split partials (each split's
    normalized output rows) pass to the combine in where a token has several splits: bf16
    halves the bytes between the kernels, faster at small and medium batches and a tie at
    large ones ("bf16 split partials"), one rounding more than FlashMLA's fp32 (2^-9 relative
    per term of a convex combination, within docs/semantics.md §9's rel 2/128); a launch of
    one split keeps fp32, rounded once as the sm_90 kernel's own epilogue rounds."""
    max_heads: int = 64
    general: Shape = Shape()
    tiny: Shape = Shape(block_n=32, num_stages=1, num_stages_v32=1, dv=2, max_splits=32,
                        tiny=True)
    low_shared: Shape = Shape(num_stages=1, num_stages_v32=1, tiled_bf16=True)
    small_units: int = 8
    cluster_min_units: int = 8
    sm90: Sm90 = Sm90()
    sm90_split_overhead: int = 5
    sm90_tiny_units: int = 2
    sm90_tiny_tiles: int = 16
    tiny_head_block_sm90: int = 64
    split_combine_tiles: int = 1
    cluster_v4_min_tiles: int = 4
    clusters: bool = True
    persistent: bool = True
    fp4_low_shared_block_n: int = 16
    combine_spread: Optional[int] = 8
    partials: torch.dtype = torch.bfloat16
    # A fixed schedule in place of the split model's (tests cutting key lists every way, A/B
    # runs): ``splits``, every launch in that many splits a token; ``phases``, sm_90 launches
    # as these (first token, end token or None for the last, splits). None: the model's.
    splits: Optional[int] = None
    phases: Optional[tuple] = None


DEFAULT = Policy()
_CURRENT = contextvars.ContextVar("sparse_mla_attention_policy", default=DEFAULT)


def current() -> Policy:
    """The policy in force: ``DEFAULT`` outside any ``using`` block."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(policy: Optional[Policy] = None, **changes):
    """Run the block under ``policy`` (default: the one in force) with ``changes`` applied,
    e.g. ``with using(persistent=False): ...``; the previous policy is back after it."""
    token = _CURRENT.set(dataclasses.replace(policy or current(), **changes))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
