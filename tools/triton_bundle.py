"""Build a slim Triton bundle: one Triton version packed small enough to carry to a GPU machine
that has no package registry (the lent H100/H200 has only Triton 3.6, and a wheel of 190-290
MB is over what a call may carry), then run the GPU tests or benchmarks on it.

  python3 tools/triton_bundle.py 3.8.0 [--python 3.12] [--wheel PATH] [-o DIR]
      -> DIR/triton-3.8.0-cp312-slim.tar.xz   (3.8.0: about 50 MB)

On the GPU machine:
  TRITON_BUNDLE=path/triton-3.8.0-cp312-slim.tar.xz bash tools/gpu_check.sh tests/...
  or: eval "$(python3 tools/triton_bundle.py --unpack path.tar.xz)"  (sets PYTHONPATH)

What is dropped from the wheel: the AMD backend, CUPTI and the profiler / instrumentation
libraries (proton), nvdisasm / cuobjdump (SASS dumps only), the ptxas that sm_90 does not use
(Triton 3.8 compiles sm_90 with ``ptxas``, 3.9 with ``ptxas-blackwell``: its
``compiler.get_ptxas``), what only Triton's own tests use (``FileCheck``, the ``plugins`` test
libraries, the C++ ``include`` tree of 3.9) and every CUDA header but ``cuda.h`` (the only one
the launcher's C source includes, 3.6-3.9); ``libtriton.so`` loses its symbol tables
(``strip --strip-unneeded``), and the tar is compressed by xz with the x86 BCJ filter first
(machine code compresses better; Python's tarfile / lzma read it as any .tar.xz). So the
bundle compiles and runs CUDA kernels for sm_90 (and, up to 3.8, sm_80), without the
profiler: 3.7.1 42.2 MB, 3.9.0 48.8 MB (3.8.0: 48.0 MB before the last three drops).
The wheel comes from ``pip download`` (this machine needs the registry) or --wheel.
"""
from __future__ import annotations

import argparse
import glob
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

DROP = ["triton/backends/amd", "triton/_C/libproton.so", "triton/instrumentation",
        "triton/profiler", "triton/backends/nvidia/bin/nvdisasm",
        "triton/backends/nvidia/bin/cuobjdump", "triton/FileCheck", "triton/plugins",
        "triton/include"]
DROP_GLOBS = ["triton/backends/nvidia/lib/cupti*"]
HEADERS = "triton/backends/nvidia/include"
KEEP_HEADERS = {"cuda.h"}     # driver.c's only CUDA include (Triton 3.6-3.9)
# xz: the x86 BCJ filter, then LZMA2 at its strongest (libtriton.so and ptxas are most of it)
XZ_FILTERS = [{"id": lzma.FILTER_X86},
              {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]


def _version_tuple(version):
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def unused_ptxas(version):
    """The ptxas binary Triton ``version`` never runs for sm_90 (see module doc)."""
    return "ptxas" if _version_tuple(version) >= (3, 9) else "ptxas-blackwell"


def download(version, python, dest):
    tag = python.replace(".", "")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp",
                    "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_28_x86_64",
                    "-d", dest, f"triton=={version}"], check=True)
    wheels = glob.glob(os.path.join(dest, f"triton-{version}-cp{tag}-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one triton {version} cp{tag} wheel in {dest}, got {wheels}")
    return wheels[0]


def slim(root, version, strip=True):
    """Remove what the bundle does not need from the unpacked wheel at ``root`` (``strip``:
    also strip ``libtriton.so``'s symbol tables, with binutils' ``strip``)."""
    for rel in DROP + [f"triton/backends/nvidia/bin/{unused_ptxas(version)}"]:
        path = os.path.join(root, rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    for pattern in DROP_GLOBS:
        for path in glob.glob(os.path.join(root, pattern)):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    headers = os.path.join(root, HEADERS)
    if os.path.isdir(headers):
        for name in os.listdir(headers):
            if name not in KEEP_HEADERS:
                path = os.path.join(headers, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    if strip:
        subprocess.run(["strip", "--strip-unneeded",
                        os.path.join(root, "triton/_C/libtriton.so")], check=True)
    # the AMD backend's entry point would fail to import without its files
    for ep in glob.glob(os.path.join(root, "triton-*.dist-info/entry_points.txt")):
        with open(ep) as f:
            lines = [line for line in f if not re.match(r"\s*amd\s*=", line)]
        with open(ep, "w") as f:
            f.writelines(lines)
    # RECORD lists the dropped files: pip is never run on the bundle, but keep it honest
    for rec in glob.glob(os.path.join(root, "triton-*.dist-info/RECORD")):
        os.remove(rec)


def build(version, python, wheel, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    tag = python.replace(".", "")
    out = os.path.join(out_dir, f"triton-{version}-cp{tag}-slim.tar.xz")
    with tempfile.TemporaryDirectory() as tmp:
        wheel = wheel or download(version, python, tmp)
        root = os.path.join(tmp, "site")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
        for path, _, files in os.walk(root):    # zipfile drops the executable bits
            for name in files:
                if "/bin/" in os.path.join(path, name) + "/" or name.endswith(".so"):
                    os.chmod(os.path.join(path, name), 0o755)
        slim(root, version)
        with lzma.open(out, "wb", format=lzma.FORMAT_XZ, filters=XZ_FILTERS) as xz, \
                tarfile.open(fileobj=xz, mode="w|") as tar:
            for name in sorted(os.listdir(root)):
                tar.add(os.path.join(root, name), arcname=name)
    return out


def unpack(bundle, dest=None):
    """Unpack ``bundle`` (once per destination) and return the directory to put first on
    PYTHONPATH."""
    dest = dest or os.path.join(tempfile.gettempdir(),
                                os.path.basename(bundle).replace(".tar.xz", ""))
    marker = os.path.join(dest, ".unpacked")
    if not os.path.exists(marker):
        with tarfile.open(bundle, "r:xz") as tar:
            # "tar" keeps the executable bits ptxas needs (Python >= 3.12 asks for a filter)
            tar.extractall(dest, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
        open(marker, "w").close()
    return dest


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("version", nargs="?", help="Triton version to bundle, e.g. 3.8.0")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python (default 3.12)")
    p.add_argument("--wheel", help="use this wheel instead of downloading one")
    p.add_argument("-o", "--out", default=".", help="output directory")
    p.add_argument("--unpack", metavar="BUNDLE",
                   help="unpack BUNDLE and print the export line that puts it on PYTHONPATH")
    a = p.parse_args(argv)
    if a.unpack:
        site = unpack(a.unpack)
        print(f"export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}}")
        return
    if not a.version:
        p.error("give a Triton version (or --unpack BUNDLE)")
    out = build(a.version, a.python, a.wheel, a.out)
    print(f"{out}: {os.path.getsize(out) / 1e6:.1f} MB")


if __name__ == "__main__":
    main(sys.argv[1:])
