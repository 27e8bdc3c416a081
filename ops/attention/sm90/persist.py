"""Persistent launches of the sm_90 kernel (``PERSIST``): G programs (2-CTA clusters at 128
heads) a head block, each running tokens tp, tp + G, ... of the launch one after another,
one split each, instead of one program per token.

Short key lists pay a whole program's start and end per token otherwise (barrier set-up, the
first gather's latency, the epilogue's drain before the next program may start on the SM):
about half of a 3-tile program's time on the C128A rows, window 128 + 64 (lab/perf-log.md,
"Short key lists"). In a persistent program the producer gathers the next token's tiles while
the consumers finish the last one's. What changes against one token a program:

* the ring's tile count runs on across tokens (stage and phase of tile g0 + i, g0 the tiles of
  the program's earlier tokens), so the producer fills ahead of the consumers' token boundary;
* each consumer writes its half of the output rows through its half of the token's last
  stage (lead: dims [0, 256), follow: [256, 512); each reads only its own half of a stage's
  values) and releases that stage after its epilogue: the stage a one-token program writes
  through is the next token's first one here. A token without keys stores zeros directly;
* ``_lead`` waits for ``rows_free`` (``_follow`` has read the last token's row factors)
  before writing the next token's, and reloads q per token.

V4 rows staged (``_produce_v4``), and V4.1 and V3.2 rows in 2-CTA clusters
(``_produce_v41_pair``, ``_produce_v32_pair``), a bf16 q, one split a token (the rows are
final). ``plan.persist_programs`` decides where it runs.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from sparse_mla.ops.attention.portable import key_run
from sparse_mla.ops.attention.sm90.compat import barrier
from sparse_mla.ops.attention.sm90.epilogue import _store_staged
from sparse_mla.ops.attention.sm90.tuning import HEADS


@gluon.jit
def varying_zero(x):
    """0, computed from ``x`` where the compiler cannot see it: added to a head-block base in a
    token loop, it keeps the row addresses of q's load and the epilogue's stores from being
    hoisted out of the loop (hundreds of live registers: the lead spilled)."""
    return gl.inline_asm_elementwise("and.b32 $0, $1, 0;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def token_count(tp, tp_step, n_tok):
    """How many of the launch's tokens tp, tp + tp_step, ... < n_tok a program runs."""
    return gl.cdiv(gl.maximum(n_tok - tp, 0), tp_step)


# the fields of a token's row in the program's table (``fill_table``)
LO = gl.constexpr(0)
HI = gl.constexpr(1)
N0P = gl.constexpr(2)
N0 = gl.constexpr(3)
N1 = gl.constexpr(4)
N_TILES = gl.constexpr(5)


@gluon.jit
def fill_table(tab, t0, tp, tp_step, n_tok, l0_ptr, l0_div, l0_off, l0_lag, l1_ptr, l1_div,
               l1_off, l1_lag, K0, K1, HAS_L0: gl.constexpr, HAS_L1: gl.constexpr,
               HAS_SRC1: gl.constexpr, BN: gl.constexpr, MAX_TOK: gl.constexpr,
               WARPS: gl.constexpr):
    """Row k of ``tab`` ([MAX_TOK, 8] int32): the key run of the program's k-th token (one
    split: its whole virtual key list), fields ``LO`` .. ``N_TILES``. Computed once before
    the partitions start, so none of them keeps the lengths' arguments live in its loop (the
    consumers spilled with them)."""
    RL: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
    f = gl.arange(0, 8, layout=RL)
    for kk in gl.static_range(MAX_TOK):
        tk = t0 + gl.minimum(tp + kk * tp_step, n_tok - 1)     # rows past the program's: unread
        n0, n1, n0p, lo, hi = key_run(l0_ptr, l0_div, l0_off, l0_lag, l1_ptr, l1_div, l1_off,
                                      l1_lag, tk, K0, K1, 0, 1, HAS_L0, HAS_L1, HAS_SRC1, BN)
        row = gl.where(f == LO, lo, gl.cdiv(gl.maximum(hi - lo, 0), BN))
        row = gl.where(f == HI, hi, row)
        row = gl.where(f == N0P, n0p, row)
        row = gl.where(f == N0, n0, row)
        row = gl.where(f == N1, n1, row)
        tab.index(kk).store(row)


@gluon.jit
def field(tab, k, j: gl.constexpr, WARPS: gl.constexpr):
    """Field ``j`` of row ``k`` of the program's token table."""
    RL: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
    row = tab.index(k).load(RL)
    return gl.sum(gl.where(gl.arange(0, 8, layout=RL) == j, row, 0), axis=0)


@gluon.jit
def run(tab, k, WARPS: gl.constexpr):
    """The k-th token's (lo, hi, n0p, n0, n1, tiles): ``key_run``'s values and its tile count."""
    return (field(tab, k, LO, WARPS), field(tab, k, HI, WARPS), field(tab, k, N0P, WARPS),
            field(tab, k, N0, WARPS), field(tab, k, N1, WARPS), field(tab, k, N_TILES, WARPS))


@gluon.jit
def write_half(acc, d0: gl.constexpr, inv_l, gate, empty_row, k_bufs, empty, n_tiles, g0, t, h0,
               H, out_ptr, out_s0, out_s1, out_scale, out_scale_ptr, STAGES: gl.constexpr,
               O_L: gl.constexpr, HAS_SINK: gl.constexpr, OUT_SCALE_T: gl.constexpr):
    """A consumer's final bf16 output dims [d0, d0 + 256) of the token's rows (as
    ``epilogue._write_rows`` with one split), through its half of the token's last stage,
    which it then releases."""
    if n_tiles > 0:
        o = acc * inv_l[:, None]
        if HAS_SINK:
            o = o * gate[:, None]
        if OUT_SCALE_T:
            out_scale = gl.load(out_scale_ptr).to(gl.float32)
        o = gl.where(empty_row[:, None], 0.0, o * out_scale).to(gl.bfloat16)
        st = (g0 + n_tiles - 1) % STAGES
        _store_staged(o, k_bufs.index(st), out_ptr, t.to(gl.int64) * out_s0, out_s1, h0, H, d0,
                      d0 // 256)
        # every warp has read its rows back; generic accesses before a cluster peer's bulk
        # copy (async proxy) may refill the stage
        fence_async_shared()
        barrier()
        mbarrier.arrive(empty.index(st))
    else:       # no keys, no stage of its own: zero rows, 8 heads x 128 dims a store
        ZL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        hz = gl.arange(0, 8, layout=gl.SliceLayout(1, ZL))
        dz = gl.arange(0, 128, layout=gl.SliceLayout(0, ZL))
        zeros = gl.zeros([8, 128], gl.bfloat16, ZL)
        for j in gl.static_range(HEADS // 8):
            h = h0 + 8 * j + hz
            row = out_ptr + (t.to(gl.int64) * out_s0 + h.to(gl.int64) * out_s1)
            for dd in gl.static_range(2):
                gl.store(row[:, None] + (d0 + 128 * dd + dz)[None, :], zeros,
                         mask=(h < H)[:, None])
