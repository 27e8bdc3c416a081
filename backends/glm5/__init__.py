"""GLM-5.3-Flash DSA layers (no-RoPE MLA over the V3.2 cache record, docs/semantics.md §13)."""
from sparse_mla.backends.glm5.config import Glm5Config  # noqa: F401
from sparse_mla.backends.glm5.flashmla import Glm5FlashMLABackend  # noqa: F401
from sparse_mla.backends.glm5.indexer_step import (  # noqa: F401
    Glm5IndexerConfig,
    Glm5IndexerInputs,
    Glm5IndexerStep,
)
