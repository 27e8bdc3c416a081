"""Where HF DeepSeek-V4's time goes with ``attn_implementation="sparse_mla"`` vs eager.

  PYTHONPATH=$(bash tools/pyroot.sh) python3 -m sparse_mla.lab.tools.profile_hf
      [--prompt 1024] [--decode 8] [--rows 25]

For each implementation: the attention function alone per call, per layer type and query
count (prefill and decode steps): "synced" with a device sync on each side (host time plus
its kernels' GPU time: the issue's measure), and "host" without syncs (the Python and launch
time the call adds to HF's host-bound step); the host syncs of one generate; then (unless
``--no-tables``) a torch profile of one prefill forward and of ``--decode`` decode steps, top
ops by self CPU time and by device time. The model is ``models.bench_config()``, the
benchmark's (tools/bench_hf.py).
"""
import argparse
import collections
import cProfile
import pstats
import sys
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AttentionInterface

import sparse_mla.integration.transformers  # noqa: F401  (registers "sparse_mla")
from sparse_mla.integration.transformers import models
from sparse_mla.ops.common.benchcase import host_us
from sparse_mla.tools import harness


def _by_layer(module, a):
    """An attention call's key: its layer type and query count."""
    return module.layer_type, a[0].shape[2]


def _by_indexer(module, a):
    """An indexer forward's key: "indexer" and its query count."""
    return "indexer", a[0].shape[1]


