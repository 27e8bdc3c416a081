"""The attention core's launch plan: which kernel route a call takes, with what shape and
splits, and why, decided before anything launches.

``plan_launch(q, sources)`` returns a frozen :class:`LaunchPlan` for one call of the attention
core; ``launch.execute`` only carries it out. The routes:

* ``sm90``: the warp-specialized sm_90 kernel (ops/attention/sm90/kernel.py), one CTA per
  (token, head block) unit and split, or persistent programs over several tokens;
* ``sm90_cluster``: the same kernel with the token's two head blocks as a 2-CTA cluster
  (V4 / V3.2 / V4.1 rows at 65-128 heads);
* ``tiny``: the portable kernel's small-launch shape (ops/attention/portable.py: the 512
  output dims split over two 4-warp programs);
* ``portable``: the portable Triton split kernel (ops/attention/portable.py).

Split counts come from a wave cost model (``choose_splits`` / ``plan_phases``). Every setting
comes from a ``policy.Policy`` and every device property from :class:`DeviceFacts`, both
arguments, so a test or an A/B tool passes what it wants instead of patching this module. The
plan names the file of its kernel (``kernel_file``) and says why (``reason``);
``dispatch.explain`` prints it before a run and ``dispatch.last_choice`` after one. Pure Python:
no kernel is imported here, so the Triton version check runs before the sm_90 kernel (whose
import installs a process-wide compile hook, ``sm90/hooks.py``) is ever loaded.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Optional, Sequence

import torch
import triton

from sparse_mla.ops.attention import policy as policies
from sparse_mla.ops.attention.policy import DEFAULT, Policy, Shape
from sparse_mla.ops.common import checks, formats
from sparse_mla.ops.common.dispatch import soft_fp8_forced, triton_interpreting
from sparse_mla.ops.common.triton_utils import SOFT_FP8_ENV, soft_fp8_reason

ROUTES = ("portable", "tiny", "sm90", "sm90_cluster")
# The file that holds each route's split kernel, relative to the checkout (the ``sparse_mla``
# package root): what ``LaunchPlan`` names, so a reader goes from ``explain`` to the code
KERNEL_FILES = {"portable": "ops/attention/portable.py", "tiny": "ops/attention/portable.py",
                "sm90": "ops/attention/sm90/kernel.py",
                "sm90_cluster": "ops/attention/sm90/kernel.py"}
RECORD_FORMATS = ("v4", "v32") + tuple(formats.V41_RECORD_OF)
PLAIN_FORMATS = ("plain_bf16", "plain_fp8")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One launch of the split kernel: tokens [t0, t1) in ``splits`` programs each;
    ``programs``: programs a head block where they are persistent (each runs tokens t,
    t + programs, ...: ops/attention/sm90/persist.py), 0 for one program a token."""
    t0: int
    t1: int
    splits: int
    programs: int = 0


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """One call's launches, complete before any runs. ``route``: one of ``ROUTES``;
    ``reason``: why (for a portable or tiny route on a GPU, why not the sm_90 kernel);
    ``shape``: the portable kernel's launch shape (``policy.Shape``; on sm_90 routes its split
    model's); ``phases``: the split-kernel launches; ``combined``: whether a combine kernel
    merges splits; ``staged``: V4 rows gathered by cp.async (sm_90 routes); ``head_block``:
    rows of q a portable program holds; ``one_tile``: portable splits of at most one tile run
    without the key loop (q's arrival and the gather overlap; outputs bit-identical);
    ``q_cast``: the dtype an e4m3 q is cast to before the portable launch (None: as it is);
    ``fp16_dots``: plain e4m3 keys with an e4m3 q run the dots on fp16 operands (exact; one
    conversion per two bytes where bf16 needs three: faster on both kernels);
    ``soft_e4m3``: why the launch decodes e4m3 in software ("sm_80", "forced",
    "interpreter"), "" where it decodes none or in hardware. The rest is what the plan was
    made for (``check_fits`` compares a later call's arguments with it)."""
    route: str
    reason: str
    shape: Shape
    phases: tuple
    tokens: int
    heads: int
    head_blocks: int
    fmt: str
    extra_fmt: Optional[str]
    widths: tuple
    q_dtype: torch.dtype
    device: torch.device
    combined: bool = False
    staged: bool = False
    head_block: int = 0
    one_tile: bool = False
    q_cast: Optional[torch.dtype] = None
    fp16_dots: bool = False
    soft_e4m3: str = ""
    policy: Policy = DEFAULT

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
    def sm90(self) -> bool:
        return self.route in ("sm90", "sm90_cluster")

    @property
    def cluster(self) -> bool:
        return self.route == "sm90_cluster"

    @property
    def persist(self) -> int:
        """Programs a head block of a persistent launch, 0 where none is."""
        return max((p.programs for p in self.phases), default=0)

    def __str__(self):
        splits = ", ".join(f"tokens {p.t0}-{p.t1}: {p.splits} split{'s' * (p.splits > 1)}"
                           + (f" in {p.programs} persistent programs a head block"
                              if p.programs else "")
                           for p in self.phases)
        return (f"{self.label} ({self.reason}; kernel in {self.kernel_file})"
                + (f" [{splits}]" if splits else ""))

    def check_fits(self, q, sources) -> None:
        """Raise ValueError naming what differs where a call of ``q`` over ``sources`` is not
        the kind this plan was made for (its tokens, heads, dtype, device, formats, index
        widths, or alignment the route relies on): a plan is reused only where it is the one
        ``plan_launch`` would make."""
        got = _call_key(q, sources)
        want = (self.tokens, self.heads, self.q_dtype, self.device, self.fmt, self.extra_fmt,
                self.widths)
        names = ("tokens", "heads", "q dtype", "device", "format", "extra format",
                 "index widths")
        for name, g, w in zip(names, got, want):
            if g != w:
                raise ValueError(f"this launch plan was made for {name} {w}, the call has {g}")
        if self.sm90:
            why = _alignment_reason(self.fmt, cache_blocks(sources))
            if why is None and self.staged and not _all_aligned(cache_blocks(sources), 16):
                why = "V4 cache blocks not all 16-byte aligned (the plan stages them)"
            if why is not None:
                raise ValueError(f"this launch plan runs the sm_90 kernel, but {why}")


