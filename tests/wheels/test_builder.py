"""The wheel builder (tools/bazel/wheel_builder.py) on hand-made manifests: what it lets into a
wheel, what it refuses, the metadata it writes, and its byte-for-byte reproducibility."""
from __future__ import annotations

import email.parser
import json
import os
import zipfile

import pytest

from sparse_mla.tests.wheels.wheelfiles import read_wheel, record_digest
from sparse_mla.tools.bazel import wheel_builder as wb


def make_tree(root, files: dict) -> dict:
    """Writes {import path: text} under ``root``; returns {import path: source path}."""
    out = {}
    for path, text in files.items():
        src = os.path.join(root, "src", path)
        os.makedirs(os.path.dirname(src), exist_ok=True)
        with open(src, "w", encoding="utf-8") as f:
            f.write(text)
        out[path] = src
    return out


def manifest(tmp_path, files, **kw) -> wb.Manifest:
    base = dict(distribution="sparse-mla-demo", version="1.2.3", summary="demo",
                packages=["sparse_mla/ops/demo"],
                namespaces=["sparse_mla", "sparse_mla/ops", "sparse_mla/tests"],
                requires_python=">=3.10")
    base.update(kw)
    return wb.Manifest(files=make_tree(str(tmp_path), files), **base)


DEMO = {
    "sparse_mla/__init__.py": '"""top docstring only"""\n',
    "sparse_mla/ops/__init__.py": "",
    "sparse_mla/ops/demo/__init__.py": "from sparse_mla.ops.demo.core import f\n",
    "sparse_mla/ops/demo/core.py": "def f():\n    return 1\n",
}


def test_payload_is_own_package_without_namespace_inits(tmp_path):
    m = manifest(tmp_path, DEMO)
    assert sorted(wb.plan_payload(m)) == ["sparse_mla/ops/demo/__init__.py",
                                          "sparse_mla/ops/demo/core.py"]


def test_dependency_wheels_files_are_not_copied(tmp_path):
    files = dict(DEMO, **{"sparse_mla/ops/common/checks.py": "X = 1\n"})
    m = manifest(tmp_path, files,
                 provided={"sparse_mla/ops/common/checks.py": "sparse-mla-common"})
    assert "sparse_mla/ops/common/checks.py" not in wb.plan_payload(m)


@pytest.mark.parametrize("stray", [
    "sparse_mla/tests/helpers.py",           # a test helper
    "sparse_mla/tools/harness.py",           # a tool
    "sparse_mla/ops/cache_insert/ops.py",    # another family's module
    "sparse_mla/ops/stray.py",               # a module at a namespace level
])
def test_stray_closure_file_fails_naming_it(tmp_path, stray):
    m = manifest(tmp_path, dict(DEMO, **{stray: "X = 1\n"}))
    with pytest.raises(wb.WheelContentError, match=stray.replace(".", r"\.")):
        wb.plan_payload(m)


def test_tests_package_ships_only_when_asked(tmp_path):
    files = {"sparse_mla/tests/fixture/__init__.py": "", "sparse_mla/tests/__init__.py": ""}
    with pytest.raises(wb.WheelContentError, match="sparse_mla/tests/fixture/__init__.py"):
        wb.plan_payload(manifest(tmp_path, files))
    asked = manifest(tmp_path, files, packages=["sparse_mla/tests/fixture"])
    assert list(wb.plan_payload(asked)) == ["sparse_mla/tests/fixture/__init__.py"]


@pytest.mark.parametrize("code", ["import os\n", '"""doc"""\nX = 1\n',
                                  "from pkgutil import extend_path\n"])
def test_namespace_init_with_code_fails(tmp_path, code):
    m = manifest(tmp_path, dict(DEMO, **{"sparse_mla/ops/__init__.py": code}))
    with pytest.raises(wb.WheelContentError, match="namespace package"):
        wb.plan_payload(m)


def test_namespace_init_may_hold_a_docstring_and_comments(tmp_path):
    m = manifest(tmp_path, dict(DEMO, **{"sparse_mla/ops/__init__.py": '# c\n"""doc"""\n# d\n'}))
    assert "sparse_mla/ops/__init__.py" not in wb.plan_payload(m)


@pytest.mark.parametrize("packages", [["sparse_mla/ops"], ["other/pkg"], []])
def test_owning_a_namespace_level_or_outside_fails(tmp_path, packages):
    with pytest.raises(wb.WheelContentError):
        wb.plan_payload(manifest(tmp_path, DEMO, packages=packages))


def test_absolute_or_parent_paths_fail(tmp_path):
    m = manifest(tmp_path, DEMO)
    m.files["sparse_mla/ops/demo/../../../etc/x.py"] = m.files["sparse_mla/ops/demo/core.py"]
    with pytest.raises(wb.WheelContentError, match="not relative"):
        wb.plan_payload(m)


