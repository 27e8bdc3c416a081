"""Shared test plumbing for the backends: which backends, their oracle storage, and one step
run and checked (output against the oracle, caches untouched outside the step's slots)."""
from __future__ import annotations

import torch

from sparse_mla.backends.v4 import LayerConfig, LayerKind
from sparse_mla.backends.v4 import FlashMLABackend
from sparse_mla.backends.v4 import TrtllmBackend
from sparse_mla.tests.backends import oracle
from sparse_mla.tests.backends.sim import Simulator, written_bytes_mask
from sparse_mla.tests.helpers import storage_bytes

# The oracle is exact (float64) math; the kernels round q, P and the output to bf16.
# docs/semantics.md §9's element bounds (atol 1e-3) are FlashMLA's, calibrated on its
# generator's rows of |x| ~ 0.1, where a 190-key softmax is nearly uniform and one missing key
# moves an output by < 1e-3. Here q is RMS-normed (as the model does) and rows are ~N(0, 1), so
# attention is peaked and every (token, head) output row is checked by its relative L2 error:
# bf16 rounding stays well inside the bound, while one key too many or too few moves a row by
# about 1 / sqrt(keys) (7 % at 190 keys; test_step's mutation test proves the bound catches
# it). Rows with no key must be 0.
REL_L2 = 1 / 64
# and no element far off: 0.02 plus one bf16 step of the element (2^-7 of it), FlashMLA's own
# form (atol + rtol |ref|). Outputs are bf16, whose step from 2 to 4 is 0.016 (0.031 above):
# at MTP 8 (512 tokens x 64 heads a step) single elements came out 0.024-0.026 off on an H200
# with every row inside REL_L2; a flat 0.02 grows stricter with the number of elements drawn.
ABS = 2e-2
RTOL = 2 ** -7
KV_SCALE, Q_SCALE = 0.5, 2.0          # non-unit fp8 scales, so a dropped scale shows

BACKENDS = ("flashmla", "trtllm_bf16", "trtllm_fp8")
KINDS = (LayerKind.SWA_ONLY, LayerKind.C4A, LayerKind.C128A)


def config(kind, heads=8, swa_block_size=64, max_num_tokens=640, max_model_len=1024, topk=64,
           **kw):
    return LayerConfig(num_heads=heads, kind=kind, max_num_tokens=max_num_tokens,
                       max_num_reqs=8, max_model_len=max_model_len, topk=topk,
                       swa_block_size=swa_block_size, **kw)


def make(name, cfg, device, impl="auto", attention_impl=None, planner=None):
    """(backend, oracle storage) for a backend name of ``BACKENDS``."""
    if name == "flashmla":
        return (FlashMLABackend(cfg, device, impl, attention_impl, planner),
                oracle.Storage("v4"))
    fp8 = name == "trtllm_fp8"
    be = TrtllmBackend(cfg, device, impl, attention_impl, planner,
                       cache_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                       kv_scale=KV_SCALE if fp8 else 1.0, q_scale=Q_SCALE if fp8 else 1.0)
    return be, oracle.Storage("plain_fp8" if fp8 else "plain_bf16", KV_SCALE, Q_SCALE)


class Harness:
    """A backend, its poisoned caches and a simulator that feeds both."""

    def __init__(self, name, cfg, device, seed=0, impl="auto", attention_impl=None,
                 swa_blocks=64, comp_blocks=64, planner=None):
        self.name, self.cfg, self.device = name, cfg, torch.device(device)
        self.backend, storage = make(name, cfg, device, impl, attention_impl, planner)
        self.sim = Simulator(cfg, device, storage, seed=seed, swa_blocks=swa_blocks,
                             comp_blocks=comp_blocks)
        self.caches = self.backend.allocate_caches(self.sim.num_blocks, fill=0xFF)
        self.fmt = "v4" if name == "flashmla" else "plain"
        self.written = {"swa": set(), "compressed": set()}
        self.cos_sin = self.sim.cos_sin.to(device)
        self.sink = self.sim.sink.to(device)

    def run(self, step, out=None, batch=None, planned=False):
        """Run one simulated step (``batch``: another layer's equal description, to share its
        plan); returns the output."""
        if out is None:
            out = torch.full(step.q.shape, float("nan"), dtype=torch.bfloat16,
                             device=self.device)
        self.backend.forward(step.q, step.kv, self.caches, batch or step.batch, self.cos_sin,
                             self.sink, out, step.compressed_kv, planned=planned)
        self.written["swa"].update(step.swa_slots)
        self.written["compressed"].update(step.comp_slots)
        return out

    def step(self, decodes, prefills, **kw):
        st = self.sim.step(decodes, prefills, **kw)
        return self.run(st), st

    def check(self, out, st, label=""):
        check_rows(out, st.expected, f"{self.name} {self.cfg.kind.name} {label}")
        self.check_untouched()

    def check_untouched(self):
        """Every cache byte outside the slots written so far still holds the poison."""
        for name, cache in self.caches.items():
            bs = self.cfg.swa_block_size if name == "swa" else self.cfg.compressed_block_size
            fmt = self.fmt[name] if isinstance(self.fmt, dict) else self.fmt
            mask = written_bytes_mask(cache, self.written[name], fmt, bs)
            raw = storage_bytes(cache).cpu()
            stray = (raw[~mask] != 0xFF).nonzero()
            assert stray.numel() == 0, (f"{self.name}: {name} cache byte "
                                        f"{int(stray[0])} written outside the step's slots")


def check_rows(out, expected, label=""):
    """Every (token, head) row within ``REL_L2`` of the oracle's; empty rows exactly 0."""
    got = out.double().cpu().reshape(-1, out.shape[-1])
    ref = expected.reshape(-1, expected.shape[-1])
    assert not got.isnan().any(), f"{label}: NaN in the output"
    norm = ref.norm(dim=-1)
    empty = norm == 0
    bad = (got[empty] != 0).any(-1).nonzero()
    assert bad.numel() == 0, f"{label}: row {int(empty.nonzero()[bad[0]])} should be 0"
    rel = (got - ref).norm(dim=-1)[~empty] / norm[~empty]
    worst = int(rel.argmax()) if rel.numel() else None
    assert worst is None or rel[worst] <= REL_L2, (
        f"{label}: (token, head) row {int((~empty).nonzero()[worst])} has relative L2 error "
        f"{float(rel[worst]):.4f} > {REL_L2:.4f}")
    if got.numel():
        over = (got - ref).abs() - (ABS + RTOL * ref.abs())
        i = int(over.argmax())
        assert over.reshape(-1)[i] <= 0, (
            f"{label}: an element is {float((got - ref).abs().reshape(-1)[i]):.4f} off (> "
            f"{ABS} + {RTOL} x |{float(ref.reshape(-1)[i]):.3f}|)")
    return float(rel.max()) if rel.numel() else 0.0


def run_script(h, script, padding_zero=False):
    """Run a harness's steps in order, checking each against its oracle (and, with
    ``padding_zero``, that rows past the batch's tokens come out zero)."""
    for i, kw in enumerate(script):
        out, st = h.step(**kw)
        h.check(out, st, f"step {i}")
        if padding_zero:
            assert torch.count_nonzero(out[st.batch.num_tokens:]) == 0, f"step {i} padding"
    return h
