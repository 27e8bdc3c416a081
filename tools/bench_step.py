"""One attention layer's whole decode step, each part timed, against the step's memory floor.

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.tools.bench_step [--quick]
      [--kinds C4A C128A C1A C2A] [--contexts 4k 64k 256k 1M] [--batch 1 8 64] [--sq 1 2]
      [--csv PATH]

Rows: a uniform decode batch (``b`` requests of ``ctx`` tokens of context, ``s_q`` new tokens
each; s_q 2 is MTP) through one layer of a kind: DeepSeek-V4's C4A (the Lightning indexer's
top-512, ``IndexerStep``) and C128A (no indexer), DeepSeek-V4.1's C1A and C2A (the two-level
indexer of V4.1-Flash: 32 index heads, top-512, 2048 candidate blocks of 8 positions). A V4.1
kind has two rows, one per indexer role (docs/semantics.md §11.6): "cand", the layer that owns
the index keys and runs level 1 (its own top-512 and the candidate blocks), and "in-cand", a
layer that runs level 2 (top-512 inside the candidate blocks) over those keys.

Columns (µs per step; CUDA-graph replays on a GPU, wall time on a CPU):
  idx_insert   the indexer-key insert (``indexer_k_insert``; not in an "in-cand" row)
  idx_topk     the indexer's top-k (V4: ``IndexerStep``'s decode top-k; V4.1 "cand": level 1,
               ``indexer_v41_candidates_decode``)
  idx_in_cand  V4.1 "in-cand": level 2, ``indexer_v41_topk_in_candidates_decode``
  insert       the cache write (q RoPE, SWA insert, compressed insert), as the step runs it
  plan         the index lists (the shared plan, then the layer's top-k as global slots)
  attn         the attention op on those lists
  step         the whole step in one graph (the parts above, in order, with the backend's
               input checks); "-" where it could not be captured
  floor        the bytes the step must move / the copy bandwidth measured in this run
  step/floor   how far the step is from that floor

The floor (bytes, per step; b requests, s_q tokens each, T = b * s_q, n = ctx + s_q tokens per
request, E = n // ratio compressed entries per request, h heads, Hi index heads, K = top-k,
W = window, C = candidate blocks x their positions, c = compressed rows this step completes):
  index keys   b * E * 132                  (V4 C4A, V4.1 "cand": every entry's key once)
               b * min(E, C) * 132          (V4.1 "in-cand": only the candidate positions)
  index q      T * Hi * (128 * 2 + 4)       (bf16 q, fp32 weights; with ids written: T * K * 4,
                                             V4.1 "cand" also T * C / 8 * 4 of candidate blocks)
  KV records   b * (min(E, K) + min(n, W + s_q - 1)) * 584      (top-k kinds)
               b * (E + min(n, W + s_q - 1)) * 584              (C128A: every entry)
               one request's s_q tokens read the union of their lists: at least one top-k and
               the window stretched by the extra tokens (at most K + W per token), so the floor
               takes the smallest union
  q, out       T * h * 512 * 2 * 2          (bf16 q read, bf16 out written)
  inserted     T * (512 * 2 + 584)          (kv rows read, SWA records written)
               + c * (512 * 2 + 584)        (compressed rows read, records written)
               + c * (128 * 2 + 132)        (index keys read and written; not "in-cand")
Bandwidth: a device-to-device copy of a large buffer in the same run (bytes read + written per
second, ``harness.copy_bandwidth``). Contexts whose caches do not fit the device's free memory
(estimated before allocating) are skipped with a note.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import os
import sys
import torch

from sparse_mla.backends.v4 import LayerConfig, LayerKind
from sparse_mla.backends.v4.indexer_step import IndexerInputs, IndexerStep
from sparse_mla.backends.v4 import FlashMLABackend
from sparse_mla.backends.v41.flashmla import V41FlashMLABackend
from sparse_mla.backends.v41.config import V41Kind, V41LayerConfig
from sparse_mla.ops.common import dispatch
from sparse_mla.ops.indexer import format as ifmt
from sparse_mla.ops.indexer import indexer_k_insert
from sparse_mla.tools import bench_backend as bb
from sparse_mla.tools import harness

RECORD = 584            # bytes per KV token, FlashMLA's record (both caches)
KEY_RECORD = ifmt.DIM + 4   # an index key: 128 e4m3 + an fp32 scale
CONTEXTS = {"4k": 4096, "64k": 65536, "256k": 262144, "1M": 1 << 20}
V41_OPS = ("indexer_v41_candidates_decode", "indexer_v41_topk_in_candidates_decode")
PARTS = ("idx_insert", "idx_topk", "idx_in_cand", "insert", "plan", "attn")
COLUMNS = ("kind", "role", "ctx", "batch", "s_q") + PARTS + (
    "parts_sum", "step", "floor", "step/floor", "floor_bytes", "copy_GBps")


@dataclasses.dataclass(frozen=True)
class Layer:
    """A layer kind's indexer: ``role`` "" (V4), "cand" (V4.1 level 1) or "in-cand" (level 2)."""

    name: str
    kind: object
    role: str = ""
    index_heads: int = 0          # 0: no indexer (C128A)
    topk: int = 512
    cand_blocks: int = 2048
    cand_block: int = 8

    @property
    def v41(self) -> bool:
        return isinstance(self.kind, V41Kind)

    @property
    def writes_keys(self) -> bool:
        return self.index_heads > 0 and self.role != "in-cand"


