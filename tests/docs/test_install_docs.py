"""Every install command the docs give runs as written, in a fresh directory and a fresh venv.

The commands are read from the docs themselves: each fenced block after MARK, in DOCS order,
runs under `bash -eu` in one temporary directory (later blocks may use what earlier ones made,
as a reader following the docs would). That directory stands in for the repository root:
`bazel-bin/wheels/` holds the wheels Bazel built as this test's data, and `./bazelw` is a stub
that accepts only `build` of wheel targets (Bazel cannot run inside a Bazel test; the real
build already happened). `python3` is the interpreter running this test (the one `./bazelw`
provisions with torch and triton). Outside `bazel test` there are no wheels: it skips.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import sparse_mla  # the package root: where README.md and docs/ lie
from sparse_mla.tests.wheels import wheelfiles

ROOT = pathlib.Path(sparse_mla.__file__).parent
DOCS = ["README.md", "docs/packaging.md", "docs/integrations.md", "docs/design.md"]
MARK = "<!-- install: tests/docs/test_install_docs.py runs this block -->"
BLOCK = re.compile(re.escape(MARK) + r"\n```bash\n(.*?)```", re.S)
# What counts as an install command: nothing of the kind may sit outside a marked block.
INSTALL = re.compile(r"pip install|-m venv|\bvirtualenv\b")

BAZELW_STUB = """#!/bin/sh
# Stand-in for ./bazelw: Bazel built //:wheels as the test's data (bazel-bin/wheels/).
[ "$1" = build ] || { echo "bazelw stub: only 'build' runs here, got: $*" >&2; exit 2; }
shift
for target in "$@"; do
  case "$target" in
    //:wheels) ;;
    *) echo "bazelw stub: unexpected target $target" >&2; exit 2;;
  esac
done
ls bazel-bin/wheels/*.whl >/dev/null
"""


def _text(doc: str) -> str:
    return (ROOT / doc).read_text(encoding="utf-8")


def install_blocks() -> list:
    return [(doc, block) for doc in DOCS for block in BLOCK.findall(_text(doc))]


def test_every_install_command_sits_in_a_marked_block():
    for doc in DOCS:
        text = _text(doc)
        rest = BLOCK.sub("", text)
        assert MARK not in rest, f"{doc}: a marker not followed by a ```bash block"
        stray = [line for line in rest.splitlines() if INSTALL.search(line)]
        assert not stray, f"{doc}: install commands outside a marked block: {stray}"
    assert len(install_blocks()) >= 2, "the docs lost their install blocks"


def test_the_marked_check_can_fail():
    """A stray command is found (the check above is not vacuous)."""
    text = f"{MARK}\n```bash\npip install x\n```\nthen run `pip install y`\n"
    rest = BLOCK.sub("", text)
    assert [line for line in rest.splitlines() if INSTALL.search(line)] == [
        "then run `pip install y`"]


def test_install_blocks_run_as_written(tmp_path):
    wheels = tmp_path / "bazel-bin" / "wheels"
    wheels.mkdir(parents=True)
    for whl in wheelfiles.product_wheels():
        shutil.copy(whl, wheels)
    (tmp_path / "bazelw").write_text(BAZELW_STUB)
    (tmp_path / "bazelw").chmod(0o755)
    shims = tmp_path / ".shims"
    shims.mkdir()
    (shims / "python3").symlink_to(sys.executable)
    # Neither the checkout nor Bazel's runfiles may be importable: the venv alone provides
    # sparse_mla, from the wheels.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PATH=f"{shims}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1", PIP_NO_INPUT="1")
    blocks = install_blocks()
    assert blocks, "the docs lost their install blocks"
    for doc, block in blocks:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, (f"{doc} block failed as written:\n{block}\n"
                                     f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}")
    venv_site = list(tmp_path.glob("*/lib/python3*/site-packages/sparse_mla"))
    assert venv_site, "no venv under the directory holds sparse_mla: the blocks installed nothing"
