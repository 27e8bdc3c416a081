"""The attention core's launch planning: which kernel route a call takes, and its shape.

``plan_launch`` decides, for one call of the launcher (``launch.run``), between the routes

* ``sm90``: the warp-specialized Gluon kernel (ops/attention/sm90/kernel.py), one CTA per
  (token, head block) unit and split;
* ``sm90_cluster``: the same kernel with the token's two head blocks as a 2-CTA cluster
  (V4 / V3.2 / V4.1 rows at 65-128 heads);
* ``tiny``: the portable kernel's small-launch shape (ops/attention/portable.py: the 512
  output dims split over two 4-warp programs, ``SMALL_CONFIG``);
* ``portable``: the portable Triton split kernel (ops/attention/portable.py),

and the split counts (a wave cost model, ``choose_splits`` / ``plan_phases``). The returned
``LaunchPlan`` says why (``reason``) and which file holds the kernel (``kernel_file``), and
``run`` fills in what it launched; the dispatcher attaches it to ``dispatch.last_choice(op)``
(``dispatch.explain`` reports it). Pure Python: no kernel is imported here, so the Triton
version check runs before the Gluon kernel (whose import installs a process-wide compile
hook, ``sm90/hooks.py``) is ever loaded.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

import torch
import triton

from sparse_mla.ops.common import formats
from sparse_mla.ops.common.dispatch import triton_interpreting
from sparse_mla.ops.common.dispatch import soft_fp8_forced
from sparse_mla.ops.common.triton_utils import SOFT_FP8_ENV, soft_fp8_reason

ROUTES = ("portable", "tiny", "sm90", "sm90_cluster")
# The file that holds each route's split kernel, relative to the checkout (the ``sparse_mla``
# package root): what ``LaunchPlan`` names, so a reader goes from ``last_choice`` to the code
KERNEL_FILES = {"portable": "ops/attention/portable.py", "tiny": "ops/attention/portable.py",
                "sm90": "ops/attention/sm90/kernel.py",
                "sm90_cluster": "ops/attention/sm90/kernel.py"}


@dataclasses.dataclass
class LaunchPlan:
    """One call's launches. ``route``: one of ``ROUTES``; ``reason``: why this route (for a
    portable or tiny route on a GPU, why not the sm_90 kernel); ``phases``: ``(first token,
    end token, splits)`` per split-kernel launch; ``combined``: whether a combine kernel
    merges splits; ``staged``: V4 rows gathered by cp.async (sm_90 routes); ``kernels``: the
    compiled split kernels launched, one per phase (registers, PTX: tests and tools);
    ``soft_e4m3``: why the launch decodes e4m3 in software ("sm_80", "forced", "interpreter";
    ``triton_utils.soft_fp8_reason``), "" where it decodes none or in hardware; ``persist``:
    programs a head block of a persistent launch (``persist_programs``), 0 where none was."""
    route: str
    reason: str
    phases: tuple = ()
    combined: bool = False
    staged: bool = False
    kernels: list = dataclasses.field(default_factory=list)
    soft_e4m3: str = ""
    persist: int = 0

    @property
    def label(self) -> str:
        """The route as ``dispatch.Choice.route`` reports it: e.g. "portable", or
        "portable, software e4m3 (sm_80)" where e4m3 is decoded in integer arithmetic."""
        if self.soft_e4m3:
            return f"{self.route}, software e4m3 ({self.soft_e4m3})"
        return self.route

    @property
    def kernel_file(self) -> str:
        """The file holding this route's split kernel (``KERNEL_FILES``)."""
        return KERNEL_FILES[self.route]

    @property
    def kernel(self):
        """The last compiled split kernel launched (None before ``run`` launched one)."""
        return self.kernels[-1] if self.kernels else None

    def __str__(self):
        splits = ", ".join(f"tokens {a}-{b}: {n} split{'s' * (n > 1)}"
                           for a, b, n in self.phases)
        persist = f", {self.persist} persistent programs a head block" if self.persist else ""
        return (f"{self.label} ({self.reason}; kernel in {self.kernel_file})"
                + (f" [{splits}{persist}]" if splits else ""))


