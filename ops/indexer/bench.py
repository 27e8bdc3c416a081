"""Benchmark cases of the indexer family (ops/common/benchcase.py contract), and the H200
comparison ``python3 -m sparse_mla.ops.indexer.bench`` (lab/tools/gpu_indexer.sh runs it).

Shapes (small=False): DeepSeek-V4's indexer, 64 heads of 128, top-512, ratio 4, fp8 cache in
64-entry blocks. Decode: batch 64, s_q 1 and 2 (``--next-n``: up to 8), 16,384 candidates
each (64k context).
Prefill: one 8,192-token chunk at positions 57,344..65,535 over 16,384 keys (each token sees
14,336..16,384 of them). ``bytes``: the cache / key bytes a perfect kernel reads plus q,
weights and the top-k written; ``flops``: 2 * 128 * heads per (token, candidate) pair.

The comparison prints, for the same inputs: each stage alone (the scores kernel, the top-k
select kernel over its keys) and the whole op as % of the card's measured copy bandwidth
(decode, on the bytes above) and bf16 matmul rate (prefill, on the flops above), and HF
transformers' eager indexer math (``DeepseekV4IndexerScorer`` + the top-k of
``DeepseekV4Indexer``, written out here: a [tokens, heads, candidates] fp32 score tensor) in
time and peak memory. The launch-shape sweeps are lab/tools/indexer_speed.py's ``--sweep``.
"""
from __future__ import annotations

import argparse
import contextlib

import torch

from sparse_mla.ops.common.benchcase import BenchCase, host_us, time_graph
from sparse_mla.ops.common.errors import ImplementationUnavailable
from sparse_mla.ops.indexer import format as fmt
from sparse_mla.ops.indexer import ops

HEADS, TOPK, RATIO, BLOCK = 64, 512, 4, 64


