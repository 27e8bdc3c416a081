"""An explicit-softmax oracle written independently of ops/attention/reference.py, plus
small builders for hand-made DSv4 / V3.2 decode inputs."""
from __future__ import annotations

import math

import torch

I32 = torch.int32


def attend(q, keys, scale, sink=None, out_scale=1.0):
    """q [H, D] (any dtype, exact values), keys [n, D] -> out [H, 512] fp32 (0 if n == 0).
    p_j = exp(s_j - m) / sum exp(s - m); out = sum p_j k_j[:512] * sigmoid(lse - sink)."""
    H = q.shape[0]
    if keys.shape[0] == 0:
        return torch.zeros(H, 512, dtype=torch.float64)
    qd, kd = q.double(), keys.double()
    out = torch.zeros(H, 512, dtype=torch.float64)
    for h in range(H):
        s = [scale * float(qd[h] @ kd[j]) for j in range(kd.shape[0])]
        m = max(s)
        w = [math.exp(x - m) for x in s]
        z = sum(w)
        lse = m + math.log(z)
        o = sum(w[j] / z * kd[j, :512] for j in range(len(w)))
        if sink is not None:
            sk = float(sink[h])
            if sk == float("inf"):
                o = o * 0
            elif sk != float("-inf"):
                o = o / (1 + math.exp(sk - lse))
        out[h] = o * out_scale
    return out


def rows(cache, slots):
    """Rows of a [pages, page_size, D] contiguous pool by flat slot id (float64)."""
    flat = cache.reshape(-1, cache.shape[-1])
    return flat[torch.as_tensor(slots, dtype=torch.long)].double()


def poisoned_pool(pages, page, dim):
    """An fp32 pool whose every row is NaN until written; convert with ``.to(dtype)`` once
    filled (NaN survives the bf16 and e4m3 conversions)."""
    return torch.full((pages, page, dim), float("nan"), dtype=torch.float32)


def fill(pool, slots, gen, dtype=torch.bfloat16, scale=1.0):
    """Write random rows (already rounded to ``dtype``) at flat ``slots`` of an fp32 pool."""
    flat = pool.view(-1, pool.shape[-1])
    vals = (torch.randn(len(slots), pool.shape[-1], generator=gen) * scale).to(dtype).float()
    flat[torch.as_tensor(slots, dtype=torch.long)] = vals
    return vals