def test_metadata_wheel_record_and_entry_points(tmp_path):
    m = manifest(tmp_path, DEMO, requires=["sparse-mla-common==1.2.3", "torch>=2.11,<3"],
                 extras={"flashmla": ["sgl-flash-mla>=1.0"]},
                 entry_points={"vllm.general_plugins": ["demo = sparse_mla.ops.demo.core:f"],
                               "console_scripts": ["b=sparse_mla.ops.demo.core:f",
                                                   "a = sparse_mla.ops.demo"]})
    out = str(tmp_path / wb.wheel_filename(m.distribution, m.version))
    assert out.endswith("sparse_mla_demo-1.2.3-py3-none-any.whl")
    wb.build(m, out)
    w = read_wheel(out)
    assert w.dist_info == "sparse_mla_demo-1.2.3.dist-info"
    assert (w.metadata["Metadata-Version"], w.name, w.metadata["Version"],
            w.metadata["Summary"], w.metadata["Requires-Python"]) == (
                "2.1", "sparse-mla-demo", "1.2.3", "demo", ">=3.10")
    assert w.requires() == ["sparse-mla-common==1.2.3", "torch>=2.11,<3",
                            'sgl-flash-mla>=1.0; extra == "flashmla"']
    assert w.metadata.get_all("Provides-Extra") == ["flashmla"]
    assert (w.wheel["Wheel-Version"], w.wheel["Root-Is-Purelib"], w.wheel["Tag"]) == (
        "1.0", "true", "py3-none-any")
    assert w.data[f"{w.dist_info}/entry_points.txt"].decode() == (
        "[console_scripts]\n"
        "a = sparse_mla.ops.demo\n"
        "b = sparse_mla.ops.demo.core:f\n"
        "\n"
        "[vllm.general_plugins]\n"
        "demo = sparse_mla.ops.demo.core:f\n")
    # RECORD: every entry once, RECORD itself last without a hash, hashes and sizes right
    rows = {row[0]: row for row in w.record}
    assert sorted(rows) == sorted(w.names) and len(w.record) == len(w.names)
    assert w.record[-1] == [f"{w.dist_info}/RECORD", "", ""]
    for path, digest, size in w.record[:-1]:
        assert digest == record_digest(w.data[path]) and int(size) == len(w.data[path]), path
    # payload first (sorted), dist-info after, RECORD last
    assert w.names[:2] == ["sparse_mla/ops/demo/__init__.py", "sparse_mla/ops/demo/core.py"]
    assert w.names[-1] == f"{w.dist_info}/RECORD"


def test_no_entry_points_file_without_entry_points(tmp_path):
    m = manifest(tmp_path, DEMO)
    out = str(tmp_path / wb.wheel_filename(m.distribution, m.version))
    assert not any(n.endswith("entry_points.txt") for n in wb.build(m, out))


@pytest.mark.parametrize("entry_points, match", [
    ({"g": ["no equals sign"]}, "expected 'name = module:attr'"),
    ({"g": ["a = m:f", "a = m:g"]}, "repeats a name"),
    ({"bad group!": ["a = m:f"]}, "group"),
])
def test_bad_entry_points_fail(entry_points, match):
    with pytest.raises(wb.WheelContentError, match=match):
        wb.entry_points_text(entry_points)


@pytest.mark.parametrize("summary", ["", "two\nlines"])
def test_summary_must_be_one_line(tmp_path, summary):
    with pytest.raises(wb.WheelContentError, match="summary"):
        wb.metadata_text(manifest(tmp_path, DEMO, summary=summary))


def test_bad_extra_name_fails(tmp_path):
    with pytest.raises(wb.WheelContentError, match="extra name"):
        wb.metadata_text(manifest(tmp_path, DEMO, extras={"Flash MLA": ["x"]}))


def test_reproducible_whatever_the_mtimes_and_umask(tmp_path):
    """Two builds from sources with different mtimes, under different umasks, in different
    directories: identical bytes; entries carry the zip epoch and mode 0644."""
    outs = []
    for i, umask in enumerate((0o022, 0o077)):
        m = manifest(tmp_path / f"run{i}", DEMO, entry_points={"g": ["a = m:f"]})
        for src in m.files.values():
            os.utime(src, (1_000_000 + 86_400 * 400 * i,) * 2)
        out = tmp_path / f"run{i}" / wb.wheel_filename(m.distribution, m.version)
        old = os.umask(umask)
        try:
            wb.build(m, str(out))
        finally:
            os.umask(old)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    with zipfile.ZipFile(tmp_path / "run0" / wb.wheel_filename("sparse-mla-demo", "1.2.3")) as zf:
        for info in zf.infolist():
            assert info.date_time == (1980, 1, 1, 0, 0, 0), info.filename
            assert info.external_attr >> 16 == 0o100644, info.filename
            assert not info.filename.startswith("/") and str(tmp_path) not in info.filename


def test_main_reads_manifest_and_checks_output_name(tmp_path, capsys):
    m = manifest(tmp_path, DEMO)
    raw = dict(m.__dict__)
    raw["files"] = [{"path": p, "src": s} for p, s in m.files.items()]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(raw))
    good = tmp_path / "sparse_mla_demo-1.2.3-py3-none-any.whl"
    assert wb.main(["--manifest", str(path), "--out", str(good)]) == 0
    assert email.parser.BytesParser().parsebytes(
        zipfile.ZipFile(good).read("sparse_mla_demo-1.2.3.dist-info/METADATA"))["Name"] == \
        "sparse-mla-demo"
    assert wb.main(["--manifest", str(path), "--out", str(tmp_path / "wrong.whl")]) == 1
    assert "should be named sparse_mla_demo-1.2.3-py3-none-any.whl" in capsys.readouterr().err