def _call_key(q, sources) -> tuple:
    src1 = sources[1] if len(sources) > 1 else None
    return (q.shape[0], q.shape[1], q.dtype, q.device, sources[0].fmt,
            src1.fmt if src1 is not None else None,
            tuple(s.indices.shape[1] for s in sources))


# ---------------------------------------------------------------------------------------------
# The device: what the plan depends on that is not a setting

# Shared memory one block may use (the opt-in maximum) by GPU capability: what the portable
# kernel's launch shape must fit. tests/ops/test_arch_compile.py compiles every kernel for each
# arch here and checks its use against this; a capability not listed takes the device's own
# ``shared_memory_per_block_optin``.
SHARED_PER_BLOCK = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024,
                    (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024,
                    (10, 3): 227 * 1024, (12, 0): 99 * 1024, (12, 1): 99 * 1024}
# sm_90's shared memory per block: the portable kernel's general shape needs this much
# (below it, ``Policy.low_shared``)
FULL_SHARED = 227 * 1024
DEFAULT_SMS = 132       # CPU / interpreter launches: the H100/H200 SM count


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What planning needs of the device a call runs on: ``capability`` (None off CUDA or
    interpreted), ``sms``, ``shared`` (bytes per block, None off CUDA or interpreted),
    ``triton`` (the version string)."""
    capability: Optional[tuple] = None
    sms: int = DEFAULT_SMS
    shared: Optional[int] = None
    triton: str = triton.__version__

    @property
    def wgmma(self) -> bool:
        """Whether Triton's dots run as sm_90 wgmma here."""
        return self.capability is not None and self.capability[0] == 9


