"""What every backend shares: the backend contract and step runner (base.py), the batch
description, cache specs, the up-front validation and the step planners (persistent buffers,
the chunked-prefill plan); and DeepSeek-V4's layer config, planner and model hooks (v4.py)."""
from sparse_mla.backends.common.batch import BatchDescription, LayerKind  # noqa: F401
from sparse_mla.backends.common.config import LayerConfig  # noqa: F401
from sparse_mla.backends.common.spec import CacheSpec  # noqa: F401