# Launch shape; lab/tools/tune_decode.py sweeps it (lab/perf-log.md, "Attention core rework").
# "split_overhead": the fixed cost of one program (q load, partial store and its share of the
# combine) in key tiles, for choose_splits' cost model.
# "num_stages_v32": V3.2's 656 B records gain from a third stage (lab/perf-log.md, "Attention
# core rework"); V4 gains nothing from it and plain bf16 rows do not fit.
CONFIG = {"block_n": 64, "max_heads": 64, "num_warps": 8, "num_stages": 2, "prefetch": True,
          "split_overhead": 3, "dv": 1, "num_stages_v32": 3, "max_splits": None, "tiny": False,
          "tiled_bf16": False}
# Tiny launches (<= SMALL_UNITS token x head-block units): split the 512 output dims over two
# 4-warp programs ("dv": 2; both compute q·k), two of which fit on an SM: faster at batch 2,
# slower as soon as the batch fills the card (lab/perf-log.md, "Attention core rework"). Where
# the sm_90 warp-specialized kernel runs, tiny launches of two head blocks (h > 64) use it
# instead (faster: lab/perf-log.md, "Small head counts"), and so do those of one head block
# past ``SM90_TINY``.
SMALL_UNITS = 8
# Where the sm_90 kernel runs, a tiny launch also has at most "units" units of at most "tiles"
# 64-key tiles each (index columns): that kernel wins from 4 units up and, at 1-2 units, from
# 17 tiles up, where 16 tiles stay faster split (lab/perf-log.md, "Small head counts", "Tiny
# launches up to 16 tiles"). None: ``SMALL_UNITS`` alone.
SM90_TINY = {"units": 2, "tiles": 16}
CLUSTER_MIN_UNITS = SMALL_UNITS     # launches of more units run 2-CTA clusters where they can
# "max_splits": one combine program then merges at most 32 partial rows of 512 dims in one
# step; more cost it more than a second tile per split program saves (lab/perf-log.md,
# "FlashMLA timed per layer")
SMALL_CONFIG = {"dv": 2, "block_n": 32, "num_stages": 1, "num_stages_v32": 1, "max_splits": 32,
                "tiny": True}
# Tiny launches on sm_90 run a 64-row head block whatever the head count (rows past H masked):
# Triton issues wgmma for 64-row dots and mma.sync for 16- and 32-row ones, which were much
# slower at h8-h32 (lab/perf-log.md, "Small head counts"). Plain bf16 rows (no decoding) at
# <= 16 heads keep their 16-row block, faster there (same section). Elsewhere (mma.sync only)
# the smallest block that holds the heads stays.
SMALL_HEAD_BLOCK_SM90 = 64
# The sm_90 kernel's programs cost more than the model's 3 tiles each (ring fill and drain,
# partials, the combine launch): at 5, b74 / b148 V4 decode keep one split where 3 chose two,
# faster at h64 and h128, and no measured shape got slower (lab/perf-log.md, "V4 rows staged
# by cp.async"). The portable kernel keeps 3 (not re-measured).
SM90_CONFIG = {"split_overhead": 5}
# The combine launch that follows an sm_90 launch of more than one split, in key tiles, charged
# by ``choose_splits`` / ``plan_phases`` to every plan that splits. At 3 tiles a token (C128A
# rows: window 128 + 64) a split saves one tile and adds the partials and a combine launch of
# about the same cost: at 1, V4 b64 s_q1 h64 runs one split where 0 chose two, 1.13x faster
# (H200; lab/perf-log.md, "Short key lists"); no other bench_flashmla row changes plan
# (tests/ops/attention/test_split_model.py).
SPLIT_COMBINE_TILES = 1
# Shared memory one block may use (the opt-in maximum) by GPU capability: what the portable
# kernel's launch shape must fit. tests/ops/test_arch_compile.py compiles every kernel for each
# arch here and checks its use against this; a capability not listed takes the device's own
# ``shared_memory_per_block_optin``.
SHARED_PER_BLOCK = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024,
                    (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024,
                    (10, 3): 227 * 1024, (12, 0): 99 * 1024, (12, 1): 99 * 1024}
# Below sm_90's 227 KB per block the general shape keeps one stage of key rows and loads plain
# bf16 rows 64 dims at a time as the e4m3 rows are (``tiled_bf16``): two stages take up to
# 206 KB (V3.2 rows in blocks whose stride is no multiple of 16 bytes: unvectorized loads) and
# whole bf16 rows up to 200 KB (576-wide), more than sm_80's 163 KB; with these every format
# fits sm_86 / sm_89 / sm_120's 99 KB (tests/ops/test_arch_compile.py).
FULL_SHARED = 227 * 1024
LOW_SHARED_CONFIG = {"num_stages": 1, "num_stages_v32": 1, "tiled_bf16": True}


