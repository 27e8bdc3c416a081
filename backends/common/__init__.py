"""What every model's backends share: the backend contract and step runner (base.py), the batch
description, cache specs, the checks every model runs (validate.py) and the step planner every
model's planner builds on (planner.py). Each model's backends are their own package:
``backends/v4``, ``backends/v32``, ``backends/v41``."""
from sparse_mla.backends.common.batch import BatchDescription  # noqa: F401
from sparse_mla.backends.common.spec import CacheSpec  # noqa: F401
