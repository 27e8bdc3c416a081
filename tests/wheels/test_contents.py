"""Every product wheel Bazel builds (//:wheels) and the entry-point fixture wheel: parseable,
self-consistent, and holding exactly its target's own closure.

"Exactly" is checked without trusting the rule: each wheel's files must lie under its own
package (no test file, tool, or other family's module), no file may be shipped by two wheels,
and every first-party module a shipped file imports (anywhere in it, lazily too) must be
shipped by the wheel or by a wheel it requires — so installing a wheel with its requirements
is complete, and nothing rides along that the import graph does not need.
"""
from __future__ import annotations

import ast
import os
import re
import sys

import pytest

from sparse_mla.tests.wheels import wheelfiles
from sparse_mla.tests.wheels.wheelfiles import read_wheel, record_digest

VERSION_PIN = re.compile(r"^(sparse-mla-[a-z0-9-]+)==([0-9][0-9a-z.]*)$")
# third-party modules imported at module level (import time) -> the requirement that ships them
# vllm: only the vLLM plugin's wheel, where it is the extra [vllm] (tools/bazel/versions.bzl);
# transformers: only the HF integration's wheel, where it is a requirement.
THIRD_PARTY = {"torch": "torch", "triton": "triton", "vllm": "vllm",
               "transformers": "transformers"}

PRODUCTS = {w.name: w for w in map(read_wheel, wheelfiles.product_wheels())}
FIXTURE = read_wheel(wheelfiles.fixture_wheel())
ALL = dict(PRODUCTS, **{FIXTURE.name: FIXTURE})
NAMESPACES = set(wheelfiles.load_manifest(wheelfiles.manifests()[0])["namespaces"])


def own_package(w) -> str:
    """The package a wheel owns: the longest common directory of its payload."""
    dirs = {p.rsplit("/", 1)[0] for p in w.payload}
    common = min(dirs, key=len)
    assert all(d == common or d.startswith(common + "/") for d in dirs), (w.name, dirs)
    return common


def first_party_requires(w) -> dict:
    out = {}
    for req in w.requires():
        m = VERSION_PIN.match(req)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def installed_closure(w) -> set:
    """Distribution names `pip install w` brings in from this project (w included)."""
    seen, todo = set(), [w.name]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += list(first_party_requires(ALL[name]))
    return seen


def module_of(path: str) -> str:
    mod = path[:-3].replace("/", ".")
    return mod[:-len(".__init__")] if mod.endswith(".__init__") else mod


def imports(path: str, source: bytes):
    """(module, top_level): every `sparse_mla.*` / third-party module a file imports; for
    `from A import b` both A and A.b (b may be a module). top_level: at import time."""
    tree = ast.parse(source)
    package = module_of(path) if path.endswith("__init__.py") else module_of(path).rsplit(".", 1)[0]
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names if a.name != "*"]
        for name in names:
            yield name, id(node) in top


def provided_modules(dists) -> set:
    mods = set()
    for d in dists:
        for path in ALL[d].payload:
            if path.endswith(".py"):
                mods.add(module_of(path))
    return mods | {n.replace("/", ".") for n in NAMESPACES}


@pytest.mark.parametrize("name", sorted(ALL))
def test_metadata_and_record_verify(name):
    w = ALL[name]
    version = wheelfiles.load_manifest(wheelfiles.manifests()[0])["version"]
    normalized = re.sub(r"[-_.]+", "_", name).lower()
    assert w.path.endswith(f"/{normalized}-{version}-py3-none-any.whl")
    assert w.dist_info == f"{normalized}-{version}.dist-info"
    assert w.metadata["Metadata-Version"] == "2.1" and w.metadata["Version"] == version
    assert name.startswith("sparse-mla-") and w.metadata["Summary"]
    assert (w.wheel["Wheel-Version"], w.wheel["Root-Is-Purelib"], w.wheel["Tag"]) == (
        "1.0", "true", "py3-none-any")
    assert len(w.names) == len(set(w.names))
    assert [row[0] for row in w.record] == w.names, "RECORD lists every entry, in order"
    assert w.record[-1] == [f"{w.dist_info}/RECORD", "", ""]
    for path, digest, size in w.record[:-1]:
        assert digest == record_digest(w.data[path]), path
        assert int(size) == len(w.data[path]), path
    for path in w.payload:
        if path.endswith(".py"):
            compile(w.data[path], path, "exec")
    # first-party requirements are pinned to this very version and exist
    for dist, pinned in first_party_requires(w).items():
        assert pinned == version and dist in PRODUCTS, (dist, pinned)


@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_product_wheel_holds_only_its_own_package(name):
    w = PRODUCTS[name]
    package = own_package(w)
    assert package.startswith("sparse_mla/") and package not in NAMESPACES
    for path in w.payload:
        parts = path.split("/")
        assert parts[1] not in ("tests", "tools"), f"{name} ships {path}"
        assert path.startswith(package + "/"), f"{name} ships {path} outside {package}"
    for ns in NAMESPACES:
        assert f"{ns}/__init__.py" not in w.payload, f"{name} owns namespace level {ns}"


