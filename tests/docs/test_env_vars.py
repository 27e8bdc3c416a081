"""One registry of environment variables (ops/common/env.py), complete and rendered in the README.

The registry must declare exactly the project's variables (`SPARSE_MLA_*`, and any off-prefix
`SMLA_*`, which must not exist) that the code reads anywhere in the tree, tests included, with
the files that read them; every variable product code (outside tests/ and lab/) reads must be
declared, except Bazel's test protocol (`TEST_*`, `XML_OUTPUT_FILE`: Bazel sets them, a user
never does); and the README's environment-variable table must equal the registry's rendering.

Reads are found in Python by syntax (`os.environ.get(X)`, `os.environ[X]`, `os.getenv(X)`,
`env.getenv(X)`, `X in os.environ`, with X a string or a module-level string constant) and in
shell scripts by `$X` / `${X...}` of a variable the script does not assign itself. The scan
reads the source tree (found through README.md's real path), not Bazel's runfiles, so the
target is tagged `external` (never cached: a new read anywhere must fail it).
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess

import pytest

import sparse_mla
from sparse_mla.ops.common import env

ROOT = pathlib.Path(os.path.realpath(pathlib.Path(sparse_mla.__file__).parent / "README.md")).parent
SKIP_DIRS = {".git", ".pyroot", "__pycache__", ".whl"}
PROJECT = re.compile(r"^(SPARSE_MLA|SMLA)_[A-Z0-9_]+$")
BAZEL_PROTOCOL = re.compile(r"^(TEST_[A-Z_]+|XML_OUTPUT_FILE)$")
SHELL_BUILTINS = {"BASH_SOURCE", "PIPESTATUS", "RANDOM", "LINENO", "PWD", "OLDPWD", "SECONDS"}


def _files():
    """The tree's files: in a git checkout the ones git tracks and the untracked ones it does
    not ignore (a developer's ignored scratch scripts are not the project's), else all."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
             "--exclude-standard"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        listed = None
    if listed is not None:
        for rel in listed.decode().split("\0"):
            path = ROOT / rel
            if rel and path.is_file() and not SKIP_DIRS.intersection(path.parts):
                yield path
        return
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("bazel-")]
        for name in filenames:
            yield pathlib.Path(dirpath) / name


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def python_reads(source: str) -> set:
    tree = ast.parse(source)
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}

    def name_of(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return consts.get(node.id)
        return None

    found = set()
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") \
                    and _is_environ(f.value):
                arg = node.args[0]
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv") or (
                    isinstance(f, ast.Name) and f.id == "getenv"):
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and _is_environ(node.value):
            arg = node.slice
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 \
                and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _is_environ(node.comparators[0]):
            arg = node.left
        name = name_of(arg) if arg is not None else None
        if name:
            found.add(name)
    return found


def shell_reads(source: str) -> set:
    code = "\n".join(line.split("#", 1)[0] if not line.lstrip().startswith("#!") else ""
                     for line in source.splitlines())
    assigned = set(re.findall(r"(?:^|[\s;(])(?:export\s+|local\s+)?([A-Za-z_][A-Za-z0-9_]*)=",
                              code))
    used = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", code))
    return used - assigned - SHELL_BUILTINS


def code_reads() -> dict:
    """variable -> the files (relative to the root) that read it."""
    reads: dict = {}
    for path in _files():
        text = None
        if path.suffix == ".py":
            text = path.read_text(encoding="utf-8")
            names = python_reads(text)
        elif path.suffix == ".sh" or path.name in ("bazelw", "run") and path.parent.name in (
                ".ci", ROOT.name):
            text = path.read_text(encoding="utf-8")
            names = shell_reads(text)
        else:
            continue
        for name in names:
            reads.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return reads


def readme_table() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows, "README.md lost its environment-variable table"
    return "\n".join(rows) + "\n"


def test_readme_table_is_the_registry():
    assert readme_table() == env.readme_table(), (
        "README.md's environment-variable table differs from ops/common/env.py: paste "
        "`python3 -m sparse_mla.ops.common.env` over it")


def test_registry_declares_exactly_the_project_variables_the_code_reads():
    reads = code_reads()
    ours = {name for name in reads if PROJECT.match(name)}
    declared = set(env.BY_NAME)
    missing = {name: sorted(reads[name]) for name in ours - declared}
    assert not missing, f"read by the code, missing from ops/common/env.py: {missing}"
    off_prefix = {name: sorted(reads[name]) for name in ours if not name.startswith("SPARSE_MLA_")}
    assert not off_prefix, f"project variables must be named SPARSE_MLA_*: {off_prefix}"
    assert len(env.VARIABLES) == len(declared), "a variable is declared twice"


def test_every_declared_variable_is_read_by_its_declared_readers():
    reads = code_reads()
    wrong = {}
    for var in env.VARIABLES:
        actual = {f for f in reads.get(var.name, ()) if not f.startswith("lab/")
                  and (var.set_by == env.TEST or not f.startswith("tests/"))}
        if actual != set(var.readers):
            wrong[var.name] = {"declared": sorted(var.readers), "read by": sorted(actual)}
    assert not wrong, f"ops/common/env.py's readers differ from the code: {wrong}"
    assert all(f.startswith("tests/") for v in env.VARIABLES if v.set_by == env.TEST
               for f in v.readers), "a variable only the tests set is read by product code"


def test_product_reads_are_declared():
    product = {name: sorted(files) for name, files in code_reads().items()
               if any(not f.startswith(("tests/", "lab/")) for f in files)
               and not BAZEL_PROTOCOL.match(name) and name not in env.BY_NAME}
    assert not product, f"read outside tests/ and lab/, missing from ops/common/env.py: {product}"


def test_getenv_gives_the_declared_default(monkeypatch):
    monkeypatch.delenv("SPARSE_MLA_SM90", raising=False)
    assert env.getenv("SPARSE_MLA_SM90") == env.BY_NAME["SPARSE_MLA_SM90"].default == "1"
    monkeypatch.setenv("SPARSE_MLA_SM90", "0")
    assert env.getenv("SPARSE_MLA_SM90") == "0"
    with pytest.raises(KeyError):
        env.getenv("SPARSE_MLA_" + "NOT_DECLARED")     # built: the scan must not count it


def test_the_scanners_find_reads_and_ignore_writes():
    py = ("import os\nENV = 'SPARSE_MLA_A'\nos.environ.get(ENV)\nos.environ['SPARSE_MLA_B']\n"
          "env.getenv('SPARSE_MLA_F')\n"
          "os.getenv('SPARSE_MLA_C', '')\n'SPARSE_MLA_D' in os.environ\n"
          "os.environ['SPARSE_MLA_W'] = '1'\nenv = dict(os.environ, SPARSE_MLA_X='1')\n")
    assert python_reads(py) == {"SPARSE_MLA_A", "SPARSE_MLA_B", "SPARSE_MLA_C", "SPARSE_MLA_D",
                               "SPARSE_MLA_F"}
    sh = 'out=${OUT:-/tmp}\nFOO=1\necho "$FOO $SPARSE_MLA_E ${PIPESTATUS[0]}"  # $NOT_CODE\n'
    assert shell_reads(sh) == {"OUT", "SPARSE_MLA_E"}
