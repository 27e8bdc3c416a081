"""Per-layer call counts of the plugin's layer, for proving in tests that our code ran.

Off unless ``SPARSE_MLA_VLLM_CALL_LOG`` names a file path prefix; then each process that runs
our layer (vLLM's worker) keeps ``<prefix>.<pid>.json`` up to date after every call
(``{layer prefix: {"write": n, "attend": n}}``): the worker may be killed at shutdown, so
nothing waits for an exit hook.
"""
import collections
import json
import os

ENV = "SPARSE_MLA_VLLM_CALL_LOG"
_counts = collections.defaultdict(collections.Counter)


def record(layer: str, what: str) -> None:
    prefix = os.environ.get(ENV)
    if not prefix:
        return
    _counts[layer][what] += 1
    path = f"{prefix}.{os.getpid()}.json"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({k: dict(v) for k, v in _counts.items()}, f)
    os.replace(tmp, path)
