"""Shared test plumbing for the backends: which backends, their oracle storage, and one step
run and checked (output against the oracle, caches untouched outside the step's slots)."""
from __future__ import annotations

import torch

from sparse_mla.backends.common import LayerConfig, LayerKind
from sparse_mla.backends.flashmla import FlashMLABackend
from sparse_mla.backends.trtllm import TrtllmBackend
from sparse_mla.tests.backends import oracle
from sparse_mla.tests.backends.sim import Simulator, storage_bytes, written_bytes_mask

# Decode rows: FlashMLA's decode tolerance (rtol 2/128, atol 1e-3); prefill rows: its prefill
# one (rtol 3/128, atol 8e-4). One bound covers both: the larger of each (SPEC §9).
RTOL, ATOL = 3 / 128, 1e-3
KV_SCALE, Q_SCALE = 0.5, 2.0          # non-unit fp8 scales, so a dropped scale shows

BACKENDS = ("flashmla", "trtllm_bf16", "trtllm_fp8")
KINDS = (LayerKind.SWA_ONLY, LayerKind.C4A, LayerKind.C128A)


def config(kind, heads=8, swa_block_size=64, max_num_tokens=640, max_model_len=1024, topk=64,
           **kw):
    return LayerConfig(num_heads=heads, kind=kind, max_num_tokens=max_num_tokens,
                       max_num_reqs=8, max_model_len=max_model_len, topk=topk,
                       swa_block_size=swa_block_size, **kw)


def make(name, cfg, device, impl="auto", attention_impl=None):
    """(backend, oracle storage) for a backend name of ``BACKENDS``."""
    if name == "flashmla":
        return FlashMLABackend(cfg, device, impl, attention_impl), oracle.Storage("v4")
    fp8 = name == "trtllm_fp8"
    be = TrtllmBackend(cfg, device, impl, attention_impl,
                       cache_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                       kv_scale=KV_SCALE if fp8 else 1.0, q_scale=Q_SCALE if fp8 else 1.0)
    return be, oracle.Storage("plain_fp8" if fp8 else "plain_bf16", KV_SCALE, Q_SCALE)


class Harness:
    """A backend, its poisoned caches and a simulator that feeds both."""

    def __init__(self, name, cfg, device, seed=0, impl="auto", attention_impl=None,
                 swa_blocks=64, comp_blocks=64):
        self.name, self.cfg, self.device = name, cfg, torch.device(device)
        self.backend, storage = make(name, cfg, device, impl, attention_impl)
        self.sim = Simulator(cfg, device, storage, seed=seed, swa_blocks=swa_blocks,
                             comp_blocks=comp_blocks)
        self.caches = self.backend.allocate_caches(self.sim.num_blocks, fill=0xFF)
        self.fmt = "v4" if name == "flashmla" else "plain"
        self.written = {"swa": set(), "compressed": set()}
        self.cos_sin = self.sim.cos_sin.to(device)
        self.sink = self.sim.sink.to(device)

    def run(self, step, out=None):
        """Run one simulated step; returns (out, step)."""
        if out is None:
            out = torch.full(step.q.shape, float("nan"), dtype=torch.bfloat16,
                             device=self.device)
        self.backend.forward(step.q, step.kv, self.caches, step.batch, self.cos_sin, self.sink,
                             out, step.compressed_kv)
        self.written["swa"].update(step.swa_slots)
        self.written["compressed"].update(step.comp_slots)
        return out

    def step(self, decodes, prefills, **kw):
        st = self.sim.step(decodes, prefills, **kw)
        return self.run(st), st

    def check(self, out, st, label=""):
        got = out.double().cpu()
        assert not got.isnan().any(), f"{label}: NaN in the output"
        torch.testing.assert_close(got, st.expected, rtol=RTOL, atol=ATOL, msg=lambda m: (
            f"{self.name} {self.cfg.kind.name} {label}: {m}"))
        self.check_untouched()

    def check_untouched(self):
        """Every cache byte outside the slots written so far still holds the poison."""
        for name, cache in self.caches.items():
            bs = self.cfg.swa_block_size if name == "swa" else self.cfg.compressed_block_size
            mask = written_bytes_mask(cache, self.written[name], self.fmt, bs)
            raw = storage_bytes(cache)
            stray = (raw[~mask] != 0xFF).nonzero()
            assert stray.numel() == 0, (f"{self.name}: {name} cache byte "
                                        f"{int(stray[0])} written outside the step's slots")
