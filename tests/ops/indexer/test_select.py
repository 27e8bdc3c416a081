"""The Triton top-k select (ops/indexer/triton_select.py) on selection keys built here from
scores and candidate masks by the layout triton_kernels.py documents (high half: the fp32
score's bits in signed order, low half: 2^32 - 1 - id; int64 min: not a candidate), against a
Python ``sorted`` on (-score, id) of the candidates.

Adversarial rows: scores tied at the K-th place (the radix threshold) with ids on both sides,
every score equal, fewer candidates than K, none, K not a power of two, negative and infinite
scores, columns past ``lim`` holding keys larger than any candidate (they must not be read).
Runs compiled on CUDA and, under TRITON_INTERPRET=1, on CPU.
"""
import pytest
import torch

from sparse_mla.ops.indexer import triton_impl, triton_select
from sparse_mla.tests.helpers import seeded, triton_devices

NOT_A_CANDIDATE = -(2 ** 63)
DEVICES = [pytest.param(d, id=d.replace(":", "")) for d in triton_devices()] or [
    pytest.param("cuda", marks=pytest.mark.skip(reason="needs CUDA or TRITON_INTERPRET=1"))]


def keys_of(scores: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Selection keys of fp32 ``scores`` [n, w] (no -0.0) where ``cand``."""
    bits = scores.float().view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, -1 - (bits & 0x7FFFFFFF))
    ids = torch.arange(scores.shape[1])
    return torch.where(cand, (ordered << 32) | (2 ** 32 - 1 - ids), NOT_A_CANDIDATE)


def oracle(scores, cand, k):
    rows = []
    for s, c in zip(scores.tolist(), cand.tolist()):
        ids = sorted((j for j in range(len(s)) if c[j]), key=lambda j: (-s[j], j))[:k]
        rows.append(ids + [-1] * (k - len(ids)))
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, k)


def run(scores, cand, k, device, lim=None):
    keys = keys_of(scores, cand).to(device)
    out = torch.full((scores.shape[0], k), 7, dtype=torch.int32, device=device)
    triton_select.select_topk(keys, out, None if lim is None else lim.to(device))
    return out.cpu()


def tied_rows(g, n, w, levels):
    """Scores from a few values (many ties at every place), no -0.0."""
    vals = torch.tensor([-3.5, -1.0, 0.0, 0.25, 1.0, 7.0, float("inf"), -float("inf")])
    return vals[torch.randint(0, levels, (n, w), generator=g)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("w,k,levels", [(70, 8, 3), (45, 24, 8), (129, 64, 2), (33, 1, 5)])
def test_select_breaks_ties_at_the_threshold_by_lower_id(device, w, k, levels):
    _ties(device, w, k, levels)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk,row_max", [(64, 64), (64, 1 << 14), (128, 64)])
def test_select_levels(device, chunk, row_max, monkeypatch):
    """A row in one program, or cut into chunks whose survivors are merged over several
    levels (``CONFIG["chunk"]`` / ``["row_max"]``): the same rows."""
    for cfg in (triton_select.CONFIG, triton_select.INTERPRET_CONFIG):
        monkeypatch.setitem(cfg, "chunk", chunk)
        monkeypatch.setitem(cfg, "row_max", row_max)
    _ties(device, 700, 8, 3)
    _ties(device, 300, 16, 8)
    test_select_random_scores_and_radix_digits(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [50, 700])
def test_select_returns_the_ids_the_keys_hold(device, width, monkeypatch):
    """Ids come from the keys' low half, not from the columns (callers put other ids there:
    the V4.1 in-candidate stage puts positions); torch.topk's route does the same."""
    monkeypatch.setitem(triton_select.INTERPRET_CONFIG, "row_max", 64)
    g = seeded(width)
    scores = tied_rows(g, 3, width, 4)
    ids = torch.stack([torch.randperm(10 * width, generator=g)[:width] for _ in range(3)])
    bits = scores.float().view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, -1 - (bits & 0x7FFFFFFF))
    keys = (ordered << 32) | (2 ** 32 - 1 - ids)
    want = []
    for s_row, i_row in zip(scores.tolist(), ids.tolist()):
        order = sorted(range(width), key=lambda j: (-s_row[j], i_row[j]))[:9]
        want.append([i_row[j] for j in order])
    out = torch.empty(3, 9, dtype=torch.int32, device=device)
    triton_select.select_topk(keys.clone().to(device), out)      # it overwrites its keys
    assert out.cpu().tolist() == want
    triton_impl.select_from_keys(keys.to(device), out)
    assert out.cpu().tolist() == want


def _ties(device, w, k, levels):
    g = seeded(w + k)
    scores = tied_rows(g, 6, w, levels)
    cand = torch.rand(6, w, generator=g) < 0.8
    cand[0] = True
    cand[1] = False                               # no candidate at all
    cand[2] = torch.arange(w) < k // 2            # fewer candidates than K
    scores[3] = 1.0                               # every score equal
    got = run(scores, cand, k, device)
    assert torch.equal(got, oracle(scores, cand, k))
    assert got[3].tolist()[:min(k, int(cand[3].sum()))] == \
        [j for j in range(w) if cand[3, j]][:k]


@pytest.mark.parametrize("device", DEVICES)
def test_select_random_scores_and_radix_digits(device):
    """Distinct scores sharing their high bytes (the radix passes must go all the way down)
    and scores of every sign and magnitude."""
    g = seeded(3)
    base = torch.randn(4, 300, generator=g)
    near = 1.0 + torch.randint(0, 600, (4, 300), generator=g).float() * 2 ** -23
    scores = torch.cat([base * 1e3, near, -near, base * 1e-30])
    cand = torch.rand(16, 300, generator=g) < 0.9
    got = run(scores, cand, 40, device)
    assert torch.equal(got, oracle(scores, cand, 40))


@pytest.mark.parametrize("device", DEVICES)
def test_select_reads_no_column_past_lim(device):
    """Columns from ``lim[row]`` on hold the largest keys there are; they are not candidates."""
    g = seeded(4)
    scores = torch.randn(5, 90, generator=g)
    lim = torch.tensor([0, 1, 17, 64, 200], dtype=torch.int32)
    cand = torch.ones(5, 90, dtype=torch.bool)
    huge = scores.clone()
    huge[torch.arange(90).unsqueeze(0) >= lim.unsqueeze(1)] = float("inf")
    got = run(huge, cand, 16, device, lim=lim)
    inside = torch.arange(90).unsqueeze(0) < lim.unsqueeze(1)
    assert torch.equal(got, oracle(scores, inside, 16))


@pytest.mark.parametrize("device", DEVICES)
def test_select_k_bounds(device):
    keys = torch.zeros(2, 8, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="K="):
        triton_select.select_topk(keys, torch.empty(2, triton_select.MAX_K + 1,
                                                    dtype=torch.int32, device=device))
