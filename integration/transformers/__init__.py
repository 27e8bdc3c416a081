"""HF transformers integration: ``attn_implementation="sparse_mla"`` for DeepSeek-V4.

    import sparse_mla.integration.transformers        # registers "sparse_mla"
    model = DeepseekV4ForCausalLM.from_pretrained(path, attn_implementation="sparse_mla")

Importing registers; ``register()`` may be called again at no cost.
"""
from sparse_mla.integration.transformers.registration import (  # noqa: F401
    NAME,
    register,
    unsupported_reason,
)

register()