def layers(kinds):
    for k in kinds:
        if k == "C4A":
            yield Layer("C4A", LayerKind.C4A, index_heads=64)
        elif k == "C128A":
            yield Layer("C128A", LayerKind.C128A)
        else:
            for role in ("cand", "in-cand"):
                yield Layer(k, V41Kind[k], role, index_heads=32)


def parse_context(text: str) -> int:
    """"4k", "64k", "256k", "1M" or a token count."""
    if text in CONTEXTS:
        return CONTEXTS[text]
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a context is one of {', '.join(CONTEXTS)} or a "
                                         f"positive token count, got {text!r}")
    return n


def context_name(n: int) -> str:
    return next((k for k, v in CONTEXTS.items() if v == n), str(n))


def v41_ops():
    """The two V4.1 indexer ops, or a clear error while they do not exist."""
    try:
        import sparse_mla.ops.indexer_v41  # noqa: F401  (registers the ops)
    except ImportError:
        pass
    ns = torch.ops.sparse_mla
    if not all(hasattr(ns, op) for op in V41_OPS):
        raise RuntimeError(f"the V4.1 rows need ops indexer_v41_* ({', '.join(V41_OPS)}; "
                           f"branch v41-indexer-ops), which this build does not have")
    return tuple(getattr(ns, op) for op in V41_OPS)


# -- sizes ----------------------------------------------------------------------------------

def _config(layer: Layer, h: int, ctx: int, b: int, s_q: int):
    cls = V41LayerConfig if layer.v41 else LayerConfig
    return cls(num_heads=h, kind=layer.kind, max_num_tokens=b * s_q, max_num_reqs=b,
               max_model_len=ctx + s_q + 64, topk=layer.topk)


def _compressed_rows(layer: Layer, ctx: int, b: int, s_q: int) -> int:
    """Compressed rows the step completes: tokens at positions ctx..ctx+s_q-1 with
    (pos + 1) % ratio == 0, per request."""
    if not layer.kind.compressed:
        return 0
    r = layer.kind.ratio
    return b * sum(1 for p in range(ctx, ctx + s_q) if (p + 1) % r == 0)


def floor_bytes(layer: Layer, h: int, ctx: int, b: int, s_q: int) -> int:
    """The module docstring's floor, in bytes."""
    T, n, W = b * s_q, ctx + s_q, 128
    r = layer.kind.ratio
    E = n // r if layer.kind.compressed else 0
    C = layer.cand_blocks * layer.cand_block
    total = T * h * 512 * 2 * 2 + T * (512 * 2 + RECORD)
    c = _compressed_rows(layer, ctx, b, s_q)
    total += c * (512 * 2 + RECORD)
    window = min(n, W + s_q - 1)
    if layer.kind.uses_topk:
        total += b * (min(E, layer.topk) + window) * RECORD
    else:
        total += b * (E + window) * RECORD
    if layer.index_heads:
        total += T * layer.index_heads * (ifmt.DIM * 2 + 4) + T * layer.topk * 4
        if layer.role == "in-cand":
            total += b * min(E, C) * KEY_RECORD
        else:
            total += b * E * KEY_RECORD + c * (ifmt.DIM * 2 + KEY_RECORD)
        if layer.role == "cand":
            total += T * layer.cand_blocks * 4
    return total


