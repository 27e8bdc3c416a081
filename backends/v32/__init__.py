"""DeepSeek-V3.2 attention backends: one cache of every token, the indexer's top-k over it."""
from sparse_mla.backends.v32.config import V32Config  # noqa: F401
from sparse_mla.backends.v32.flashmla import V32FlashMLABackend  # noqa: F401
from sparse_mla.backends.v32.trtllm import V32TrtllmBackend  # noqa: F401
