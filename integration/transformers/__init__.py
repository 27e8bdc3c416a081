"""HF transformers integration: ``attn_implementation="sparse_mla"`` for DeepSeek-V4 and for
GLM-5.3's (``glm5_next``) DSA layers (glm5.py; give it the text model:
``attn_implementation={"text_config": "sparse_mla", "vision_config": "sdpa"}``).

    import sparse_mla.integration.transformers        # registers "sparse_mla"
    model = DeepseekV4ForCausalLM.from_pretrained(path, attn_implementation="sparse_mla")

Importing registers; ``register()`` may be called again at no cost. Importing also hooks
DeepSeek-V4's indexer (``indexer.install``): under "sparse_mla" its top-k runs through
``sparse_mla::indexer_topk_prefill``.
"""
from sparse_mla.integration.transformers import indexer as _indexer
from sparse_mla.integration.transformers.registration import (  # noqa: F401
    NAME,
    register,
    unsupported_reason,
)

register()
_indexer.install()