def test_no_file_is_shipped_by_two_wheels():
    owner = {}
    for name, w in ALL.items():
        for path in w.payload:
            assert path not in owner, f"{path} is in {owner.get(path)} and {name}"
            owner[path] = name


def test_distribution_names_and_packages_are_distinct():
    packages = [own_package(w) for w in ALL.values()]
    assert len(set(packages)) == len(packages)


@pytest.mark.parametrize("name", sorted(ALL))
def test_imports_are_satisfied_by_the_wheel_and_its_requirements(name):
    w = ALL[name]
    available = provided_modules(installed_closure(w))
    needed_dists = set()
    missing = []
    for path in w.payload:
        if not path.endswith(".py"):
            continue
        for mod, top_level in imports(path, w.data[path]):
            root = mod.split(".")[0]
            if root == "sparse_mla":
                # `from A import b`: A must be a module; A.b may be an attribute of A
                if mod in available:
                    needed_dists |= {d for d in installed_closure(w)
                                     if module_of_in(mod, ALL[d])}
                elif not parent_is_module(mod, available):
                    missing.append(f"{path} imports {mod}")
            elif top_level and root not in sys.stdlib_module_names and root != "__future__":
                req = THIRD_PARTY.get(root)
                assert req is not None, f"{path}: import-time third-party import {root}"
                assert any(r.split(";")[0].startswith(req) for r in w.requires()), (
                    f"{name}: {path} imports {root} at import time; Requires-Dist lacks {req}")
    assert not missing, f"{name} with its requirements lacks: {missing}"
    # and no first-party requirement is idle
    for dist in first_party_requires(w):
        assert dist in needed_dists, f"{name} requires {dist} but imports nothing from it"


def module_of_in(mod: str, w) -> bool:
    return any(path.endswith(".py") and module_of(path) == mod for path in w.payload)


def parent_is_module(mod: str, available: set) -> bool:
    parent = mod.rsplit(".", 1)[0]
    return "." in mod and parent in available and parent.replace(".", "/") not in NAMESPACES


def test_decode_wheel_requires_exactly_the_shared_layer():
    w = PRODUCTS["sparse-mla-flashmla-decode"]
    assert set(first_party_requires(w)) == {"sparse-mla-attention", "sparse-mla-common"}
    assert "sparse_mla/ops/flashmla_decode/bench.py" not in w.payload  # it needs cache_insert
    assert installed_closure(w) == {"sparse-mla-flashmla-decode", "sparse-mla-attention",
                                    "sparse-mla-common"}


def test_no_wheel_ships_a_benchmark_module():
    """Every op family's bench.py (cases, the GPU comparisons) is a target of its own
    (``//ops/<family>:bench``), in no wheel."""
    families = {p.split("/")[2] for w in PRODUCTS.values() for p in w.payload
                if p.startswith("sparse_mla/ops/")}
    assert {"cache_insert", "index_combine", "trtllm_decode", "indexer"} <= families
    shipped = [(w.name, p) for w in ALL.values() for p in w.payload
               if p.rsplit("/", 1)[-1] == "bench.py"]
    assert not shipped, shipped


def test_fixture_wheel_entry_points_and_extras():
    w = FIXTURE
    text = w.data[f"{w.dist_info}/entry_points.txt"].decode()
    assert text == (
        "[console_scripts]\n"
        "sparse-mla-fixture = sparse_mla.tests.wheels.fixture.plugin:register\n"
        "\n"
        "[vllm.general_plugins]\n"
        "sparse_mla_fixture = sparse_mla.tests.wheels.fixture.plugin:register\n")
    assert w.metadata.get_all("Provides-Extra") == ["flashmla"]
    assert any(r.startswith("sgl-flash-mla") and r.endswith('extra == "flashmla"')
               for r in w.requires())
    assert sorted(w.payload) == ["sparse_mla/tests/wheels/fixture/__init__.py",
                                 "sparse_mla/tests/wheels/fixture/plugin.py"]
    for p in PRODUCTS.values():
        if p.name == "sparse-mla-integration-vllm":
            continue        # the plugin's one entry point: tests/integration/vllm checks it
        assert not any(n.endswith("entry_points.txt") for n in p.names), p.name


def test_checkout_namespace_levels_hold_no_code():
    """The checkout keeps `__init__.py` at namespace levels (Bazel, tools/pyroot.sh); the wheels
    leave them out. Both worlds behave alike only while those files hold no code."""
    root = wheelfiles.runfiles_root()
    checked = []
    for ns in sorted(NAMESPACES):
        path = os.path.join(root, ns[len("sparse_mla/"):] if "/" in ns else "", "__init__.py")
        if os.path.exists(path):
            with open(path, "rb") as f:
                body = ast.parse(f.read()).body
            docstring = body[:1] if body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) else []
            assert body == docstring, f"{path} holds code; {ns} is a namespace level"
            checked.append(ns)
    assert {"sparse_mla", "sparse_mla/ops"} <= set(checked), checked
