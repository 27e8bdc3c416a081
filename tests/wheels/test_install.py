"""pip installs a subset of the built wheels into a fresh venv, offline, side by side, and
uninstalls them without a trace.

The venv sees the system site-packages (torch, triton) and the system pip (`--without-pip`:
a venv's own bundled setuptools would shadow the newer one torch requires). Everything first-
party comes from the built wheels alone (`--no-index --find-links`). Scripts run with `-I`, so
neither the checkout nor Bazel's runfiles are importable inside the venv.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest

from sparse_mla.tests.wheels import known_values, wheelfiles

KNOWN_VALUES = os.path.join(wheelfiles.runfiles_root(), "tests/wheels/known_values.py")
NAMESPACES = wheelfiles.load_manifest(wheelfiles.manifests()[0])["namespaces"]


def run(cmd, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1", PIP_NO_INPUT="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def tree(root) -> set:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheels")
    links = base / "links"
    links.mkdir()
    for whl in wheelfiles.product_wheels() + [wheelfiles.fixture_wheel()]:
        shutil.copy(whl, links)
    env_dir = base / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env_dir)])
    python = str(env_dir / "bin" / "python")
    return python, str(links), str(env_dir), base


def pip(python, links, *args):
    return run([python, "-I", "-m", "pip", *args, "--no-index", "--find-links", links]
               if args[0] == "install" else [python, "-I", "-m", "pip", *args])


def installed(python) -> set:
    out = run([python, "-I", "-c",
               "import importlib.metadata as m; print('\\n'.join(sorted(d.metadata['Name'] "
               "for d in m.distributions() if d.metadata['Name'].startswith('sparse-mla'))))"])
    return set(out.split())


def test_subset_install_side_by_side_and_clean_uninstall(venv):
    python, links, env_dir, base = venv
    before = tree(env_dir)
    assert installed(python) == set(), "the system site already has sparse-mla wheels"

    # 1. the decode op alone: pip brings exactly the attention core and the shared layer
    pip(python, links, "install", "sparse-mla-flashmla-decode")
    assert installed(python) == {"sparse-mla-flashmla-decode", "sparse-mla-attention",
                                 "sparse-mla-common"}
    out = run([python, "-I", KNOWN_VALUES, "--absent", "sparse_mla.ops.cache_insert",
               "sparse_mla.ops.index_combine", "sparse_mla.ops.trtllm_decode",
               "sparse_mla.tests", "sparse_mla.tools"], cwd=base)
    assert f"from {env_dir}" in out, out

    # 2. more wheels beside it, sharing the namespace levels
    pip(python, links, "install", "sparse-mla-cache-insert", "sparse-mla-index-combine",
        "sparse-mla-trtllm-decode", "sparse-mla-test-fixture")
    run([python, "-I", "-c",
         "import sparse_mla.ops.cache_insert, sparse_mla.ops.index_combine, "
         "sparse_mla.ops.trtllm_decode, torch;"
         "assert hasattr(torch.ops.sparse_mla, 'quantize_insert_v4')"], cwd=base)

    # 3. the entry point as vLLM loads general plugins: by group, then call it
    out = run([python, "-I", "-c",
               "from importlib.metadata import entry_points\n"
               "eps = entry_points(group='vllm.general_plugins')\n"
               "assert [e.name for e in eps] == ['sparse_mla_fixture'], eps\n"
               "print(eps['sparse_mla_fixture'].load()())"], cwd=base)
    assert "fixture plugin registered; v4 cache row = 584 B" in out
    assert os.path.exists(os.path.join(env_dir, "bin", "sparse-mla-fixture"))

    # 4. removing one wheel leaves the others whole (no wheel owned a shared __init__.py)
    pip(python, links, "uninstall", "-y", "sparse-mla-cache-insert")
    run([python, "-I", KNOWN_VALUES, "--absent", "sparse_mla.ops.cache_insert"], cwd=base)

    # 5. uninstall everything: no file is left. pip (23.2.1 here) removes the directories
    # it recorded, not the namespace levels no RECORD owns: those may stay, empty.
    pip(python, links, "uninstall", "-y", "sparse-mla-flashmla-decode", "sparse-mla-attention",
        "sparse-mla-common", "sparse-mla-index-combine", "sparse-mla-trtllm-decode",
        "sparse-mla-test-fixture")
    assert installed(python) == set()
    left = tree(env_dir) - before
    left_files = [p for p in left if not os.path.isdir(os.path.join(env_dir, p))]
    assert not left_files, f"left behind: {sorted(left_files)}"
    site = os.path.relpath(run([python, "-I", "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"]).strip(), env_dir)
    namespace_dirs = {os.path.join(site, ns) for ns in NAMESPACES}
    assert left <= namespace_dirs, \
        f"non-namespace directories left: {sorted(left - namespace_dirs)}"


def test_known_values_check_can_fail(monkeypatch):
    """The script's checks are not vacuous: with a wrong expectation they fail (checkout)."""
    known_values.check_decode()
    known_values.check_prefill()
    monkeypatch.setattr(known_values, "softmax_expect",
                        lambda values, sink=None: (1.0, math.log(2)) if values else (0.0, math.inf))
    with pytest.raises(AssertionError, match="out"):
        known_values.check_decode()
    with pytest.raises(AssertionError, match="out"):
        known_values.check_prefill()
