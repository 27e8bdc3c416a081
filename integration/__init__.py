"""Engine integrations of the sparse_mla backends (vLLM; HF transformers)."""
