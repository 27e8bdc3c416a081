"""HF transformers DeepSeek-V4: eager attention vs ``attn_implementation="sparse_mla"``.

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.tools.bench_hf
      [--lengths 1024 4096 ...] [--decode-prompt 4096] [--decode-tokens 32] [--tiny]

One random-weight model with real attention dimensions (integration/transformers/models.py
``bench_config``: 2 layers, CSA then HCA, 64 heads, head_dim 512, window 128, CSA ratio 4
with top-k 512 and 64 indexer heads, HCA ratio 128, hidden 1024), bf16, both implementations
side by side in one process. Prefill: one forward of a batch-1 prompt of each length (cache
on, as generate's prefill), the median of ``--reps`` runs (1 from 16k up), the two
implementations taking turns run by run after two warm-ups each; and the peak memory
allocated during one forward; "OOM" where it does not fit. Decode: ``generate`` of
``--decode-tokens`` greedy tokens after a ``--decode-prompt`` prompt (prefill included, as
the issue's baseline; taking turns in the same way), and the tokens/s of the decode steps
alone: one over the median time from one token to the next (a streamer notes when
generate hands each token out, which it does after copying it to the host), the median over
the timed runs. Rates from a generate's time minus a prefill's swung by 30 % and more between
runs where the prefill is long (eager's 16k prompt: ±0.3 s against 31 steps of 12-25 ms).
Also printed: whether both generated the same tokens.
``--tiny``: the tests' tiny model and short lengths (a CPU smoke run).
``--compile [BACKEND]``: the same tables with ``model.forward`` under ``torch.compile``
(``BACKEND``, default inductor; dynamic shapes) for both implementations: HF's DeepSeek-V4
cannot use a static cache (``_can_compile_fullgraph = False``), so generate does not compile
by itself, and the compiled forward keeps HF's graph breaks; the compile happens in the
warm-ups. ``--decode-only``: skip the prefill table; ``--impls``: with it, only the implementations
named.
"""
import argparse
import statistics
import sys
import time

import torch

import sparse_mla.integration.transformers  # registers "sparse_mla"
from sparse_mla.integration.transformers import models
from sparse_mla.tools import harness

IMPLS = ("eager", "sparse_mla")


def _timed(fn, device):
    harness.sync(device)
    t0 = time.perf_counter()
    out = fn()
    harness.sync(device)
    return time.perf_counter() - t0, out


def _prefill_fn(model, ids):
    def run():
        with torch.no_grad():
            return model(ids).logits[:, -1]
    return run


def _peak(model, ids, device, impl):
    """Peak bytes allocated during one prefill forward (CPU: None); raises on OOM."""
    model.set_attn_implementation(impl)
    if device != "cuda":
        _prefill_fn(model, ids)()
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _prefill_fn(model, ids)()
    return torch.cuda.max_memory_allocated() - base


def _alternating(model, device, reps, runs):
    """Median seconds per implementation of ``runs[impl]()``, the implementations taking
    turns rep by rep after two warm-ups each, so that drift (clocks, allocator, other work)
    falls on both alike. Measured first-impl-then-the-other, the same eager forward read very
    different times ahead of sparse_mla and behind it (lab/perf-log.md, "Session 35: HF
    transformers, eager vs sparse_mla, measured taking turns")."""
    times = {impl: [] for impl in runs}
    for rep in range(reps + 2):
        for impl, fn in runs.items():
            model.set_attn_implementation(impl)
            if device == "cuda":
                # the other implementation's freed blocks would otherwise fragment this one's
                # (eager's long prompts only fit once it is emptied: lab/perf-log.md,
                # "Session 35: HF transformers, eager vs sparse_mla, measured taking turns").
                # So each timed run starts from an empty allocator cache and pays its own
                # cudaMalloc calls: eager's prefill allocates far more than ours, which this
                # charges to eager (not measured; decode steps allocate little)
                torch.cuda.empty_cache()
            t = _timed(fn, device)[0]
            if rep >= 2:
                times[impl].append(t)
    return {impl: statistics.median(ts) for impl, ts in times.items()}


