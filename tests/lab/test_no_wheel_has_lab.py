"""No wheel ships lab code: no wheel target reaches a target or file under lab/ (or tests/),
and no product package depends on the lab at all."""
from __future__ import annotations

import pathlib

from sparse_mla.tests.lab import buildgraph

LAB = ("//lab:", "//lab/", "//tests/")


def _in_lab(label: str) -> bool:
    return label.startswith(LAB)


def test_no_wheel_target_reaches_the_lab():
    targets = buildgraph.load_targets()
    wheels = buildgraph.wheel_targets(targets)
    assert len(wheels) >= 10, f"the BUILD reader found only {wheels}"
    product = [w for w in wheels if not w.startswith("//tests/")]
    bad = {w: sorted(x for x in buildgraph.reachable(targets, w) if _in_lab(x)) for w in product}
    assert not {w: x for w, x in bad.items() if x}, bad


def test_only_the_lab_and_tests_depend_on_the_lab():
    targets = buildgraph.load_targets()
    users = {label: [x for x in buildgraph.direct(targets, label)
                     if x.startswith(("//lab:", "//lab/"))]
             for label in targets if not _in_lab(label)}
    users = {label: names for label, names in users.items() if names}
    assert not users, f"product targets depending on lab/: {users}"


def test_the_check_sees_a_wheel_that_reaches_the_lab(tmp_path: pathlib.Path):
    (tmp_path / "ops" / "x").mkdir(parents=True)
    (tmp_path / "lab").mkdir()
    (tmp_path / "ops" / "x" / "BUILD").write_text(
        'load("//tools/bazel:wheel.bzl", "sparse_mla_wheel")\n'
        'py_library(name = "x", srcs = glob(["*.py"]), deps = [":y"])\n'
        'py_library(name = "y", deps = ["//lab"])\n'
        'sparse_mla_wheel(name = "wheel", lib = ":x", requires = ["torch"])\n')
    (tmp_path / "lab" / "BUILD").write_text('py_library(name = "lab", srcs = ["a.py"])\n')
    targets = buildgraph.load_targets(tmp_path)
    assert buildgraph.wheel_targets(targets) == ["//ops/x:wheel"]
    assert {"//lab:lab", "//lab:a.py"} <= buildgraph.reachable(targets, "//ops/x:wheel")
