"""How an op family describes itself to the CLI and the benchmarks (tools/).

Each family's ``bench.py`` exposes ``cases(device: str, small: bool) -> list[BenchCase]``.
The harness makes fresh inputs, runs every implementation that can run, times it, compares it
with the reference output and prints one table row per (case, implementation).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch


@dataclasses.dataclass
class BenchCase:
    op: str                                   # op name without the namespace
    shape: str                                # human-readable size, e.g. "N=4096 H=128"
    make: Callable[[], dict]                  # fresh inputs on the target device
    run: Callable[[dict, str], Any]           # (inputs, impl) -> output to compare; may mutate
    bytes: int                                # bytes a perfect kernel must read + write
    flops: int = 0                            # useful floating-point operations, 0 if n/a
    # (reference output, other output) -> max error; exact ops report mismatching elements
    compare: Callable[[Any, Any], float] = None
    error_unit: str = "max abs err"
    tolerance: float = 0.0                    # largest error that still counts as agreeing
    # Implementations the reference may be too slow for at this size: then the harness
    # compares against the reference run on a copy of the inputs only if reference=True.
    reference: bool = True


def host_us(fn: Callable[[], Any], reps: int = 100) -> float:
    """Median over 5 rounds of the host time per call of ``fn`` in microseconds: no sync
    inside a round (a few hundred calls at most, so the launch queue never fills), a CUDA
    sync around each."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        rounds.append((time.perf_counter() - t0) / reps * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def time_graph(fn, reps=10):
    """Median seconds per call with ``reps`` calls captured in one CUDA graph: the GPU time of
    a step run under graphs (no Python or launch overhead). None if ``fn`` cannot be captured
    (e.g. it synchronizes with the host)."""
    import triton.testing
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except RuntimeError:
        return None
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=50, return_mode="median")
    return ms * 1e-3 / reps
