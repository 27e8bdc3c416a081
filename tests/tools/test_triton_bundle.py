"""tools/triton_bundle.py: what the slim bundle drops and keeps, and the unpack round trip
(CPU, on a fake wheel tree: the real build is run by hand, lab/perf-log.md, "Triton 3.6-3.9")."""
import os
import tarfile

import pytest

from sparse_mla.tools import triton_bundle

KEEP = ["triton/__init__.py", "triton/_C/libtriton.so", "triton/backends/nvidia/compiler.py",
        "triton/backends/nvidia/lib/libdevice.10.bc", "triton/backends/nvidia/include/cuda.h"]
DROPPED = ["triton/backends/amd/compiler.py", "triton/_C/libproton.so",
           "triton/instrumentation/libGPUInstrumentationTestLib.so",
           "triton/profiler/__init__.py", "triton/backends/nvidia/lib/cupti/libcupti.so",
           "triton/backends/nvidia/bin/nvdisasm", "triton/backends/nvidia/bin/cuobjdump"]


def _fake_wheel(root, version):
    for rel in KEEP + DROPPED + ["triton/backends/nvidia/bin/ptxas",
                                 "triton/backends/nvidia/bin/ptxas-blackwell"]:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(rel)
    info = os.path.join(root, f"triton-{version}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[triton.backends]\namd = triton.backends.amd\nnvidia = triton.backends.nvidia\n")
    with open(os.path.join(info, "RECORD"), "w") as f:
        f.write("x")


@pytest.mark.parametrize("version,used,unused", [("3.8.0", "ptxas", "ptxas-blackwell"),
                                                 ("3.7.1", "ptxas", "ptxas-blackwell"),
                                                 ("3.9.0", "ptxas-blackwell", "ptxas")])
def test_slim_keeps_what_sm90_needs(tmp_path, version, used, unused):
    root = str(tmp_path)
    _fake_wheel(root, version)
    triton_bundle.slim(root, version, strip=False)
    for rel in KEEP + [f"triton/backends/nvidia/bin/{used}"]:
        assert os.path.exists(os.path.join(root, rel)), rel
    for rel in DROPPED + [f"triton/backends/nvidia/bin/{unused}"]:
        assert not os.path.exists(os.path.join(root, rel)), rel
    with open(os.path.join(root, f"triton-{version}.dist-info", "entry_points.txt")) as f:
        text = f.read()
    assert "amd" not in text and "nvidia = triton.backends.nvidia" in text


def test_unpack_round_trip(tmp_path):
    src = tmp_path / "site"
    (src / "triton").mkdir(parents=True)
    (src / "triton" / "__init__.py").write_text("__version__ = '9.9.9'\n")
    bundle = tmp_path / "triton-9.9.9-cp312-slim.tar.xz"
    with tarfile.open(bundle, "w:xz") as tar:
        tar.add(src / "triton", arcname="triton")
    dest = tmp_path / "out"
    assert triton_bundle.unpack(str(bundle), str(dest)) == str(dest)
    assert (dest / "triton" / "__init__.py").read_text().startswith("__version__")
    (dest / "triton" / "__init__.py").unlink()      # unpacked once: not again
    triton_bundle.unpack(str(bundle), str(dest))
    assert not (dest / "triton" / "__init__.py").exists()
