"""The repository's Bazel target graph, read from its BUILD files by evaluating them as Python
with every rule and macro recorded instead of run (Starlark is close enough to Python for the
BUILD files here). Used to check what a wheel target can reach."""
from __future__ import annotations

import os
import pathlib

import sparse_mla

# The source tree (README.md is a real file there: under Bazel the runfiles link to it).
ROOT = pathlib.Path(os.path.realpath(
    pathlib.Path(sparse_mla.__file__).parent / "README.md")).parent
SKIP_DIRS = {".git", ".pyroot", "__pycache__"}
LABEL_ATTRS = ("srcs", "deps", "data", "lib", "wheels")


class _Package(dict):
    """A BUILD file's namespace: any name it does not define is a rule that records its call."""

    def __init__(self, package: str, targets: dict):
        super().__init__()
        self.package, self.targets = package, targets

    def __missing__(self, rule):
        def record(*args, **kwargs):
            if rule in ("load", "package", "exports_files", "licenses"):
                return None
            if rule == "glob":
                return []
            if "name" in kwargs:
                self.targets[f"//{self.package}:{kwargs['name']}"] = (rule, kwargs)
            return None
        return record


def load_targets(root: pathlib.Path = ROOT) -> dict:
    """``{label: (rule or macro name, its keyword arguments)}`` for every BUILD file."""
    targets: dict = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("bazel-")]
        if "BUILD" not in filenames:
            continue
        package = os.path.relpath(dirpath, root).replace(os.sep, "/")
        package = "" if package == "." else package
        path = pathlib.Path(dirpath) / "BUILD"
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"),
             {"True": True, "False": False, "None": None}, _Package(package, targets))
    return targets


def absolute(label: str, package: str) -> str:
    if label.startswith(":"):
        return f"//{package}{label}"
    if label.startswith("//"):
        return label if ":" in label else f"{label}:{label.rsplit('/', 1)[-1]}"
    if label.startswith("@"):
        return label
    return f"//{package}:{label}"       # a file of the package


def direct(targets: dict, label: str) -> list:
    """The labels (targets and files) ``label``'s label attributes name, made absolute."""
    if label not in targets:
        return []
    package = label[2:].split(":", 1)[0]
    _, kwargs = targets[label]
    out = []
    for attr in LABEL_ATTRS:
        value = kwargs.get(attr) or []
        out += [absolute(item, package) for item in ([value] if isinstance(value, str) else value)
                if isinstance(item, str)]
    return out


def reachable(targets: dict, start: str) -> set:
    """Every label ``start`` reaches through its label attributes (files included)."""
    seen, todo = set(), [start]
    while todo:
        label = todo.pop()
        if label not in seen:
            seen.add(label)
            todo += direct(targets, label)
    return seen


def wheel_targets(targets: dict) -> list:
    return sorted(label for label, (rule, _) in targets.items() if rule == "sparse_mla_wheel")