def _mismatch_fraction(ref, out):
    """Fraction of valid ids in ``out`` that the reference's row does not select (routes
    agree up to swaps among scores tied within rounding: a small fraction at most)."""
    r, o = ref[0].cpu(), out[0].cpu()
    bad = total = 0
    for a, b in zip(r.tolist(), o.tolist()):
        want = {x for x in a if x >= 0}
        got = [x for x in b if x >= 0]
        total += max(len(want), 1)
        bad += sum(1 for x in got if x not in want) + abs(len(got) - len(want))
    return bad / max(total, 1)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def decode_inputs(device, batch, next_n, cand, heads=HEADS, fp8=True, seed=0):
    """A decode step whose every token's last position sees ``cand`` entries: the paged
    cache filled through ``indexer_k_insert`` from random rows, blocks in random order."""
    g = _gen(seed)
    per = -(-cand // BLOCK)
    cache = fmt.alloc_cache(batch * per, BLOCK, fp8=fp8, device=device, fill=0)
    bt = torch.randperm(batch * per, generator=g).to(torch.int32).view(batch, per)
    slots = (bt.long().unsqueeze(2) * BLOCK + torch.arange(BLOCK)).view(batch, -1)[:, :cand]
    for b in range(batch):            # one request at a time bounds the bf16 rows' memory
        rows = torch.randn(cand, fmt.DIM, generator=g).to(device)
        ops.indexer_k_insert(rows, cache, slots[b].to(device))
    t = batch * next_n
    return dict(q=torch.randn(t, heads, fmt.DIM, generator=g).to(torch.bfloat16).to(device),
                weights=(torch.randn(t, heads, generator=g) * (heads * fmt.DIM) ** -0.5
                         ).to(device),
                k_cache=cache, block_table=bt.to(device),
                seq_lens=torch.full((batch,), cand * RATIO + next_n - 1, dtype=torch.int32,
                                    device=device),
                out=torch.empty(t, TOPK, dtype=torch.int32, device=device), next_n=next_n)


def prefill_inputs(device, tokens, cand, heads=HEADS, fp8=True, seed=1):
    """One request's last ``tokens`` tokens of a ``cand * RATIO``-token prompt over its
    ``cand`` keys (dense, as the prefill op takes them)."""
    g = _gen(seed)
    rows = torch.randn(cand, fmt.DIM, generator=g)
    if fp8:
        from sparse_mla.ops.indexer.reference import quantize_fp8
        vals, scales = quantize_fp8(rows)
        k, k_scale = vals.view(torch.float8_e4m3fn).to(device), scales.to(device)
    else:
        k, k_scale = rows.to(torch.bfloat16).to(device), None
    start = cand * RATIO - tokens
    return dict(q=torch.randn(tokens, heads, fmt.DIM, generator=g).to(torch.bfloat16).to(device),
                weights=(torch.randn(tokens, heads, generator=g) * (heads * fmt.DIM) ** -0.5
                         ).to(device),
                k=k, k_scale=k_scale,
                cu_seqlens_q=torch.tensor([0, tokens], device=device),
                cu_seqlens_k=torch.tensor([0, cand], device=device),
                positions=torch.arange(start, start + tokens, device=device),
                out=torch.empty(tokens, TOPK, dtype=torch.int32, device=device),
                max_seqlen_k=cand)


def decode_bytes(x, cand):
    t = x["q"].shape[0]
    return (t // x["next_n"]) * cand * fmt.FP8.bytes_per_token + x["q"].numel() * 2 \
        + x["weights"].numel() * 4 + x["out"].numel() * 4


def pairs(x):
    """(token, candidate) pairs a prefill scores: sum over tokens of min(C, (p + 1) // 4)."""
    c = x["max_seqlen_k"]
    return int(torch.clamp((x["positions"].long() + 1) // RATIO, max=c).sum())


def cases(device: str, small: bool) -> list:
    out = []
    insert_n = 64 if small else 1 << 16

    def make_insert(n=insert_n):
        per = -(-n // BLOCK)
        return dict(k=torch.randn(n, fmt.DIM, device=device).to(torch.bfloat16),
                    k_cache=fmt.alloc_cache(per, BLOCK, device=device, fill=0),
                    slots=torch.randperm(per * BLOCK, device=device)[:n])

    def run_insert(x, impl):
        ops.indexer_k_insert(x["k"], x["k_cache"], x["slots"], impl=impl)
        return (x["k_cache"],)

    out.append(BenchCase("indexer_k_insert", f"N={insert_n} fp8", make_insert, run_insert,
                         bytes=insert_n * (fmt.DIM * 2 + fmt.FP8.bytes_per_token + 8),
                         compare=lambda a, b: float((a[0].cpu() != b[0].cpu()).sum()),
                         error_unit="bytes differ"))

    batch, cand = (2, 40) if small else (64, 16384)
    heads = 4 if small else HEADS
    for next_n in (1, 2):
        def make_decode(next_n=next_n):
            return decode_inputs(device, batch, next_n, cand, heads=heads)

        def run_decode(x, impl):
            ops.indexer_topk_decode(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                    x["block_table"], x["out"], RATIO, x["next_n"], impl=impl)
            return (x["out"],)
        t = batch * next_n
        probe = dict(q=torch.empty(t, heads, fmt.DIM), weights=torch.empty(t, heads),
                     out=torch.empty(t, TOPK), next_n=next_n)
        out.append(BenchCase(
            "indexer_topk_decode", f"B={batch} s_q={next_n} C={cand} H={heads} fp8",
            make_decode, run_decode, bytes=decode_bytes(probe, cand),
            flops=t * cand * heads * fmt.DIM * 2, compare=_mismatch_fraction,
            error_unit="ids off the reference's top-k (fraction)", tolerance=0.01))

    tokens, cand = (24, 40) if small else (8192, 16384)

    def make_prefill():
        return prefill_inputs(device, tokens, cand, heads=heads)

    def run_prefill(x, impl):
        if impl == "reference" and not small:
            raise ImplementationUnavailable(
                "the float64 reference", "the float64 reference takes hours at this size")
        ops.indexer_topk_prefill(x["q"], x["weights"], x["k"], x["k_scale"], x["cu_seqlens_q"],
                                 x["cu_seqlens_k"], x["positions"], x["out"], RATIO, 0,
                                 x["max_seqlen_k"], impl=impl)
        return (x["out"],)
    probe = dict(positions=torch.arange(cand * RATIO - tokens, cand * RATIO), max_seqlen_k=cand)
    out.append(BenchCase(
        "indexer_topk_prefill", f"T={tokens} C={cand} H={heads} fp8", make_prefill, run_prefill,
        bytes=tokens * heads * (fmt.DIM * 2 + 4) + cand * fmt.FP8.bytes_per_token
        + tokens * TOPK * 4, flops=pairs(probe) * heads * fmt.DIM * 2,
        compare=_mismatch_fraction, error_unit="ids off the reference's top-k (fraction)",
        tolerance=0.01, reference=small))     # the float64 reference: hours at 8192 x 16k
    return out


# ---------------------------------------------------------------------------------------------
# the comparison (CUDA)

def hf_eager_topk(q, weights, keys, positions, topk=TOPK, ratio=RATIO):
    """HF transformers' indexer math (modeling_deepseek_v4: ``DeepseekV4IndexerScorer``, then
    ``DeepseekV4Indexer``'s causal mask and top-k) for one request, model scales already in
    ``weights``: every [tokens, heads, candidates] score materialized in fp32."""
    scores = torch.matmul(q.float().unsqueeze(0), keys.float().T.unsqueeze(0).unsqueeze(1))
    scores = torch.relu(scores)
    logits = (scores * weights.float().unsqueeze(0).unsqueeze(-1)).sum(dim=2)[0]
    threshold = (positions + 1) // ratio
    future = torch.arange(keys.shape[0], device=q.device).unsqueeze(0) >= threshold.unsqueeze(1)
    logits = logits.masked_fill(future, float("-inf"))
    ids = logits.topk(min(topk, keys.shape[0]), dim=-1).indices
    return torch.where(ids >= threshold.unsqueeze(1), -1, ids)


def _time(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=50) * 1e-3


def _peak(fn):
    """(seconds, peak bytes allocated above what was allocated before) of ``fn``, or
    (None, "OOM") where it runs out of memory."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return _time(fn), peak
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, "OOM"


def _dense_bf16(x):
    """The prefill keys as bf16 (e4m3 * a power of two: exact)."""
    if x["k_scale"] is None:
        return x["k"]
    return (x["k"].float() * x["k_scale"].unsqueeze(1)).to(torch.bfloat16)


def _roofline(device):
    """(device copy bytes read + written per second, bf16 8192^3 matmul FLOP/s), measured
    as tools/harness.py measures them for the main job."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * n / _time(lambda: dst.copy_(src)), 2 * 8192 ** 3 / _time(lambda: a @ a)


def _prefill_keys(x, keys, lim):
    """The scores kernel of a prefill case alone, every token in one launch."""
    from sparse_mla.ops.indexer import triton_impl
    triton_impl.prefill_keys(x["q"], x["weights"], x["k"], x["k_scale"], x["cu_seqlens_q"],
                             x["cu_seqlens_k"], x["positions"], RATIO, 0, keys, lim)


@contextlib.contextmanager
def _config(**kw):
    """triton_impl.CONFIG with ``kw`` for the block's duration."""
    from sparse_mla.ops.indexer import triton_impl
    saved = dict(triton_impl.CONFIG)
    triton_impl.CONFIG.update(kw)
    try:
        yield
    finally:
        triton_impl.CONFIG.clear()
        triton_impl.CONFIG.update(saved)


HOST_SHAPES = ((1, 1024), (1024, 256))     # (tokens, keys): an HF decode step, a 1k prefill


def host_costs(device="cuda"):
    """Host microseconds per call of the prefill op as HF's hook calls it (bf16 keys, one
    request, ``max_seqlen_k`` given), of its argument checks and of the Triton implementation
    called directly, next to HF's eager indexer math on the same inputs: printed lines."""
    lines = [f"host us per call (no sync)   {'op':>8} {'checks':>8} {'triton':>8} "
             f"{'HF eager':>9}"]
    for n, cand in HOST_SHAPES:
        us = _host_row(prefill_inputs(device, n, cand, fp8=False), cand)
        lines.append(f"prefill op n={n:<5} C={cand:<5}     " +
                     " ".join(f"{u:8.1f}" for u in us[:3]) + f" {us[3]:9.1f}")
    return lines


def _host_row(x, cand):
    from sparse_mla.ops.indexer import triton_impl
    args = (x["q"], x["weights"], x["k"], None, x["cu_seqlens_q"], x["cu_seqlens_k"],
            x["positions"], x["out"])
    fns = (lambda: ops.indexer_topk_prefill(*args, RATIO, 0, cand),
           lambda: ops._validate_prefill(*args, RATIO, 0, cand),
           lambda: triton_impl.topk_prefill(*args[:7], RATIO, x["out"], 0, cand),
           lambda: hf_eager_topk(x["q"], x["weights"], x["k"], x["positions"]))
    for fn in fns:
        fn()
    return [host_us(fn) for fn in fns]


def _stage_rows(shape, stages, rate):
    """Table rows of timed stages [(route, fn)]: (shape, route, s, peak, ``rate(s)``)."""
    rows = []
    for what, fn in stages:
        t, peak = _peak(fn)
        rows.append((shape, what, t, peak, "-" if t is None else rate(t)))
    return rows


def _graph_time(device, batch, next_n, cand):
    """CUDA-graph replay seconds of the decode op over ``batch`` requests of ``next_n``."""
    x = decode_inputs(device, batch, next_n, cand)

    def whole(x=x):
        ops.indexer_topk_decode(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                x["block_table"], x["out"], RATIO, x["next_n"])
    t = time_graph(whole)
    del x
    torch.cuda.empty_cache()
    return t


def mtp_rows(device, batch, cand, next_ns, time_of=_graph_time):
    """MTP rows: for each s_q, the op's graph time over ``batch`` requests, its ratio to s_q 1
    (the same requests, one token each) and to ``batch * s_q`` independent s_q 1 requests (a
    draft token costs less than a request where the key reads are shared: ratio < 1)."""
    one = time_of(device, batch, 1, cand)
    rows = []
    for n in next_ns:
        t = one if n == 1 else time_of(device, batch, n, cand)
        alone = one if n == 1 else time_of(device, batch * n, 1, cand)
        ratio = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731
        rows.append((f"decode MTP B={batch} s_q={n} C={cand}",
                     f"graph; x s_q 1: {ratio(t, one)}; x {batch * n} requests of s_q 1: "
                     f"{ratio(t, alone)}", t, "-", "-"))
    return rows


def compare(device="cuda", tokens=8192, cand=16384, batch=64, hf=True, next_ns=(1, 2),
            prefill=True):
    from sparse_mla.ops.indexer import triton_impl, triton_select
    rows = []
    copy_bw, mm = _roofline(device)
    print(f"measured: copy {copy_bw / 1e9:,.0f} GB/s (read + write), bf16 matmul "
          f"{mm / 1e12:,.0f} TFLOP/s", flush=True)
    host = host_costs(device)

    for next_n in next_ns:
        x = decode_inputs(device, batch, next_n, cand)
        width = fmt.decode_width(x["block_table"], BLOCK, None)
        moved = decode_bytes(x, cand)
        keys, lim = triton_impl.decode_keys(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                            x["block_table"], RATIO, next_n, BLOCK, width)

        def scores(x=x, width=width):
            triton_impl.decode_keys(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                    x["block_table"], RATIO, x["next_n"], BLOCK, width)

        def scores_heads_m(scores=scores):
            with _config(decode_heads_n=False):
                scores()

        def topk(x=x, keys=keys):
            triton_impl.select_from_keys(keys, x["out"])

        def select(x=x, keys=keys, lim=lim):
            triton_select.select_topk(keys, x["out"], lim)

        def whole(x=x):
            ops.indexer_topk_decode(x["q"], x["weights"], x["k_cache"], x["seq_lens"],
                                    x["block_table"], x["out"], RATIO, x["next_n"])
        shape = f"decode B={batch} s_q={next_n} C={cand}"
        rows += _stage_rows(shape, (("scores kernel", scores),
                                    ("scores kernel, heads on the dot's M", scores_heads_m),
                                    ("top-k by torch.topk over the keys", topk),
                                    ("top-k select kernels", select),
                                    ("op (scores + top-k)", whole)),
                            lambda t, moved=moved: f"{100 * moved / t / copy_bw:.0f}% copy")
        # the op's GPU time alone: in the loop above its host time per call (wrapper,
        # validation, two launches) is about as long as its kernels (docs/PERF.md, "Lightning
        # indexer decode: the op's time is its kernels"); vLLM replays decode as a graph
        t = time_graph(whole)
        rows.append((shape, "op (scores + top-k), CUDA-graph replay", t, "-",
                     "-" if t is None else f"{100 * moved / t / copy_bw:.0f}% copy"))
        if hf:
            dense = _paged_dense(x, cand)
            pos = x["seq_lens"].long().repeat_interleave(next_n) - next_n + \
                torch.arange(next_n, device=device).repeat(batch)

            def hf_loop(x=x, dense=dense, pos=pos, next_n=next_n):
                for b in range(batch):
                    r = slice(b * next_n, (b + 1) * next_n)
                    hf_eager_topk(x["q"][r], x["weights"][r], dense[b], pos[r])
            rows += _stage_rows(shape, (("HF eager indexer math (loop over requests)",
                                         hf_loop),), lambda t: "-")
            del dense
        del x, keys, lim
        torch.cuda.empty_cache()
    if any(n > 1 for n in next_ns):
        rows += mtp_rows(device, batch, cand, next_ns)

    for fp8 in ((True, False) if prefill else ()):
        x = prefill_inputs(device, tokens, cand, fp8=fp8)
        flops = pairs(x) * HEADS * fmt.DIM * 2
        keys = torch.empty(tokens, cand, dtype=torch.int64, device=device)
        lim = torch.empty(tokens, dtype=torch.int32, device=device)

        def scores(x=x, keys=keys, lim=lim):
            _prefill_keys(x, keys, lim)
        scores()

        def select(x=x, keys=keys, lim=lim):
            triton_select.select_topk(keys, x["out"], lim)

        def whole(x=x):
            ops.indexer_topk_prefill(x["q"], x["weights"], x["k"], x["k_scale"],
                                     x["cu_seqlens_q"], x["cu_seqlens_k"], x["positions"],
                                     x["out"], RATIO, 0, x["max_seqlen_k"])
        shape = f"prefill T={tokens} C={cand} {'fp8' if fp8 else 'bf16'} keys"
        def topk(x=x, keys=keys):
            triton_impl.select_from_keys(keys, x["out"])
        mm_pct = lambda t, flops=flops: f"{100 * flops / t / mm:.0f}% mm"  # noqa: E731
        rows += _stage_rows(shape, (("scores kernel (all rows at once)", scores),
                                    ("top-k by torch.topk (all rows at once)", topk),
                                    ("top-k select kernels (all rows at once)", select)),
                            mm_pct)
        del keys
        rows += _stage_rows(shape, (("op (scores + top-k, chunked)", whole),), mm_pct)
        if hf:
            dense = _dense_bf16(x)
            got = {}

            def hf_prefill(x=x, dense=dense, got=got):
                got["ids"] = hf_eager_topk(x["q"], x["weights"], dense, x["positions"])
            t, peak = _peak(hf_prefill)
            agree = "-" if "ids" not in got else \
                f"{_mismatch_fraction((got['ids'],), (x['out'],)):.4f} of ids differ"
            rows.append((shape, "HF eager indexer math", t, peak, agree))
            del dense, got
        del x
        torch.cuda.empty_cache()
    print("\n".join(host))
    _print(rows)


def _paged_dense(x, cand):
    """Each request's cache entries as bf16 [cand, 128] (what HF keeps per request)."""
    from sparse_mla.ops.indexer.reference import paged_keys
    out = []
    cache = x["k_cache"].cpu()
    for b in range(x["block_table"].shape[0]):
        keys, _ = paged_keys(cache, x["block_table"][b].cpu(), BLOCK, cand)
        out.append(keys.to(torch.bfloat16).to(x["q"].device))
    return out


def _print(rows):
    head = ("case", "route", "ms", "peak MiB", "% roofline")
    body = [(c, r, "-" if t is None else f"{t * 1e3:,.3f}",
             p if isinstance(p, str) else f"{p / 2 ** 20:,.0f}", pct)
            for c, r, t, p, pct in rows]
    widths = [max(len(str(v[i])) for v in body + [head]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths)] + body:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--candidates", type=int, default=16384)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--no-hf", action="store_true",
                   help="leave out HF's eager indexer math (its prefill takes 66 GB)")
    p.add_argument("--next-n", type=int, nargs="+", default=[1, 2], choices=range(1, 9),
                   metavar="N", help="decode s_q (MTP next_n) rows, 1..8 (default 1 2); "
                   "with any above 1, also each one's graph time against s_q 1 and against "
                   "B * s_q independent requests")
    p.add_argument("--decode-only", action="store_true", help="leave out the prefill rows")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the comparison needs a CUDA GPU")
    compare("cuda", a.tokens, a.candidates, a.batch, hf=not a.no_hf, next_ns=a.next_n,
            prefill=not a.decode_only)


if __name__ == "__main__":
    main()
