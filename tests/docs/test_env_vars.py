"""The README's environment-variable table is complete and current.

It must name exactly the project's variables (`SPARSE_MLA_*`, and any off-prefix `SMLA_*`,
which must not exist) that the code reads anywhere in the tree, tests included; every other
variable it names must be read somewhere; and every variable product code (outside tests/)
reads must be in it, except Bazel's test protocol (`TEST_*`, `XML_OUTPUT_FILE`: Bazel sets
them, a user never does).

Reads are found in Python by syntax (`os.environ.get(X)`, `os.environ[X]`, `os.getenv(X)`,
`X in os.environ`, with X a string or a module-level string constant) and in shell scripts
by `$X` / `${X...}` of a variable the script does not assign itself. The scan reads the
source tree (found through README.md's real path), not Bazel's runfiles, so the target is
tagged `external` (never cached: a new read anywhere must fail it).
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess

import sparse_mla

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


def readme_table() -> set:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert rows, "README.md lost its environment-variable table"
    return {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`",
                                                        row.split(" | ")[0])}


def test_readme_names_exactly_the_project_variables_the_code_reads():
    reads = code_reads()
    ours = {name for name in reads if PROJECT.match(name)}
    documented = {name for name in readme_table() if PROJECT.match(name)}
    missing = {name: sorted(reads[name]) for name in ours - documented}
    assert not missing, f"read by the code, missing from README's table: {missing}"
    stale = documented - ours
    assert not stale, f"in README's table, read by no code: {sorted(stale)}"
    off_prefix = {name: sorted(reads[name]) for name in ours if not name.startswith("SPARSE_MLA_")}
    assert not off_prefix, f"project variables must be named SPARSE_MLA_*: {off_prefix}"


def test_readme_other_variables_are_read_and_product_reads_are_documented():
    reads = code_reads()
    table = readme_table()
    stale = {name for name in table if name not in reads}
    assert not stale, f"in README's table, read by no code: {sorted(stale)}"
    product = {name: sorted(files) for name, files in reads.items()
               if any(not f.startswith("tests/") for f in files)
               and not BAZEL_PROTOCOL.match(name) and name not in table}
    assert not product, f"read outside tests/, missing from README's table: {product}"


def test_the_scanners_find_reads_and_ignore_writes():
    py = ("import os\nENV = 'SPARSE_MLA_A'\nos.environ.get(ENV)\nos.environ['SPARSE_MLA_B']\n"
          "os.getenv('SPARSE_MLA_C', '')\n'SPARSE_MLA_D' in os.environ\n"
          "os.environ['SPARSE_MLA_W'] = '1'\nenv = dict(os.environ, SPARSE_MLA_X='1')\n")
    assert python_reads(py) == {"SPARSE_MLA_A", "SPARSE_MLA_B", "SPARSE_MLA_C", "SPARSE_MLA_D"}
    sh = 'out=${OUT:-/tmp}\nFOO=1\necho "$FOO $SPARSE_MLA_E ${PIPESTATUS[0]}"  # $NOT_CODE\n'
    assert shell_reads(sh) == {"OUT", "SPARSE_MLA_E"}
