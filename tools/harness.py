"""Timing and roofline measurement shared by the CLI and the benchmarks.

Every ratio the tools print is measured in the same process: the copy bandwidth and the matmul
rate are the card's own numbers for this run, not datasheet values.
"""
from __future__ import annotations

import statistics
import time

import torch

# CUDA-graph timing lives with the op families' benchmark helpers (ops/ cannot import tools/)
from sparse_mla.ops.common.benchcase import time_graph  # noqa: F401


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, device, *, iters=None) -> float:
    """Median seconds per call. CUDA: Triton's do_bench (clears L2 between calls)."""
    if device == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3
    fn()
    times = []
    for _ in range(iters or 3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = (1 << 30) if device == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / time_fn(lambda: dst.copy_(src), device)


def matmul_rate(device) -> float:
    """Dense matmul FLOP/s: bf16 8192³ on CUDA, fp32 1024³ on CPU."""
    n, dt = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    return 2 * n ** 3 / time_fn(lambda: a @ b, device)


def device_name(device) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    import platform
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


class TokenClock:
    """A ``generate`` streamer (``streamer=``) noting when each token is handed out: the
    prompt first, then the first token (prefill), then one per decode step. Generate hands a
    token out after copying it to the host, so the gaps are the decode steps' times."""

    def __init__(self):
        self.stamps = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass

    def gaps(self):
        """Seconds of each decode step, in order."""
        return [b - a for a, b in zip(self.stamps[1:], self.stamps[2:])]

    def step_median(self):
        """Median seconds of a decode step (None without one)."""
        gaps = self.gaps()
        return statistics.median(gaps) if gaps else None
