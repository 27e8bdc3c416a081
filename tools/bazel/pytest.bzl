"""`py_pytest`: a py_test that runs its test files under pytest.

    py_pytest(
        name = "reference_test",
        srcs = ["test_reference.py"],
        deps = ["//ops/cache_insert"],
        env = {"TRITON_INTERPRET": "1"},   # optional: e.g. run Triton kernels interpreted
    )
"""

def py_pytest(name, srcs, deps = [], args = [], data = [], env = {}, size = "medium", tags = [], **kwargs):
    native.py_test(
        name = name,
        srcs = srcs + ["//tools/bazel:pytest_main.py"],
        main = "//tools/bazel:pytest_main.py",
        args = args + ["$(location %s)" % s for s in srcs],
        data = data + srcs,
        deps = deps + ["//tools/bazel:pytest_main_lib", "//tests:conftest"],
        env = env,
        size = size,
        tags = tags,
        python_version = "PY3",
        **kwargs
    )
