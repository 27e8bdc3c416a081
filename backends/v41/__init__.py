"""DeepSeek-V4.1 attention backends: its layer kinds (SWA only, C1A, C2A, both with the
indexer's top-k), 32-token SWA pages, compressed caches shared across layers."""
from sparse_mla.backends.v41.flashmla import V41FlashMLABackend  # noqa: F401
from sparse_mla.backends.v41.config import V41Kind, V41LayerConfig  # noqa: F401