def _timed(fn, key, store, synced, where=_by_layer):
    """``fn`` recording its time per ``where(module, args)`` (layer type and query count):
    with a device sync on each side (``synced``), or the host time of the call alone."""
    def timed(module, *a, **k):
        if synced:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(module, *a, **k)
        if synced:
            torch.cuda.synchronize()
        store[(key, *where(module, a))].append(time.perf_counter() - t0)
        return out
    return timed


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--no-tables", action="store_true",
                   help="skip the torch profiler tables (per-call times and syncs only)")
    p.add_argument("--decode-tables", action="store_true",
                   help="the torch profiler tables of the decode steps only (a long prompt's "
                        "eager prefill under the profiler needs its 100+ GiB again)")
    p.add_argument("--cprofile", action="store_true",
                   help="also a Python profile of sparse_mla's decode steps "
                        "(host time by function)")
    p.add_argument("--parts", action="store_true",
                   help="also the host time of each piece of one decode call of each layer type "
                        "(the call's own arguments replayed in a loop)")
    args = p.parse_args(argv)
    config = models.bench_config()
    model = models.random_model(config, torch.bfloat16, device="cuda")
    ids = torch.randint(3, config.vocab_size, (1, args.prompt), device="cuda")
    stores = {"synced": collections.defaultdict(list), "host": collections.defaultdict(list)}
    step_ms = {}
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod
    eager_fn = mod.eager_attention_forward
    sparse_fn = AttentionInterface._global_mapping["sparse_mla"]
    indexer_fn = mod.DeepseekV4Indexer.forward

    for impl in ("eager", "sparse_mla"):
        model.set_attn_implementation(impl)
        for _ in range(2):                                # warm-up: compiles
            models.greedy(model, ids, new_tokens=args.decode)
        # per-call attention timings, synced and host only
        for how, store in stores.items():
            synced = how == "synced"
            mod.eager_attention_forward = _timed(eager_fn, "eager", store, synced)
            mod.DeepseekV4Indexer.forward = _timed(indexer_fn, impl, store, synced,
                                                   where=_by_indexer)
            AttentionInterface._global_mapping["sparse_mla"] = _timed(sparse_fn, "sparse_mla",
                                                                      store, synced)
            models.greedy(model, ids, new_tokens=args.decode)
            mod.eager_attention_forward = eager_fn
            mod.DeepseekV4Indexer.forward = indexer_fn
            AttentionInterface._global_mapping["sparse_mla"] = sparse_fn
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids)
        torch.cuda.synchronize()
        pre = time.perf_counter() - t0
        clock = harness.TokenClock()
        t0 = time.perf_counter()
        models.greedy(model, ids, new_tokens=args.decode, streamer=clock)
        torch.cuda.synchronize()
        gen = time.perf_counter() - t0
        # the median gap between tokens: generate minus a separately timed prefill swung by
        # 30 % and more between runs (lab/perf-history.md, "HF DeepSeek-V4 after the indexer hook's
        # kept choice")
        per_step = clock.step_median() or float("nan")
        step_ms[impl] = per_step * 1e3
        print(f"\n== {impl}: prefill {args.prompt}: {pre * 1e3:.2f} ms; generate "
              f"{args.decode}: {gen * 1e3:.2f} ms ({per_step * 1e3:.2f} ms/decode step, the "
              f"median time between tokens)", flush=True)
        # host synchronizations of one generate, by the Python line that caused them
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            models.greedy(model, ids, new_tokens=args.decode)
            torch.cuda.set_sync_debug_mode(0)
        syncs = collections.Counter(f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught
                                    if "synchroniz" in str(w.message))
        print(f"-- {impl} generate {args.decode}: {sum(syncs.values())} host syncs: "
              f"{dict(syncs.most_common(8))}")
        if args.no_tables:
            continue
        if not args.decode_tables:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with torch.no_grad():
                    model(ids)
                torch.cuda.synchronize()
            print(f"-- {impl} prefill, by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
            print(f"-- {impl} prefill, by device time")
            print(prof.key_averages().table(sort_by="self_device_time_total",
                                            row_limit=args.rows))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            models.greedy(model, ids, new_tokens=args.decode)
            torch.cuda.synchronize()
        print(f"-- {impl} generate {args.decode}, by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
        print(f"-- {impl} generate {args.decode}, by device time")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.rows))
    if args.cprofile:
        model.set_attn_implementation("sparse_mla")
        prof = cProfile.Profile()
        prof.enable()
        models.greedy(model, ids, new_tokens=args.decode)
        torch.cuda.synchronize()
        prof.disable()
        stats = pstats.Stats(prof, stream=sys.stdout).strip_dirs()
        print("\n-- sparse_mla generate, Python profile by own time")
        stats.sort_stats("tottime").print_stats(args.rows)
        print("-- the same, by cumulative time, sparse_mla's functions")
        stats.sort_stats("cumulative").print_stats("sparse_mla|attention|index_lists|dispatch|"
                                                    "checks|opdef|triton", args.rows * 2)
    print("\nattention function (and the indexer's forward) per call (median ms): impl, layer "
          "type, queries, synced, host, calls")
    med = lambda v: sorted(v)[len(v) // 2] * 1e3  # noqa: E731
    synced, host = stores["synced"], stores["host"]
    for key in sorted(synced):
        print(f"  {key[0]:<10} {key[1]:<30} q={key[2]:<6} {med(synced[key]):8.3f} "
              f"{med(host[key]) if host.get(key) else float('nan'):8.3f}  n={len(synced[key])}")
    # one generate filled each store: its decode steps' attention calls, all layers
    steps = max(1, args.decode - 1)
    for impl, ms in step_ms.items():
        for part in ("attention calls", "indexer forwards"):
            t = sum(sum(v) for k, v in host.items() if k[0] == impl and k[2] == 1
                    and (k[1] == "indexer") == (part == "indexer forwards")) * 1e3 / steps
            print(f"decode step, {impl}: {ms:.2f} ms; its {part}' host time {t:.3f} ms "
                  f"({100 * t / ms:.1f} %)")
    if args.parts:
        model.set_attn_implementation("sparse_mla")
        _parts(model, ids, sparse_fn)
    return 0


def _parts(model, ids, sparse_fn):
    """Host time of the pieces of one decode call per layer type: the call's arguments are
    captured during a generate, then each piece runs alone in a loop (its outputs unused)."""
    captured = {}

    def capture(module, *a, **k):
        if a[0].shape[2] == 1:
            captured.setdefault(module.layer_type, (module, a, k))
        return sparse_fn(module, *a, **k)

    AttentionInterface._global_mapping["sparse_mla"] = capture
    try:
        models.greedy(model, ids, new_tokens=2)
    finally:
        AttentionInterface._global_mapping["sparse_mla"] = sparse_fn
    small = torch.zeros(64, device="cuda")
    print("\n-- host time per piece of one decode call (us, median of 5 x 300 calls)")
    yardstick = host_us(lambda: small.add_(1), reps=300)
    print(f"   yardstick: one small torch launch (add_) {yardstick:.1f}")
    for layer_type, (module, a, k) in captured.items():
        _time_pieces(layer_type, module, a, k, sparse_fn)


def _time_pieces(layer_type, module, a, k, sparse_fn):
    from sparse_mla.integration.transformers import attention, index_lists, op_route
    from sparse_mla.ops.common import checks
    query, key, value, mask = a[:4]
    b, h, s, d = query.shape
    n = key.shape[2]
    q = query[0].transpose(0, 1)
    kv = key[:, 0].reshape(b * n, 1, d)
    sink = attention._sinks(k.get("s_aux"), h, query.device)
    width = attention.list_width(module, n, s)
    kind = op_route.call_kind(q, kv, width, sink)
    route = op_route.route_for(kind)
    width = op_route.list_width(route, width)
    idx, lens, bad = index_lists.visible_index_lists(mask[:, 0], width, flat=True, reuse=True)
    out = op_route.attend(kind, route, q, kv, idx.view(s, 1, width), lens.view(s), sink, 0.04)
    pieces = {
        "whole call": lambda: sparse_fn(module, *a, **k),
        "input checks": lambda: attention._check_inputs(module, query, key, value, mask, 0.0),
        "sinks (kept)": lambda: attention._sinks(k.get("s_aux"), h, query.device),
        "call kind + route": lambda: op_route.route_for(op_route.call_kind(q, kv, width, sink)),
        "index lists (Triton)": lambda: index_lists.visible_index_lists(
            mask[:, 0], width, flat=True, reuse=True),
        "attend (kept route)": lambda: op_route.attend(
            kind, route, q, kv, idx.view(s, 1, width), lens.view(s), sink, 0.04),
        "NaN poison (masked_fill_)": lambda: out.masked_fill_(bad.view(s, 1, 1), float("nan")),
        "list width (config reads)": lambda: attention.list_width(module, n, s),
        "value-check switch": lambda: checks.value_checks_enabled(mask),
    }
    if route is None:
        route_name = "none"
    else:
        route_name = "FlashMLA direct" if route.direct_flash_mla else route.choice.impl
    print(f"   {layer_type} (route {route_name}, width {width}, keys {n}):")
    for name, fn in pieces.items():
        print(f"     {name:28s} {host_us(fn, reps=300):7.1f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        sparse_fn(module, *a, **k)
    prof.disable()
    torch.cuda.synchronize()
    print(f"   {layer_type}: Python profile of 300 whole calls, by own time")
    pstats.Stats(prof, stream=sys.stdout).strip_dirs().sort_stats("tottime").print_stats(18)

if __name__ == "__main__":
    sys.exit(main())
