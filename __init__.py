"""sparse_mla: DeepSeek sparse-MLA attention ops (see README.md and docs/).

Importing this package registers no op. Import a family to register its ``torch.ops.sparse_mla``
ops (``import sparse_mla.ops.cache_insert``, ``...index_combine``, ``...flashmla_decode``,
``...trtllm_decode``, ``...indexer``); ``sparse_mla.ops.common.dispatch.load_all()`` imports
every family.
"""
