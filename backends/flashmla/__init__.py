"""DeepSeek-V4 backend over FlashMLA's 584 B caches (SWA + compressed)."""
from sparse_mla.backends.flashmla.backend import FlashMLABackend  # noqa: F401
