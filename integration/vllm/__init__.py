"""sparse_mla's vLLM plugin: DeepSeek-V4 and DeepSeek-V3.2 attention on the sparse_mla backends.

Installed with pip, it declares the entry point ``vllm.general_plugins: sparse_mla =
sparse_mla.integration.vllm:register``; vLLM calls :func:`register` in every process (engine
core and workers included). Selecting ``--attention-backend SPARSE_MLA`` (584 B FlashMLA-layout
caches, ``backends/v4/flashmla.py``) or ``SPARSE_MLA_TRTLLM`` (plain caches,
``backends/v4/trtllm.py``) then builds DeepSeek-V4's attention layers from this package;
``--attention-backend SPARSE_MLA_V32`` selects ``v32.py``'s backend for DeepSeek-V3.2 and
``SPARSE_MLA_GLM5`` ``glm5.py``'s for GLM-5.3 (glm5next; through vLLM's registry). Any other
backend name or model is left untouched. See the README's "vLLM" section.
"""


def register() -> None:
    """The ``vllm.general_plugins`` entry point (re-entrant; vLLM may call it repeatedly)."""
    from sparse_mla.integration.vllm import plugin

    plugin.register()