def shared_budget(device) -> Optional[int]:
    """The shared memory one block may use on ``device`` (None off CUDA or interpreted)."""
    if device.type != "cuda" or triton_interpreting():
        return None
    cap = torch.cuda.get_device_capability(device)
    if cap in SHARED_PER_BLOCK:
        return SHARED_PER_BLOCK[cap]
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin",
                   None)


def head_block(H, tiny, device, fmt):
    """The portable kernel's rows of q per program: the heads rounded up to a power of two (at
    least 16, at most ``max_heads``), or ``SMALL_HEAD_BLOCK_SM90`` in tiny launches on sm_90
    (but for plain bf16 rows in a 16-row block)."""
    hb = max(16, min(triton.next_power_of_2(H), CONFIG["max_heads"]))
    if tiny and _wgmma_device(device) and not (fmt == "plain_bf16" and hb == 16):
        hb = max(hb, SMALL_HEAD_BLOCK_SM90)
    return hb


def _wgmma_device(device) -> bool:
    """Whether Triton's dots on ``device`` run as sm_90 wgmma (not interpreted)."""
    return (device.type == "cuda" and not triton_interpreting()
            and torch.cuda.get_device_capability(device)[0] == 9)


def launch_config(T, n_hb, tiles, sm90=False, shared=None, sm90_tiny=True):
    """The launch shape of ``T`` tokens × ``n_hb`` head blocks over ``tiles`` 64-key tiles per
    token (index columns): tiny, sm_90 kernel or general (portable; ``LOW_SHARED_CONFIG``
    where ``shared``, the device's ``shared_budget``, is below ``FULL_SHARED``). Where the
    sm_90 kernel runs, ``sm90_tiny`` False keeps every launch on it (``V41_SM90_TINY``)."""
    units = T * n_hb
    tiny = units <= SMALL_UNITS
    if sm90:
        tiny = tiny and sm90_tiny and n_hb == 1 and (
            SM90_TINY is None or (units <= SM90_TINY["units"] and tiles <= SM90_TINY["tiles"]))
    cfg = dict(CONFIG)
    if tiny:
        cfg.update(SMALL_CONFIG)
    elif sm90:
        cfg.update(SM90_CONFIG)
    elif shared is not None and shared < FULL_SHARED:
        cfg.update(LOW_SHARED_CONFIG)
    return cfg


DEFAULT_SMS = 132       # CPU / interpreter launches: the H100/H200 SM count


def choose_splits(units, tiles, sms, overhead, max_splits=None, combine=0):
    """Splits per (token, head block) unit minimising the modelled makespan: programs run one
    per SM (the accumulator fills the register file) in waves of ``sms``, each costing its
    tiles plus ``overhead``, plus ``combine`` tiles for the combine launch of any plan with
    more than one split. E.g. 74 units × 10 tiles on 132 SMs: 1 split leaves 58 SMs idle
    (cost 11), 5 splits cost 3 waves × 3 = 9. Ties go to fewer splits (less partial traffic).
    At most ``max_splits`` (where given)."""
    best, best_cost = 1, None
    for s in range(1, max(1, min(tiles, max_splits or tiles)) + 1):
        cost = split_cost(units, s, tiles, sms, overhead, combine)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def split_cost(units, splits, tiles, sms, overhead, combine=0):
    """``wave_cost`` plus ``combine`` tiles where the launch splits (its combine launch)."""
    return wave_cost(units, splits, tiles, sms, overhead) + (combine if splits > 1 else 0)


def wave_cost(units, splits, tiles, sms, overhead):
    """The model's makespan (in tiles) of ``units`` units of ``tiles`` tiles cut into
    ``splits`` programs each: waves of ``sms`` programs, each costing its tiles plus
    ``overhead``."""
    return triton.cdiv(units * splits, sms) * (triton.cdiv(tiles, splits) + overhead)


def _sm_count(device):
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _blocks_aligned(cache, stride0, n=8):
    """Every block of ``cache`` (a uint8 view) starts at a multiple of ``n`` bytes."""
    return stride0 % n == 0 and cache.data_ptr() % n == 0


