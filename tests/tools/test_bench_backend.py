"""The step benchmark's batches are valid batches: the backend's own value checks accept them
(positions, block tables, slots and top-k ids agree), and a small one runs on CPU against the
op it times."""
import pytest
import torch

from sparse_mla.backends.v4 import LayerConfig, LayerKind
from sparse_mla.backends.v4 import FlashMLABackend
from sparse_mla.tools import bench_backend


@pytest.mark.parametrize("kind", (LayerKind.C4A, LayerKind.C128A), ids=lambda k: k.name)
def test_benchmark_batches_pass_the_backends_checks(kind):
    lens = [(300, 1), (130, 2), (0, 64)]          # two decodes, then a prefill from position 0
    cfg = LayerConfig(num_heads=2, kind=kind, max_num_tokens=67, max_num_reqs=3,
                      max_model_len=512, topk=64)
    batch, blocks, T = bench_backend._batch(cfg, lens, "cpu", torch.Generator().manual_seed(0))
    assert (batch.num_decodes, batch.num_decode_tokens, batch.num_prefill_tokens) == (2, 3, 64)
    be = FlashMLABackend(cfg)
    caches = be.allocate_caches(blocks)
    q = torch.randn(T, 2, 512).to(torch.bfloat16)
    be.validate(q, caches, batch, torch.randn(T, 512).to(torch.bfloat16),
                bench_backend._cos_sin(512, "cpu"),
                torch.randn(T, 512).to(torch.bfloat16) if kind.compressed else None)
