"""Builds a minimal wheel of the vLLM plugin and the sparse_mla code it needs.

TEMPORARY (issue 44): until the `wheels` branch's Bazel wheel rule is on main, the end-to-end
test installs the plugin from this wheel, the way a user would (pip + its entry point). It
packs the `sparse_mla` package's Python files under `integration/vllm`, `backends` and `ops`
(plus the package root) from a checkout or Bazel runfiles tree, and declares the
`vllm.general_plugins` entry point `sparse_mla = sparse_mla.integration.vllm:register`.

    python build_test_wheel.py SPARSE_MLA_ROOT OUT_DIR   -> prints the wheel's path
"""
import base64
import hashlib
import os
import sys
import zipfile

NAME = "sparse_mla_vllm"
VERSION = "0.0.1"
PARTS = ("integration/vllm", "backends", "ops")
ENTRY_POINTS = "[vllm.general_plugins]\nsparse_mla = sparse_mla.integration.vllm:register\n"


def _files(root):
    yield "__init__.py"
    for part in PARTS:
        base = os.path.join(root, part)
        if not os.path.isdir(base):
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
            for name in sorted(filenames):
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, name), root)
    # Package markers of the parents of integration/vllm (namespace-free imports).
    for marker in ("integration/__init__.py",):
        if os.path.exists(os.path.join(root, marker)):
            yield marker


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build(root, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    wheel = os.path.join(out_dir, f"{NAME}-{VERSION}-py3-none-any.whl")
    dist = f"{NAME}-{VERSION}.dist-info"
    meta = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: sparse_mla-test\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
        f"{dist}/entry_points.txt": ENTRY_POINTS,
        f"{dist}/top_level.txt": "sparse_mla\n",
    }
    records = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel in sorted(set(_files(root))):
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
            arc = "sparse_mla/" + rel.replace(os.sep, "/")
            zf.writestr(arc, data)
            records.append(_record_line(arc, data))
        for arc, text in meta.items():
            zf.writestr(arc, text)
            records.append(_record_line(arc, text.encode()))
        records.append(f"{dist}/RECORD,,")
        zf.writestr(f"{dist}/RECORD", "\n".join(records) + "\n")
    return wheel


if __name__ == "__main__":
    print(build(sys.argv[1], sys.argv[2]))