def _rows_vectorized(cache):
    """A plain cache whose base is 16-byte aligned and whose block and row strides are
    multiples of 16 elements (Triton's divisibility specialization): what the sm_90 kernel's
    cp.async row copies need to compile (a 520-element row stride failed to legalize its
    async copy on Triton 3.6)."""
    strides = [st for size, st in zip(cache.shape[:-1], cache.stride()[:-1]) if size > 1]
    return cache.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in strides)


def _tiles(k0, k1, width):
    """Tiles of ``width`` keys over both sources' index columns, each source padded to whole
    tiles (the kernels' virtual key list). ``launch_config`` counts in 64-key units, the
    kernels in their own ``block_n``."""
    return triton.cdiv(k0, width) + triton.cdiv(k1, width)


def plan_phases(T, n_hb, tiles, sms, overhead, combine=None):
    """The sm_90 kernel's launches as [(first token, end token, splits)]: one launch split by
    ``choose_splits``, or, where that leaves a last wave mostly idle, two: the tokens that
    fill whole waves one program per unit (no partials), then the rest split finely enough
    to spread over the card (plus their combine: one more program's cost). E.g. 148 units
    of 18 tiles on 132 SMs: one launch costs 3 waves × (9 + 5) = 42 (two splits); 132 units
    unsplit then 16 units × 6 splits cost 23 + 5 + (3 + 5) = 36. ``combine``: the tiles
    charged to a launch of several splits for its combine (None: ``SPLIT_COMBINE_TILES``)."""
    if combine is None:
        combine = SPLIT_COMBINE_TILES
    units = T * n_hb
    s = choose_splits(units, tiles, sms, overhead, combine=combine)
    full = units // sms * sms // n_hb       # tokens whose units fill whole waves
    if 0 < full < T:
        rest = (T - full) * n_hb
        s_rest = choose_splits(rest, tiles, sms, overhead, combine=combine)
        cost = (wave_cost(full * n_hb, 1, tiles, sms, overhead) + overhead
                + split_cost(rest, s_rest, tiles, sms, overhead, combine))
        if s_rest > 1 and cost < split_cost(units, s, tiles, sms, overhead, combine):
            return [(0, full, 1), (full, T, s_rest)]
    return [(0, T, s)]


def cluster_pays(fmt, units, tiles, sms):
    """Whether a launch of ``units`` token x head-block units of at most ``tiles`` key tiles
    each may run a token's two head blocks as a 2-CTA cluster (each CTA dequantizing half of
    every tile for both; the formats' own switches aside): not in tiny launches (slower there:
    lab/perf-log.md, "Two-launch schedule and 2-CTA clusters"), nor for V4 rows in one wave
    of fewer than ``tuning.CLUSTER_V4_MIN_TILES`` tiles a token (C128A layers' 192 keys at
    batch 64: one CTA a head block was 1.024 / 1.038x faster on the H200 / H100, the exchange
    costing more than half of three tiles' dequantization saves; lab/perf-history.md, "Issue 55:
    persistent programs over V4.1, V3.2 and prefill rows")."""
    from sparse_mla.ops.attention.sm90 import tuning
    if units <= CLUSTER_MIN_UNITS:
        return False
    return not (fmt == "v4" and units <= sms and tiles < tuning.CLUSTER_V4_MIN_TILES)