def cache_bytes(layer: Layer, h: int, ctx: int, b: int, s_q: int) -> int:
    """What a case allocates (caches, index keys, the candidate and top-k buffers), as
    ``bench_backend._batch`` sizes the caches: every request's whole context."""
    cfg = _config(layer, h, ctx, b, s_q)
    n = ctx + s_q
    swa = b * -(-n // cfg.swa_block_size) * cfg.swa_block_size * RECORD
    comp = 0
    if layer.kind.compressed:
        cbs = cfg.compressed_block_size
        rows = b * (-(-(n // layer.kind.ratio) // cbs) + 1) * cbs
        comp = rows * (RECORD + (KEY_RECORD if layer.index_heads else 0))
    T = b * s_q
    ids = T * (layer.topk + layer.cand_blocks) * 4 * 3
    return swa + comp + ids + T * h * 512 * 2 * 4


def free_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# -- one case -------------------------------------------------------------------------------

def _timer(device):
    if device == "cuda":
        return harness.time_graph
    return lambda fn: harness.time_fn(fn, device, iters=1)


def _fill_keys(k_cache, n_slots, bs, device, impl):
    """Random keys in every indexer slot, as ``bench_backend._fill`` fills the KV caches."""
    step = 1 << 18
    for s in range(0, n_slots, step):
        n = min(step, n_slots - s)
        k = torch.randn(n, ifmt.DIM, device=device, dtype=torch.bfloat16)
        indexer_k_insert(k, k_cache, torch.arange(s, s + n, device=device), bs, impl=impl)


def run_case(layer: Layer, h: int, ctx: int, b: int, s_q: int, device: str,
             impl: str = "auto") -> dict:
    """Each part's seconds, the whole step's, and the floor's bytes."""
    levels = v41_ops() if layer.v41 else None
    g = torch.Generator().manual_seed(0)
    cfg = _config(layer, h, ctx, b, s_q)
    batch, blocks, T = bb._batch(cfg, [(ctx, s_q)] * b, device, g)
    be = (V41FlashMLABackend if layer.v41 else FlashMLABackend)(cfg, device, impl)
    caches = be.allocate_caches(blocks)
    for name, c in caches.items():
        bs = cfg.swa_block_size if name == "swa" else cfg.compressed_block_size
        bb._fill(c, blocks[name] * bs, bs, device)
    q = torch.randn(T, h, 512, device=device, dtype=torch.bfloat16)
    kv = torch.randn(T, 512, device=device, dtype=torch.bfloat16)
    comp = torch.randn(T, 512, device=device, dtype=torch.bfloat16) \
        if layer.kind.compressed else None
    cos_sin = bb._cos_sin(cfg.max_model_len, device)
    sink = torch.randn(h, device=device)
    out = torch.empty(T, h, 512, device=device, dtype=torch.bfloat16)
    time = _timer(device)
    res = dict.fromkeys(PARTS)

    indexer = whole = None
    if layer.index_heads:
        cbs, table = cfg.compressed_block_size, batch.compressed_block_table
        k_cache = ifmt.alloc_cache(blocks["compressed"], cbs, fp8=True, device=device)
        _fill_keys(k_cache, blocks["compressed"] * cbs, cbs, device, impl)
        ix = IndexerInputs(
            q=torch.randn(T, layer.index_heads, ifmt.DIM, device=device).to(torch.bfloat16),
            weights=torch.randn(T, layer.index_heads, device=device),
            k=torch.randn(T, ifmt.DIM, device=device, dtype=torch.bfloat16), k_cache=k_cache)
        slots = batch.compressed_slot_mapping
        topk = torch.full((T, layer.topk), -1, dtype=torch.int32, device=device)
        cands = torch.full((T, layer.cand_blocks), -1, dtype=torch.int32, device=device)
        v41_args = dict(ratio=layer.kind.ratio, next_n=s_q, block_size=cbs,
                        candidate_block=layer.cand_block, impl=impl)
        if not layer.v41:
            ixstep = IndexerStep(be, impl)
            select = lambda: ixstep._decode(ix, batch, table, topk)  # noqa: E731
            # the whole step as the product runs it: IndexerStep.forward computes the top-k
            unselected = dataclasses.replace(batch, topk_indices=None)
            whole = lambda: ixstep.forward(q, kv, caches, unselected, ix, cos_sin, sink,  # noqa: E731
                                           out, comp)
        elif layer.role == "cand":
            select = lambda: levels[0](ix.q, ix.weights, k_cache, batch.seq_lens, table,  # noqa: E731
                                       topk, cands, **v41_args)
        else:
            # the candidates a level-1 layer of this step left behind
            levels[0](ix.q, ix.weights, k_cache, batch.seq_lens, table, topk, cands,
                      **v41_args)
            select = lambda: levels[1](ix.q, ix.weights, k_cache, batch.seq_lens, table,  # noqa: E731
                                       cands, topk, **v41_args)
        insert_keys = lambda: indexer_k_insert(ix.k, k_cache, slots, cbs, impl=impl)  # noqa: E731

        def indexer():
            if layer.writes_keys:
                insert_keys()
            select()
        if layer.writes_keys:
            res["idx_insert"] = time(insert_keys)
        res["idx_in_cand" if layer.role == "in-cand" else "idx_topk"] = time(select)
        select()
        batch = dataclasses.replace(batch, topk_indices=topk)

    def plan():
        be.plan(batch, T)
        be.planner.c4a_decode(batch)

    def step():
        if whole is not None:
            return whole()
        if indexer is not None:      # V4.1: the levels' ops, then the backend's step
            indexer()
        be.forward(q, kv, caches, batch, cos_sin, sink, out, comp)

    res["insert"] = time(lambda: be._write(q, kv, caches, batch, cos_sin, comp))
    be._write(q, kv, caches, batch, cos_sin, comp)
    res["plan"] = time(plan)
    plan()
    res["attn"] = time(lambda: be._decode(be.q_rot[:T], caches, batch, sink, out))
    res["step"] = time(step)
    res["floor_bytes"] = floor_bytes(layer, h, ctx, b, s_q)
    index_ops = ("indexer_k_insert",) + (V41_OPS if layer.v41 else ("indexer_topk_decode",))
    res["ran"] = {**{op: dispatch.last_choice(op) for op in index_ops if layer.index_heads},
                  **be.explain()}
    return res


# -- output ---------------------------------------------------------------------------------

def row_of(layer: Layer, ctx: int, b: int, s_q: int, res: dict, bandwidth: float) -> dict:
    us = {k: None if res[k] is None else res[k] * 1e6 for k in PARTS + ("step",)}
    parts = [v for k, v in us.items() if k in PARTS and v is not None]
    floor = res["floor_bytes"] / bandwidth * 1e6
    step = us["step"]
    return {"kind": layer.name, "role": layer.role or "-", "ctx": context_name(ctx),
            "batch": b, "s_q": s_q, **{k: us[k] for k in PARTS},
            "parts_sum": sum(parts), "step": step, "floor": floor,
            "step/floor": None if step is None else step / floor,
            "floor_bytes": res["floor_bytes"], "copy_GBps": bandwidth / 1e9}


def step_shapes(batches, sqs, mtp_ratios=False):
    """(batch, s_q) of every row, batch-major; with ``mtp_ratios`` also s_q 1 at b and at
    b * s_q requests for each s_q above 1 (what ``mtp_summary`` divides by)."""
    shapes = [(b, s) for b in batches for s in sqs]
    if mtp_ratios:
        shapes += [(m, 1) for b in batches for s in sqs if s > 1 for m in (b, b * s)]
    return sorted(set(shapes))


def mtp_summary(rows):
    """``#`` lines: each MTP row's step time over the s_q 1 step of as many requests and over
    the s_q 1 step of b * s_q requests (below 1: a draft token costs less than a request)."""
    step = {(r["kind"], r["role"], r["ctx"], r["batch"], r["s_q"]): r["step"] for r in rows}
    out = []
    for (kind, role, ctx, b, s_q), t in step.items():
        if s_q == 1 or t is None:
            continue
        one = step.get((kind, role, ctx, b, 1))
        alone = step.get((kind, role, ctx, b * s_q, 1))
        ratio = lambda d, t=t: "-" if not d else f"{t / d:.2f}"  # noqa: E731
        out.append(f"# MTP {kind} {role} ctx {ctx} b{b} s_q{s_q}: {t:.1f} µs = "
                   f"{ratio(one)} x s_q 1 (b{b}), "
                   f"{ratio(alone)} x {b * s_q} requests of s_q 1")
    return out


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if v < 100 else f"{v:.0f}"
    return str(v)


def print_row(row: dict, header: bool = False) -> None:
    cols = COLUMNS[:-2]
    if header:
        print(" ".join(f"{c:>11s}" for c in cols), flush=True)
    print(" ".join(f"{_cell(row[c]):>11s}" for c in cols), flush=True)


def write_csv(path: str, rows, caption: str) -> None:
    """docs/perf's form (``tools/perf_tables``): ``#`` caption lines, then the table with the
    numbers as the table prints them ("-" where a layer has no such part)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(f"# {caption}\n")
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([_cell(r[k]) for k in COLUMNS])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[5:]))
    ap.add_argument("--kinds", nargs="+", choices=("C4A", "C128A", "C1A", "C2A"),
                    default=("C4A", "C128A", "C1A", "C2A"), help="layer kinds (default all)")
    ap.add_argument("--contexts", nargs="+", type=parse_context,
                    help="contexts: 4k 64k 256k 1M or token counts (default 4k 64k 256k 1M; "
                         "1M where it fits)")
    ap.add_argument("--batch", type=int, nargs="+", help="requests (default 1 8 64)")
    ap.add_argument("--sq", type=int, nargs="+", choices=range(1, 9), metavar="S_Q",
                    help="new tokens per request 1..8, above 1 = MTP (default 1 2)")
    ap.add_argument("--mtp-ratios", action="store_true",
                    help="also run s_q 1 at b and at b * s_q requests for every s_q above 1, "
                         "and print each MTP step's time over both (a draft token against an "
                         "independent request)")
    ap.add_argument("--heads", type=int, default=64, help="attention heads (default 64)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4k and 64k, batch 8, s_q 1")
    ap.add_argument("--csv", metavar="PATH", help="also write the rows to this CSV file")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default; CUDA-graph times) or cpu (wall times of the "
                         "reference / interpreter, tiny shapes only: a smoke test)")
    ap.add_argument("--impl", default="auto",
                    help="force every op's implementation (auto, reference, triton, ...)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_step: --device cuda needs a CUDA GPU (--device cpu runs the "
                         "reference at tiny shapes)")
    if args.heads < 1:
        ap.error("--heads must be positive")
    quick = args.quick
    contexts = args.contexts or ((4096, 65536) if quick else tuple(CONTEXTS.values()))
    batches = args.batch or ((8,) if quick else (1, 8, 64))
    sqs = args.sq or ((1,) if quick else (1, 2))
    if any(b < 1 for b in batches):
        ap.error("--batch must be positive")
    dev = args.device
    bandwidth = harness.copy_bandwidth(dev)
    timing = "CUDA-graph replays" if dev == "cuda" else "CPU wall time"
    print(f"# {harness.device_name(dev)}; copy bandwidth {bandwidth / 1e9:.0f} GB/s "
          f"(read + write); h{args.heads}; µs per step", flush=True)
    rows, ran, missing = [], None, None
    for layer in layers(args.kinds):
        if layer.v41:
            try:
                v41_ops()
            except RuntimeError as e:
                missing = str(e)
                print(f"# skipped every {layer.name} {layer.role} row: {e}", flush=True)
                continue
        for ctx in contexts:
            for b, s_q in step_shapes(batches, sqs, args.mtp_ratios):
                name = f"{layer.name} {layer.role} ctx {context_name(ctx)} b{b} s_q{s_q}"
                need, free = cache_bytes(layer, args.heads, ctx, b, s_q), free_bytes(dev)
                if need > 0.8 * free:
                    print(f"# skipped {name}: needs ~{need / 2**30:.1f} GiB, "
                          f"{free / 2**30:.1f} GiB free", flush=True)
                    continue
                try:
                    res = run_case(layer, args.heads, ctx, b, s_q, dev, args.impl)
                except torch.cuda.OutOfMemoryError:
                    # the estimate counts the caches, not the ops' own workspaces
                    torch.cuda.empty_cache()
                    print(f"# skipped {name}: out of device memory (the caches fit: "
                          f"~{need / 2**30:.1f} GiB)", flush=True)
                    continue
                rows.append(row_of(layer, ctx, b, s_q, res, bandwidth))
                print_row(rows[-1], header=len(rows) == 1)
                ran = ran or res["ran"]
                if dev == "cuda":
                    torch.cuda.empty_cache()
    if args.mtp_ratios:
        for line in mtp_summary(rows):
            print(line)
    if ran:
        print("# ops ran (first row): " + ", ".join(f"{op}={c.impl}" for op, c in ran.items()
                                                    if c))
    if args.csv:
        write_csv(args.csv, rows, f"{harness.device_name(dev)}, {datetime.date.today()}, "
                  f"`python3 -m sparse_mla.tools.bench_step "
                  f"{' '.join(sys.argv[1:] if argv is None else argv)}`: one attention "
                  f"layer's decode step, h{args.heads}, µs per step ({timing}); floor = the "
                  f"bytes the step must move / the run's copy bandwidth "
                  f"({bandwidth / 1e9:.0f} GB/s, read + write); see the tool's docstring")
        print(f"# wrote {len(rows)} rows to {args.csv}")
    if missing:
        print(f"# V4.1 rows missing: {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
