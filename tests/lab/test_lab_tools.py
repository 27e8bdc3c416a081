"""lab/tools: every file is listed in lab/README.md, and every script at least parses (the GPU
ones cannot run here; their CPU-checkable parts have their own tests next to this file)."""
from __future__ import annotations

import py_compile
import re
import subprocess

import pytest

from sparse_mla.tests.lab.buildgraph import ROOT

TOOLS = ROOT / "lab" / "tools"
SCRIPTS = sorted(p.name for p in TOOLS.iterdir()
                 if p.suffix in (".py", ".sh") and p.name != "__init__.py")


def test_the_readme_lists_every_tool_and_no_other():
    text = (ROOT / "lab" / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w.]+\.(?:py|sh))` \|", text, re.M))
    assert listed == set(SCRIPTS), (
        f"missing from lab/README.md: {sorted(set(SCRIPTS) - listed)}; "
        f"listed but absent: {sorted(listed - set(SCRIPTS))}")


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n.endswith(".sh")])
def test_shell_script_parses(name):
    done = subprocess.run(["bash", "-n", str(TOOLS / name)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n.endswith(".py")])
def test_python_tool_compiles(name, tmp_path):
    py_compile.compile(str(TOOLS / name), cfile=str(tmp_path / "x.pyc"), doraise=True)