def persist_programs(T, n_hb, sms, fmt, staged, q_fp8, n_splits, cluster=False):
    """Programs a head block for a persistent launch of the sm_90 kernel over ``T`` tokens of
    ``n_hb`` head blocks (ops/attention/sm90/persist.py: each program runs tokens t, t + G, ...),
    or 0 for one program a token: V4 rows staged; V4.1 and V3.2 rows in 2-CTA clusters
    (``tuning.PERSIST_V41`` / ``PERSIST_V32``); a bf16 q,
    one split a token, and more units than ``sms`` (one wave gains nothing). As many programs
    as fit, or more where a program would get over ``tuning.PERSIST_TOKENS`` tokens."""
    from sparse_mla.ops.attention.sm90 import tuning
    rows = ((staged and fmt == "v4" and tuning.PERSIST_V4)
            or (cluster and fmt == SM90_V41 and tuning.PERSIST_V41)
            or (cluster and fmt == "v32" and tuning.PERSIST_V32))
    if not (rows and not q_fp8 and n_splits == 1):
        return 0
    slots = max(1, sms // n_hb)
    if T <= slots:
        return 0
    return max(slots, triton.cdiv(T, tuning.PERSIST_TOKENS))


# Launches whose splits are at most one tile each run the split kernel without its key loop
# (``ONE_TILE``), so q's arrival and the gather overlap: tiny launches a little faster, outputs
# bit-identical (lab/perf-log.md, "Tiny launches without the key loop").
ONE_TILE_FORM = True


def one_tile(max_tiles, n_splits):
    """Whether a portable launch of ``n_splits`` splits over at most ``max_tiles`` tiles per
    token runs the one-tile form: each split's run is at most ceil(tiles / splits) tiles."""
    return ONE_TILE_FORM and triton.cdiv(max_tiles, n_splits) == 1


# The sm_90 Gluon kernel compiles and runs on these Triton releases (major, minor), with the
# shims of ``sm90/compat.py``; each one was checked by compiling every launch variant for
# sm_90a (``sm90/variants.py``) and the GPU tests (lab/perf-history.md, "Triton 3.6-3.9"). A release
# outside the range falls back to the portable kernel, and ``plan_launch`` says so: a new
# Triton's Gluon API changes are found by tests/ops/attention/test_sm90_compile.py first.
SM90_TRITON = ((3, 6), (3, 9))


def _version(version: str):
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def sm90_triton_supported(version: str = triton.__version__) -> bool:
    """Whether ``version`` (a Triton version string) is in the range the sm_90 Gluon kernel
    is tested on (``SM90_TRITON``, inclusive)."""
    v = _version(version)
    return v is not None and SM90_TRITON[0] <= v <= SM90_TRITON[1]


def _sm90_switch() -> str:
    """The variable that turns the sm_90 kernel off: ``SPARSE_MLA_SM90``, or its old name
    ``SPARSE_MLA_GLUON`` where only that one is set (scripts of older checkouts set it)."""
    if "SPARSE_MLA_SM90" not in os.environ and "SPARSE_MLA_GLUON" in os.environ:
        return "SPARSE_MLA_GLUON"
    return "SPARSE_MLA_SM90"


def sm90_disabled_reason() -> Optional[str]:
    """Why the sm_90 Gluon kernel may not run in this process at all (None: it may)."""
    switch = _sm90_switch()
    if os.environ.get(switch, "1") == "0":
        return f"{switch}=0"
    if triton_interpreting():
        return "the Triton interpreter runs the portable kernel"
    if soft_fp8_forced():
        # the Gluon kernel converts e4m3 in hardware only; the forced software route runs
        # what a GPU below sm_89 runs, on any GPU (all of it, so a Hopper runs exactly that)
        return f"{SOFT_FP8_ENV}=1: the software e4m3 route's portable kernel, as below sm_89"
    if not sm90_triton_supported():
        lo, hi = SM90_TRITON
        return (f"Triton {triton.__version__} is outside the sm_90 kernel's tested range "
                f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}")
    return None


def sm90_enabled() -> bool:
    """Whether the sm_90 Gluon kernel may run in this process at all: a Triton in
    ``SM90_TRITON``, not interpreted, not turned off by ``SPARSE_MLA_SM90=0`` or by the
    forced software e4m3 route (``SPARSE_MLA_SOFT_FP8=1``). Each launch
    then checks its GPU and cache alignment (``sm90_route``)."""
    return sm90_disabled_reason() is None


def uses_e4m3(q, fmt) -> bool:
    """Whether a launch decodes e4m3: keys in the V4, V3.2 or plain e4m3 cache, or an e4m3 q."""
    return fmt != "plain_bf16" or q.dtype == torch.float8_e4m3fn


def soft_e4m3(q, fmt) -> str:
    """Why a launch of ``q`` over ``fmt`` keys decodes e4m3 in software ("" where it does not:
    no e4m3 to decode, or the GPU converts it)."""
    if not uses_e4m3(q, fmt):
        return ""
    return soft_fp8_reason(q.device) or ""


# Key tile of the portable kernel's general shape over 288 B rows where a block has less than
# ``FULL_SHARED``: their decoded tiles take twice the shared memory of the other records' (an
# sm_86 block ran out at 64- and 32-key tiles: tests/ops/test_arch_compile.py)
FP4_LOW_SHARED_BLOCK_N = 16


def record_config(cfg, fmts, shared):
    """``cfg`` (``launch_config``'s) adjusted for the records ``fmts`` the launch reads:
    ``FP4_LOW_SHARED_BLOCK_N`` for 288 B rows in the general shape below ``FULL_SHARED``."""
    fp4 = any(formats.V41_RECORD_OF.get(f) == "v41_fp4" for f in fmts)
    if fp4 and not cfg["tiny"] and shared is not None and shared < FULL_SHARED:
        cfg = dict(cfg, block_n=min(cfg["block_n"], FP4_LOW_SHARED_BLOCK_N))
    return cfg


# The V4.1 records (528 B MXFP8, 288 B NVFP4: docs/semantics.md §12). The sm_90 kernel's
# producer warps decode them in the pairs (main, extra) of ``SM90_V41_PAIRS`` (staged by
# cp.async: 16-byte-aligned blocks): 528 B main rows alone or with 528 B, 288 B or 584 B extra
# rows, a V4.1 layer's SWA and compressed caches. Other launches reading them (288 B main
# rows, 584 B main rows beside V4.1 ones) run the portable kernel on every GPU.
V41_RECORDS = ("v41", "v41_fp4", "v41_inline", "v41_fp4_inline")
# The token-inline layouts (vLLM 0.33) run the portable kernel on every GPU: the sm_90
# producers address page-footer rows (a TMA-free cp.async gather of a block's data rows, then
# its scale rows), and teaching them a second layout is a kernel change of its own
V41_INLINE = ("v41_inline", "v41_fp4_inline")
SM90_V41 = "v41"
SM90_V41_PAIRS = ((SM90_V41, None), (SM90_V41, SM90_V41), (SM90_V41, "v41_fp4"),
                   (SM90_V41, "v4"))
# the extra records beside 528 B main rows, as the plan's reason names them
_V41_EXTRA_BYTES = {"v41_fp4": "288 B", "v4": "584 B"}
# Whether V4.1 launches that the sm_90 kernel takes may still run the portable kernel's tiny
# shape (``SM90_TINY``, measured on V4 rows): off, the sm_90 kernel takes them however small,
# since the tiny shape decodes V4.1 records more slowly than V4's (lab/tools/bench_v41gluon.py
# times both routes)
V41_SM90_TINY = False


def sm90_route(q, fmt, blocks, extra_fmt=None):
    """(``sm90.kernel`` or None, why not) for one launch: its warp-specialized
    kernel serves sm_90, a Triton in ``SM90_TRITON``, keys in the V4 cache (8-byte-aligned
    blocks; 16-byte-aligned ones are gathered by cp.async through a staging buffer), the
    V4.1 528 B cache alone or with a 528 B, 288 B or 584 B extra cache (``SM90_V41_PAIRS``;
    16-byte-aligned blocks, staged likewise), the V3.2
    cache (16-byte-aligned blocks: the RoPE dims are copied with 16-byte cp.async) or a plain
    bf16 / e4m3 cache of 512- or 576-wide rows (``plan_launch`` still keeps tiny launches that
    ``launch_config`` gives the output-dim split on the portable kernel). ``blocks``: each
    source's (cache, block stride) as the kernels get them. ``SPARSE_MLA_SM90=0`` turns it
    off (A/B runs, bisecting)."""
    reason = sm90_disabled_reason()
    if reason is not None:
        return None, reason
    v41_pair = (fmt, extra_fmt) in SM90_V41_PAIRS
    if fmt in V41_INLINE or extra_fmt in V41_INLINE:
        pair = fmt if extra_fmt is None else f"{fmt} + {extra_fmt}"
        return None, (f"{pair} rows: the sm_90 kernel decodes V4.1 records in the page-footer "
                      "layout only (vLLM 0.32); token-inline ones (vLLM 0.33) run the portable "
                      "kernel")
    if (fmt in V41_RECORDS or extra_fmt in V41_RECORDS) and not v41_pair:
        pair = fmt if extra_fmt is None else f"{fmt} + {extra_fmt}"
        return None, (f"{pair} rows (V4.1 records): the sm_90 kernel decodes 528 B main rows "
                      "alone or with 528 B, 288 B or 584 B extra rows, the portable kernel "
                      "the rest")
    if extra_fmt is not None and extra_fmt != fmt and not v41_pair:
        return None, f"{fmt} + {extra_fmt} sources: the sm_90 kernel takes one format"
    if q.device.type != "cuda":
        return None, f"tensors on {q.device.type}, the sm_90 kernel needs CUDA"
    cap = torch.cuda.get_device_capability(q.device)
    if cap != (9, 0):
        return None, f"GPU capability sm_{cap[0]}{cap[1]}, the Gluon kernel is sm_90 only"
    need = {"v4": 8, "v32": 16, SM90_V41: 16}.get(fmt)
    if need is not None and not all(_blocks_aligned(c, s0, need) for c, s0 in blocks):
        return None, f"{fmt} cache blocks not all {need}-byte aligned"
    if fmt in ("plain_bf16", "plain_fp8") and not all(_rows_vectorized(c) for c, _ in blocks):
        return None, (f"{fmt} rows not 16-element strided or 16-byte based: the sm_90 kernel "
                      "copies them by 16-byte cp.async")
    try:
        from sparse_mla.ops.attention.sm90 import kernel
    except ImportError as exc:     # Triton without Gluon (< 3.5)
        return None, f"the Gluon kernel does not import ({exc})"
    return kernel, None


def plan_launch(q, fmt, blocks, T, n_hb, k0, k1, *, heads, sms, extra_fmt=None):
    """The route, launch shape and split plan of one call: ``T`` tokens of ``heads`` heads
    (``n_hb`` head blocks) over index lists of ``k0`` + ``k1`` columns in caches of format ``fmt``
    (``blocks``: each source's (cache, block stride); ``extra_fmt``: the second source's
    format where there is one; ``sms``: the device's SM count).
    Returns (LaunchPlan, launch config, the Gluon kernel module or None); ``run`` launches
    it."""
    soft = soft_e4m3(q, fmt)
    g, why_not = sm90_route(q, fmt, blocks, extra_fmt)
    shared = shared_budget(q.device)
    tiles = _tiles(k0, k1, 64)
    cfg = record_config(launch_config(T, n_hb, tiles, sm90=g is not None,
                                      shared=shared, sm90_tiny=fmt != SM90_V41 or V41_SM90_TINY),
                        (fmt, extra_fmt), shared)
    units = T * n_hb
    if g is not None and cfg["dv"] != 1:
        g = None
        why_not = (f"tiny launch of one head block ({units} units of at most "
                   f"{tiles} key tiles: SM90_TINY)")
    if g is None:
        route = "tiny" if cfg["tiny"] else "portable"
        return LaunchPlan(route, why_not or "the portable kernel", soft_e4m3=soft), cfg, None
    from sparse_mla.ops.attention.sm90 import tuning
    # the sm_90 kernel gathers V4 rows by 16-byte cp.async when every block allows it
    staged = ((fmt == "v4" and tuning.STAGE_V4
               and all(_blocks_aligned(c, s0, 16) for c, s0 in blocks))
              or fmt == SM90_V41)     # always staged (sm90_route: 16-byte aligned)
    # two head blocks of a token share their dequantized rows as a 2-CTA cluster
    cluster = (n_hb == 2 and cluster_pays(fmt, units, tiles, sms)
               and ((staged and fmt == "v4" and tuning.CLUSTER_V4)
                    or (fmt == "v32" and tuning.CLUSTER_V32)
                    or (fmt == SM90_V41 and tuning.CLUSTER_V41)))
    if cluster:
        rows = f"{fmt} + {extra_fmt}" if extra_fmt not in (None, fmt) else fmt
        reason = (f"{rows} rows at {heads} heads: each token's two head blocks as one 2-CTA "
                  "cluster")
    else:
        reason = f"sm_90, {fmt} rows, Triton {triton.__version__}"
        if fmt == SM90_V41:
            extra = _V41_EXTRA_BYTES.get(extra_fmt)
            reason += (", V4.1 528 B" + (f" + {extra}" if extra else "")
                       + " rows staged by cp.async")
        elif staged:
            reason += ", V4 rows staged by cp.async"
    return LaunchPlan("sm90_cluster" if cluster else "sm90", reason, staged=staged), cfg, g
