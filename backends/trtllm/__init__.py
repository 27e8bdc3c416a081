"""DeepSeek-V4 backend over FlashInfer's plain caches (bf16 or per-tensor fp8)."""
from sparse_mla.backends.trtllm.backend import TrtllmBackend  # noqa: F401
