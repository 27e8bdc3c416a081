"""The V3.2 backends under test, their poisoned caches, one step run and checked."""
from __future__ import annotations

import torch

from sparse_mla.backends.v32 import V32Config, V32FlashMLABackend, V32TrtllmBackend
from sparse_mla.tests.backends.cases import check_rows
from sparse_mla.tests.backends.v32.sim import Simulator, written_bytes_mask
from sparse_mla.tests.helpers import storage_bytes

# (name, backend class, kwargs, fp8 cache): both V3.2 layouts, both FlashMLA cache dtypes,
# both fp8 modes
LAYOUTS = {
    "flashmla_fp8_separate": (V32FlashMLABackend, dict(fp8_mode="separate"), True),
    "flashmla_fp8_mixed": (V32FlashMLABackend, dict(fp8_mode="mixed"), True),
    "flashmla_bf16": (V32FlashMLABackend, dict(cache_dtype="bfloat16"), False),
    "trtllm_bf16": (V32TrtllmBackend, {}, False),
}


def config(heads=8, topk=64, max_num_tokens=512, **kw):
    return V32Config(num_heads=heads, max_num_tokens=max_num_tokens, max_num_reqs=8,
                     max_model_len=1024, topk=topk, **kw)


class Harness:
    def __init__(self, layout, cfg, device, seed=0, impl="auto", planner=None, **kw):
        cls, extra, fp8 = LAYOUTS[layout]
        self.layout, self.cfg, self.device = layout, cfg, torch.device(device)
        self.backend = cls(cfg, device, impl, planner=planner, **{**extra, **kw})
        self.sim = Simulator(cfg, device, fp8, seed=seed)
        self.caches = self.backend.allocate_caches({"kv": self.sim.num_blocks}, fill=0xFF)
        self.written = set()

    def run(self, st, out=None, batch=None, planned=False):
        if out is None:
            out = torch.full((st.q.shape[0], self.cfg.num_heads, 512), float("nan"),
                             dtype=torch.bfloat16, device=self.device)
        self.backend.forward(st.q, st.kv, self.caches, batch or st.batch, out=out,
                             planned=planned)
        self.written.update(st.slots)
        return out

    def step(self, decodes, prefills, **kw):
        st = self.sim.step(decodes, prefills, **kw)
        return self.run(st), st

    def check(self, out, st, label=""):
        check_rows(out, st.expected, f"{self.layout} {label}")
        self.check_untouched()

    def check_untouched(self):
        cache = self.caches["kv"]
        mask = written_bytes_mask(cache, self.written, self.cfg.block_size)
        raw = storage_bytes(cache).cpu()
        stray = (raw[~mask] != 0xFF).nonzero()
        assert stray.numel() == 0, (f"{self.layout}: cache byte {int(stray[0])} written "
                                    f"outside the step's slots")
