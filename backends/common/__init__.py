"""What every backend shares: the batch description, the layer config, cache specs, the
up-front validation and the index planner (persistent buffers)."""
from sparse_mla.backends.common.batch import BatchDescription, LayerKind  # noqa: F401
from sparse_mla.backends.common.config import LayerConfig  # noqa: F401
from sparse_mla.backends.common.spec import CacheSpec  # noqa: F401
