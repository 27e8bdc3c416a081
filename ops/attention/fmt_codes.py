"""The cache-format codes of the attention kernels' ``FMT`` / ``FMT1`` constexpr parameters.

Each is a ``tl.constexpr`` (Gluon's ``gl.constexpr`` is the same class), so the kernels compare
against the names as module-level globals and every branch is still resolved at compile time;
``.value`` is the plain int the launcher passes. The numbers are part of each compiled
kernel's cache key only: renumbering them changes no generated code.
"""
from __future__ import annotations

import triton.language as tl

V4 = tl.constexpr(0)                # 584 B V4 records
V32 = tl.constexpr(1)               # 656 B V3.2 records (576-wide rows)
PLAIN_BF16 = tl.constexpr(2)        # plain bf16 rows, loaded whole
PLAIN_FP8 = tl.constexpr(3)         # plain e4m3 rows with a per-tensor scale
# plain bf16 rows loaded 64 dims at a time (the portable kernel on GPUs with less shared memory
# per block than sm_90: the launch config's ``tiled_bf16``)
PLAIN_BF16_TILED = tl.constexpr(4)
V41 = tl.constexpr(5)               # 528 B V4.1 records, page-footer scales
V41_FP4 = tl.constexpr(6)           # 288 B V4.1 NVFP4 records, page-footer scales
# The sm_90 kernel's 528 B main rows whose extra rows are in another record (its producer picks
# each chunk's record by its source: sm90/producers_v41.py)
V41_WITH_FP4 = tl.constexpr(7)      # extra rows 288 B V4.1 NVFP4
V41_WITH_V4 = tl.constexpr(8)       # extra rows 584 B V4
V41_INLINE = tl.constexpr(9)        # 528 B V4.1 records, scales inline after each token
V41_FP4_INLINE = tl.constexpr(10)   # 288 B V4.1 NVFP4 records, scales inline
# Every code from here up is a V4.1 record (alone or with its extra record)
V41_FIRST = V41
# ``FMT1`` (the portable kernel's second source): the same format as the first
SAME_AS_FMT = tl.constexpr(-1)

# The launcher's codes by cache format name (``ops/common/formats.py``)
BY_NAME = {"v4": V4.value, "v32": V32.value, "plain_bf16": PLAIN_BF16.value,
           "plain_fp8": PLAIN_FP8.value, "v41": V41.value, "v41_fp4": V41_FP4.value,
           "v41_inline": V41_INLINE.value, "v41_fp4_inline": V41_FP4_INLINE.value}
# The sm_90 kernel's code for 528 B main rows by their extra rows' record
V41_EXTRA = {"v41_fp4": V41_WITH_FP4.value, "v4": V41_WITH_V4.value}
