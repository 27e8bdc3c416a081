"""sparse_mla: DeepSeek sparse-MLA attention ops (see README.md)."""
