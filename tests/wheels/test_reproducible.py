"""Rebuilding each wheel from the very manifest Bazel wrote, twice, elsewhere, from copies of
the sources with other mtimes and under another umask, gives Bazel's bytes each time.
(.ci/run also rebuilds every wheel in the downstream workspace, a second output base where
the sources sit under external/sparse_mla, and compares bytes: tests/downstream/run.sh.)"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from sparse_mla.tests.wheels import wheelfiles
from sparse_mla.tools.bazel import wheel_builder as wb

MANIFESTS = wheelfiles.manifests()


def test_every_product_wheel_has_its_manifest():
    names = {wheelfiles.load_manifest(m)["distribution"] for m in MANIFESTS}
    built = {wheelfiles.read_wheel(p).name for p in wheelfiles.product_wheels()}
    assert built <= names


@pytest.mark.parametrize("manifest", MANIFESTS, ids=os.path.basename)
def test_rebuild_is_byte_identical(manifest, tmp_path):
    raw = wheelfiles.load_manifest(manifest)
    filename = wb.wheel_filename(raw["distribution"], raw["version"])
    built = [p for p in wheelfiles.product_wheels() + [wheelfiles.fixture_wheel()]
             if os.path.basename(p) == filename]
    assert len(built) == 1, filename
    root = wheelfiles.runfiles_root()
    outs = []
    for run, (mtime, umask) in enumerate(((86_400, 0o022), (2_000_000_000, 0o077))):
        copy = dict(raw, files=[])
        for entry in raw["files"]:
            dst = tmp_path / f"run{run}" / "src" / entry["path"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(os.path.join(root, entry["src"]), dst)
            os.utime(dst, (mtime, mtime))
            copy["files"].append({"path": entry["path"], "src": str(dst)})
        path = tmp_path / f"run{run}" / "manifest.json"
        path.write_text(json.dumps(copy))
        out = tmp_path / f"run{run}" / filename
        old = os.umask(umask)
        try:
            assert wb.main(["--manifest", str(path), "--out", str(out)]) == 0
        finally:
            os.umask(old)
        outs.append(out.read_bytes())
    with open(built[0], "rb") as f:
        bazel_bytes = f.read()
    assert outs[0] == outs[1] == bazel_bytes