@functools.lru_cache(maxsize=None)
def _cuda_facts(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    cap = (props.major, props.minor)
    shared = SHARED_PER_BLOCK.get(cap, getattr(props, "shared_memory_per_block_optin", None))
    return DeviceFacts(cap, props.multi_processor_count, shared)


def device_facts(device) -> DeviceFacts:
    """The facts of ``device`` (asked of the driver once per GPU)."""
    device = torch.device(device)
    if device.type != "cuda" or triton_interpreting():
        return DeviceFacts()
    return _cuda_facts(device.index if device.index is not None
                       else torch.cuda.current_device())


def shared_budget(device) -> Optional[int]:
    """The shared memory one block may use on ``device`` (None off CUDA or interpreted)."""
    return device_facts(device).shared


# ---------------------------------------------------------------------------------------------
# The launch shape and the split model

def head_block(H, tiny, facts: DeviceFacts, fmt, policy: Policy = DEFAULT):
    """The portable kernel's rows of q per program: the heads rounded up to a power of two (at
    least 16, at most ``max_heads``), or ``tiny_head_block_sm90`` in tiny launches on sm_90
    (but for plain bf16 rows in a 16-row block, faster there: "Small head counts")."""
    hb = max(16, min(triton.next_power_of_2(H), policy.max_heads))
    if tiny and facts.wgmma and not (fmt == "plain_bf16" and hb == 16):
        hb = max(hb, policy.tiny_head_block_sm90)
    return hb


def launch_config(T, n_hb, tiles, sm90=False, shared=None, sm90_tiny=True,
                  policy: Policy = DEFAULT) -> Shape:
    """The launch shape of ``T`` tokens × ``n_hb`` head blocks over ``tiles`` 64-key tiles per
    token (index columns): tiny, sm_90 kernel or general (``policy.low_shared`` where
    ``shared``, the device's shared memory per block, is below ``FULL_SHARED``). Where the
    sm_90 kernel runs, ``sm90_tiny`` False keeps every launch on it."""
    units = T * n_hb
    tiny = units <= policy.small_units
    if sm90:
        tiny = (tiny and sm90_tiny and n_hb == 1 and units <= policy.sm90_tiny_units
                and tiles <= policy.sm90_tiny_tiles)
    if tiny:
        return policy.tiny
    if sm90:
        return dataclasses.replace(policy.general, split_overhead=policy.sm90_split_overhead)
    if shared is not None and shared < FULL_SHARED:
        return policy.low_shared
    return policy.general


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


def plan_phases(T, n_hb, tiles, sms, overhead, combine=DEFAULT.split_combine_tiles):
    """The sm_90 kernel's launches as [(first token, end token, splits)]: one launch split by
    ``choose_splits``, or, where that leaves a last wave mostly idle, two: the tokens that
    fill whole waves one program per unit (no partials), then the rest split finely enough
    to spread over the card (plus their combine: one more program's cost). E.g. 148 units
    of 18 tiles on 132 SMs: one launch costs 3 waves × (9 + 5) = 42 (two splits); 132 units
    unsplit then 16 units × 6 splits cost 23 + 5 + (3 + 5) = 36. ``combine``: the tiles
    charged to a launch of several splits for its combine (``Policy.split_combine_tiles``)."""
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


def cluster_pays(fmt, units, tiles, sms, policy: Policy = DEFAULT):
    """Whether a launch of ``units`` token x head-block units of at most ``tiles`` key tiles
    each may run a token's two head blocks as a 2-CTA cluster (each CTA dequantizing half of
    every tile for both): not in tiny launches (slower there: "Two-launch schedule and 2-CTA
    clusters"), nor for V4 rows in one wave of fewer than ``cluster_v4_min_tiles`` tiles a
    token."""
    if not policy.clusters or units <= policy.cluster_min_units:
        return False
    return not (fmt == "v4" and units <= sms and tiles < policy.cluster_v4_min_tiles)


def persist_programs(T, n_hb, sms, fmt, staged, q_fp8, n_splits, cluster=False,
                     policy: Policy = DEFAULT):
    """Programs a head block for a persistent launch of the sm_90 kernel over ``T`` tokens of
    ``n_hb`` head blocks (each program runs tokens t, t + G, ...), or 0 for one program a
    token: V4 rows staged; V4.1 and V3.2 rows in 2-CTA clusters (V4.1: 1.057-1.062x on H100 /
    H200, not at 64 heads, where 3.7 / 3.8's ptxas spills that variant; V3.2: 1.001-1.037x:
    lab/perf-history.md, "Issue 55"); a bf16 q, one split a token, and more units than ``sms``
    (one wave gains nothing). As many programs as fit, or more where a program would get over
    ``sm90.persist_tokens`` tokens."""
    rows = ((staged and fmt == "v4") or (cluster and fmt in (SM90_V41, "v32")))
    if not (policy.persistent and rows and not q_fp8 and n_splits == 1):
        return 0
    slots = max(1, sms // n_hb)
    if T <= slots:
        return 0
    return max(slots, triton.cdiv(T, policy.sm90.persist_tokens))


def one_tile(max_tiles, n_splits):
    """Whether a portable launch of ``n_splits`` splits over at most ``max_tiles`` tiles per
    token runs the one-tile form: each split's run is at most ceil(tiles / splits) tiles
    ("Tiny launches without the key loop")."""
    return triton.cdiv(max_tiles, n_splits) == 1


# ---------------------------------------------------------------------------------------------
# Whether the sm_90 kernel may run

# The sm_90 kernel compiles and runs on these Triton releases (major, minor), with the shims of
# ``sm90/compat.py``; each one was checked by compiling every launch variant for sm_90a
# (``sm90/variants.py``) and the GPU tests. A release outside the range falls back to the
# portable kernel, and the plan says so: a new Triton's Gluon API changes are found by
# tests/ops/attention/test_sm90_compile.py first.
SM90_TRITON = ((3, 6), (3, 9))


def _version(version: str):
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def sm90_triton_supported(version: str = triton.__version__) -> bool:
    """Whether ``version`` (a Triton version string) is in the range the sm_90 kernel is
    tested on (``SM90_TRITON``, inclusive)."""
    v = _version(version)
    return v is not None and SM90_TRITON[0] <= v <= SM90_TRITON[1]


def _sm90_switch() -> str:
    """The variable that turns the sm_90 kernel off (A/B runs, bisecting): ``SPARSE_MLA_SM90``,
    or its old name ``SPARSE_MLA_GLUON`` where only that one is set (older scripts set it)."""
    if "SPARSE_MLA_SM90" not in os.environ and "SPARSE_MLA_GLUON" in os.environ:
        return "SPARSE_MLA_GLUON"
    return "SPARSE_MLA_SM90"


def sm90_disabled_reason(version: str = triton.__version__) -> Optional[str]:
    """Why the sm_90 kernel may not run in this process at all (None: it may)."""
    switch = _sm90_switch()
    if os.environ.get(switch, "1") == "0":
        return f"{switch}=0"
    if triton_interpreting():
        return "the Triton interpreter runs the portable kernel"
    if soft_fp8_forced():
        # the sm_90 kernel converts e4m3 in hardware only; the forced software route runs
        # what a GPU below sm_89 runs, on any GPU (all of it, so a Hopper runs exactly that)
        return f"{SOFT_FP8_ENV}=1: the software e4m3 route's portable kernel, as below sm_89"
    if not sm90_triton_supported(version):
        lo, hi = SM90_TRITON
        return (f"Triton {version} is outside the sm_90 kernel's tested range "
                f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}")
    return None


def sm90_enabled() -> bool:
    """Whether the sm_90 kernel may run in this process at all: a Triton in ``SM90_TRITON``,
    not interpreted, not turned off (``SPARSE_MLA_SM90=0``) or by the forced software e4m3
    route (``SPARSE_MLA_SOFT_FP8=1``). Each launch then checks its GPU and cache alignment
    (``sm90_route``)."""
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


def cache_view(src):
    """(cache tensor as the kernels address it, block stride in its elements, row stride) of a
    ``reference.KeySource``: a uint8 view of a record cache, the plain cache as it is (an e4m3
    one as uint8)."""
    if src.fmt in RECORD_FORMATS:
        fmt = formats.get_format(src.fmt)
        raw = src.cache.view(torch.uint8) if src.cache.dtype != torch.uint8 else src.cache
        return raw, checks.block_stride(src.cache, fmt, src.block_size), 0
    cache = src.cache.view(torch.uint8) if src.fmt == "plain_fp8" else src.cache
    return cache, src.cache.stride(0), src.cache.stride(1)


def cache_blocks(sources) -> list:
    """Each source's (cache as addressed, block stride) pair, as the alignment checks take
    them."""
    return [cache_view(s)[:2] for s in sources]


def blocks_aligned(cache, stride0, n=8):
    """Every block of ``cache`` (as addressed) starts at a multiple of ``n`` bytes."""
    return stride0 % n == 0 and cache.data_ptr() % n == 0


def _all_aligned(blocks, n):
    return all(blocks_aligned(c, s0, n) for c, s0 in blocks)


def _rows_vectorized(cache):
    """A plain cache whose base is 16-byte aligned and whose block and row strides are
    multiples of 16 elements (Triton's divisibility specialization): what the sm_90 kernel's
    cp.async row copies need to compile (a 520-element row stride failed to legalize its
    async copy on Triton 3.6)."""
    strides = [st for size, st in zip(cache.shape[:-1], cache.stride()[:-1]) if size > 1]
    return cache.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in strides)


def _alignment_reason(fmt, blocks) -> Optional[str]:
    need = {"v4": 8, "v32": 16, SM90_V41: 16}.get(fmt)
    if need is not None and not _all_aligned(blocks, need):
        return f"{fmt} cache blocks not all {need}-byte aligned"
    if fmt in PLAIN_FORMATS and not all(_rows_vectorized(c) for c, _ in blocks):
        return (f"{fmt} rows not 16-element strided or 16-byte based: the sm_90 kernel "
                "copies them by 16-byte cp.async")
    return None


def tiles(k0, k1, width):
    """Tiles of ``width`` keys over both sources' index columns, each source padded to whole
    tiles (the kernels' virtual key list)."""
    return triton.cdiv(k0, width) + triton.cdiv(k1, width)


def record_config(cfg: Shape, fmts, shared, policy: Policy = DEFAULT) -> Shape:
    """``cfg`` adjusted for the records ``fmts`` the launch reads: ``fp4_low_shared_block_n``
    for 288 B rows in the general shape below ``FULL_SHARED``."""
    fp4 = any(formats.V41_RECORD_OF.get(f) == "v41_fp4" for f in fmts)
    if fp4 and not cfg.tiny and shared is not None and shared < FULL_SHARED:
        return dataclasses.replace(cfg, block_n=min(cfg.block_n, policy.fp4_low_shared_block_n))
    return cfg


# The V4.1 records (528 B MXFP8, 288 B NVFP4: docs/semantics.md §12). The sm_90 kernel's
# producer warps decode them in the pairs (main, extra) of ``SM90_V41_PAIRS`` (staged by
# cp.async: 16-byte-aligned blocks): 528 B main rows alone or with 528 B, 288 B or 584 B extra
# rows, a V4.1 layer's SWA and compressed caches. Other launches reading them (288 B main
# rows, 584 B main rows beside V4.1 ones) run the portable kernel on every GPU. The sm_90
# kernel takes every V4.1 launch it can, however small: the portable tiny shape decodes V4.1
# records more slowly than V4's (lab/tools/bench_v41gluon.py times both routes).
V41_RECORDS = tuple(formats.V41_RECORD_OF)
# The token-inline layouts (vLLM 0.33) run the portable kernel on every GPU: the sm_90
# producers address page-footer rows (a TMA-free cp.async gather of a block's data rows, then
# its scale rows), and teaching them a second layout is a kernel change of its own
V41_INLINE = ("v41_inline", "v41_fp4_inline")
SM90_V41 = "v41"
SM90_V41_PAIRS = ((SM90_V41, None), (SM90_V41, SM90_V41), (SM90_V41, "v41_fp4"),
                  (SM90_V41, "v4"))
# the extra records beside 528 B main rows, as the plan's reason names them
_V41_EXTRA_BYTES = {"v41_fp4": "288 B", "v4": "584 B"}


def sm90_route(q, fmt, blocks, extra_fmt=None, facts: Optional[DeviceFacts] = None):
    """``(True, None)`` where the sm_90 kernel may run one launch, else ``(False, why not)``.
    It serves sm_90, a Triton in ``SM90_TRITON``, keys in the V4 cache
    (8-byte-aligned blocks; 16-byte-aligned ones are gathered by cp.async through a staging
    buffer), the V4.1 528 B cache alone or with a 528 B, 288 B or 584 B extra cache
    (``SM90_V41_PAIRS``; 16-byte-aligned blocks, staged likewise), the V3.2 cache (16-byte-
    aligned blocks: the RoPE dims are copied with 16-byte cp.async) or a plain bf16 / e4m3
    cache of 512- or 576-wide rows. ``blocks``: each source's (cache, block stride) as the
    kernels address them (``cache_blocks``). ``SPARSE_MLA_SM90=0`` turns it off."""
    facts = facts if facts is not None else device_facts(q.device)
    reason = sm90_disabled_reason(facts.triton)
    if reason is not None:
        return False, reason
    v41_pair = (fmt, extra_fmt) in SM90_V41_PAIRS
    pair = fmt if extra_fmt is None else f"{fmt} + {extra_fmt}"
    if fmt in V41_INLINE or extra_fmt in V41_INLINE:
        return False, (f"{pair} rows: the sm_90 kernel decodes V4.1 records in the "
                       "page-footer layout only (vLLM 0.32); token-inline ones (vLLM 0.33) "
                       "run the portable kernel")
    if (fmt in V41_RECORDS or extra_fmt in V41_RECORDS) and not v41_pair:
        return False, (f"{pair} rows (V4.1 records): the sm_90 kernel decodes 528 B main rows "
                       "alone or with 528 B, 288 B or 584 B extra rows, the portable kernel "
                       "the rest")
    if extra_fmt is not None and extra_fmt != fmt and not v41_pair:
        return False, f"{pair} sources: the sm_90 kernel takes one format"
    if q.device.type != "cuda":
        return False, f"tensors on {q.device.type}, the sm_90 kernel needs CUDA"
    if facts.capability != (9, 0):
        cap = facts.capability
        return False, f"GPU capability sm_{cap[0]}{cap[1]}, the sm_90 kernel is sm_90 only"
    why = _alignment_reason(fmt, blocks)
    if why is not None:
        return False, why
    return True, None


def plan_launch(q, sources: Sequence, *, policy: Optional[Policy] = None,
                facts: Optional[DeviceFacts] = None) -> LaunchPlan:
    """The complete plan of one call of the attention core: ``q`` [T, H, D] over ``sources``
    (``reference.KeySource``, one or two), under ``policy`` (``policy.DEFAULT``) on the device
    ``facts`` describe (``device_facts(q.device)``)."""
    policy = policy or policies.current()
    facts = facts if facts is not None else device_facts(q.device)
    T, H = q.shape[0], q.shape[1]
    src0, src1 = sources[0], (sources[1] if len(sources) > 1 else None)
    fmt, extra_fmt = src0.fmt, (src1.fmt if src1 is not None else None)
    k0, k1 = src0.indices.shape[1], (src1.indices.shape[1] if src1 is not None else 0)
    n_hb = triton.cdiv(H, policy.max_heads)     # head blocks are max_heads wide past it
    blocks = cache_blocks(sources)
    q_fp8 = q.dtype == torch.float8_e4m3fn
    soft = soft_e4m3(q, fmt)
    common = dict(tokens=T, heads=H, head_blocks=n_hb, fmt=fmt, extra_fmt=extra_fmt,
                  widths=(k0,) + ((k1,) if src1 is not None else ()), q_dtype=q.dtype,
                  device=q.device, policy=policy)
    ok, why_not = sm90_route(q, fmt, blocks, extra_fmt, facts)
    n_tiles = tiles(k0, k1, 64)
    cfg = record_config(launch_config(T, n_hb, n_tiles, sm90=ok, shared=facts.shared,
                                      sm90_tiny=fmt != SM90_V41, policy=policy),
                        (fmt, extra_fmt), facts.shared, policy)
    units = T * n_hb
    if ok and cfg.dv != 1:
        ok, why_not = False, (f"tiny launch of one head block ({units} units of at most "
                              f"{n_tiles} key tiles: Policy.sm90_tiny_units / _tiles)")
    # the kernel cuts each token's own key list (lengths applied) into runs of whole tiles,
    # so at most this many tiles ever exist
    max_tiles = max(1, tiles(k0, k1, cfg.block_n))
    fp16_dots = fmt == "plain_fp8" and q_fp8 and not triton_interpreting()
    if not ok:
        return _portable_plan(q, cfg, why_not, soft, max_tiles, fp16_dots, facts, common)
    # V4 rows are gathered by 16-byte cp.async where every block allows it; V4.1 rows always
    # (sm90_route: 16-byte aligned)
    staged = (fmt == "v4" and _all_aligned(blocks, 16)) or fmt == SM90_V41
    cluster = (n_hb == 2 and fmt in ("v4", "v32", SM90_V41)
               and (staged or fmt != "v4") and cluster_pays(fmt, units, n_tiles, facts.sms,
                                                            policy))
    if cluster:
        rows = f"{fmt} + {extra_fmt}" if extra_fmt not in (None, fmt) else fmt
        reason = f"{rows} rows at {H} heads: each token's two head blocks as one 2-CTA cluster"
    else:
        reason = f"sm_90, {fmt} rows, Triton {facts.triton}"
        if fmt == SM90_V41:
            extra = _V41_EXTRA_BYTES.get(extra_fmt)
            reason += (", V4.1 528 B" + (f" + {extra}" if extra else "")
                       + " rows staged by cp.async")
        elif staged:
            reason += ", V4 rows staged by cp.async"
    if policy.phases is not None:
        split_phases = [(a, T if b is None else b, n) for a, b, n in policy.phases]
    elif policy.splits is not None:
        split_phases = [(0, T, policy.splits)]
    else:
        split_phases = plan_phases(T, n_hb, max_tiles, facts.sms, cfg.split_overhead,
                                   policy.split_combine_tiles)
    phases = []
    for t0, t1, n_splits in split_phases:
        # persistent programs (each running several tokens) where they pay
        progs = (persist_programs(t1 - t0, n_hb, facts.sms, fmt, staged, q_fp8, n_splits,
                                  cluster, policy) if len(split_phases) == 1 else 0)
        phases.append(Phase(t0, t1, n_splits, progs))
    return LaunchPlan("sm90_cluster" if cluster else "sm90", reason, cfg, tuple(phases),
                      combined=any(p.splits > 1 for p in phases), staged=staged,
                      fp16_dots=fp16_dots, **common)


def _portable_plan(q, cfg, why_not, soft, max_tiles, fp16_dots, facts, common):
    """The portable kernel's plan: one launch, split by ``choose_splits`` in waves of one
    program per SM even where two 4-warp programs fit (dv 2: twice the splits were slower,
    "FlashMLA timed per layer")."""
    T, H, n_hb, fmt = common["tokens"], common["heads"], common["head_blocks"], common["fmt"]
    n_splits = common["policy"].splits or choose_splits(T * n_hb * cfg.dv, max_tiles, facts.sms,
                                                        cfg.split_overhead, cfg.max_splits)
    q_cast = None
    if q.dtype == torch.float8_e4m3fn and (cfg.dv == 1 or (soft and soft != "interpreter")):
        # exact (e4m3 ⊂ bf16). Decoded in the kernel, Triton keeps a computed q as a register
        # wgmma operand for the whole key loop (64 registers: the fp8 path spilled and ran
        # slower than bf16); one elementwise pass first keeps q in shared memory. Tiny
        # launches (one or two tiles per program) decode in the kernel: the extra launch
        # would cost them more ("Attention core rework") — except on the software e4m3
        # route, where decoding a whole q block in integer arithmetic spilled tens of KB of
        # registers (tests/ops/test_arch_compile.py, SPILL_BOUND); torch's cast is exact on
        # any GPU. (Interpreted launches keep the in-kernel decode tested.)
        q_cast = torch.float16 if fp16_dots else torch.bfloat16
    return LaunchPlan("tiny" if cfg.tiny else "portable", why_not or "the portable kernel",
                      cfg, (Phase(0, T, n_splits),), combined=True,
                      head_block=head_block(H, cfg.tiny, facts, fmt, common["policy"]),
                      one_tile=one_tile(max_tiles, n_splits), q_cast=q_cast,
                      fp16_dots=fp16_dots, soft_e4m3=soft, **common)
