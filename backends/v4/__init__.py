"""DeepSeek-V4 attention backends: a sliding-window cache and, on compressed layers (C4A, C128A),
a compressed cache; FlashMLA's 584 B layout (flashmla.py) or FlashInfer's plain one (trtllm.py)."""
from sparse_mla.backends.v4.config import LayerConfig, LayerKind  # noqa: F401
from sparse_mla.backends.v4.flashmla import FlashMLABackend  # noqa: F401
from sparse_mla.backends.v4.trtllm import TrtllmBackend  # noqa: F401