def _prefill(model, ids, device, reps):
    """``{impl: (median seconds, peak bytes)}``, None for an implementation that runs out of
    memory (the others still timed)."""
    cells = {}
    for impl in IMPLS:
        try:
            cells[impl] = _peak(model, ids, device, impl)
        except torch.cuda.OutOfMemoryError:
            cells[impl] = None
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
    runs = {impl: _prefill_fn(model, ids) for impl in IMPLS
            if device != "cuda" or cells[impl] is not None}
    medians = _alternating(model, device, reps, runs) if runs else {}
    return {impl: (medians[impl], cells[impl]) if impl in medians else None for impl in IMPLS}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+",
                   default=[1024, 4096, 8192, 16384, 24576, 32768])
    p.add_argument("--decode-prompt", type=int, default=4096)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--tiny", action="store_true", help="tiny model, short lengths (CPU smoke)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="model.forward under torch.compile(backend=BACKEND, dynamic=True) for "
                        "both implementations")
    p.add_argument("--decode-only", action="store_true", help="no prefill table")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                   help="with --decode-only: time these implementations only (e.g. one "
                        "process per implementation filling a shared inductor cache)")
    args = p.parse_args(argv)
    if tuple(args.impls) != IMPLS and not args.decode_only:
        p.error("--impls needs --decode-only (the prefill table compares both)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU, and torch sees none here "
                         "(--device cpu runs on the CPU)")
    if args.tiny:
        config = models.tiny_config()
        args.lengths = [n for n in args.lengths if n <= 64] or [24, 40]
        args.decode_prompt, args.decode_tokens = min(args.decode_prompt, 24), \
            min(args.decode_tokens, 4)
    else:
        config = models.bench_config()
    model = models.random_model(config, torch.bfloat16, device=device)
    if args.decode_only:
        args.lengths = []
    if args.compile:
        # one graph per implementation and per prefill / decode shape class: room for both
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        model.forward = torch.compile(model.forward, backend=args.compile, dynamic=True)
    print(f"device: {harness.device_name(device)}   torch {torch.__version__}   transformers "
          f"{sparse_mla.integration.transformers.registration.installed_version()}", flush=True)
    print(f"model: {config.num_hidden_layers} layers {config.layer_types}, "
          f"{config.num_attention_heads} heads x {config.head_dim}, window "
          f"{config.sliding_window}, ratios {config.compress_rates}, top-k {config.index_topk}, "
          f"hidden {config.hidden_size}, bf16"
          + (f"; model.forward under torch.compile({args.compile}, dynamic)" if args.compile
             else ""), flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in sorted(set(args.lengths)):
        ids = torch.randint(3, config.vocab_size, (1, n), generator=g).to(device)
        cells = _prefill(model, ids, device, 1 if n >= 16384 else args.reps)
        e, s = cells["eager"], cells["sparse_mla"]
        fmt = lambda c: "OOM" if c is None else f"{c[0] * 1e3:,.1f} ms"  # noqa: E731
        mem = lambda c: "-" if c is None or c[1] is None else f"{c[1] / 2**30:.2f} GiB"  # noqa: E731
        speed = f"{e[0] / s[0]:.2f}x" if e and s else "-"
        rows.append((n, fmt(e), mem(e), fmt(s), mem(s), speed))
        print(f"  prefill {n} done", file=sys.stderr, flush=True)
    head = ("prompt", "eager", "eager peak", "sparse_mla", "sparse_mla peak", "speed-up")
    if rows:
        _table(head, rows)

    ids = torch.randint(3, config.vocab_size, (1, args.decode_prompt), generator=g).to(device)
    out, rows, runs, clocks = {}, [], {}, {}
    for impl in args.impls:
        model.set_attn_implementation(impl)
        try:
            # warm-up over the same steps: Triton compiles its launch variants here, once
            # (and torch.compile its graphs)
            t0 = time.perf_counter()
            out[impl] = models.greedy(model, ids, new_tokens=args.decode_tokens)
            print(f"  {impl}: first generate {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
            clocks[impl] = []

            def run(impl=impl):
                clocks[impl].append(harness.TokenClock())
                return models.greedy(model, ids, new_tokens=args.decode_tokens,
                                     streamer=clocks[impl][-1])
            runs[impl] = run
        except torch.cuda.OutOfMemoryError:
            rows.append((impl, "OOM", "-", "-", "-"))
    reps = max(1, args.reps)
    medians = _alternating(model, device, reps, runs) if runs else {}
    for impl in runs:
        t = medians[impl]
        steps = [c.step_median() for c in clocks[impl][-reps:]]
        rate = f"{1 / statistics.median(steps):,.1f}" if None not in steps else "-"
        rows.append((impl, f"{t * 1e3:,.1f} ms", f"{args.decode_tokens / t:,.1f}", rate,
                     _spread([g for c in clocks[impl][-reps:] for g in c.gaps()])))
    print()
    _table((f"generate {args.decode_tokens} after {args.decode_prompt}"
            + (" (compiled)" if args.compile else ""), "total", "tokens/s (with prefill)",
            "decode tokens/s", "step ms p10 / p50 / p90"), rows)
    if len(out) == 2:
        same = torch.equal(out["eager"], out["sparse_mla"])
        print(f"same greedy tokens: {same}")
    return 0


def _spread(gaps):
    """p10 / p50 / p90 of the timed runs' decode steps, in ms: a host-bound step's time
    moves by tens of percent on the lent machines, and one median hides whether both
    implementations moved alike."""
    if len(gaps) < 2:
        return "-"
    q = statistics.quantiles(gaps, n=10)
    return f"{q[0] * 1e3:.2f} / {statistics.median(gaps) * 1e3:.2f} / {q[-1] * 1e3:.2f}"


def _table(head, rows):
    widths = [max(len(str(r[i])) for r in list(rows) + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths))  # noqa: E731
    print(line(head))
    print(line(["-" * w for w in widths]))
    for r in rows:
        print(line(r))


if __name__ == "__main__":
    sys.exit(main())
