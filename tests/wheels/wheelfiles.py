"""Reading built wheels in tests: where Bazel put them, and their parsed metadata.

The wheels are data dependencies (//:wheels, the fixture wheel); outside `bazel test` there
are none, so these tests skip there with that reason (pytest on the GPU machine).
"""
from __future__ import annotations

import base64
import csv
import email.parser
import glob
import hashlib
import io
import json
import os
import zipfile
from dataclasses import dataclass

import pytest


def runfiles_root() -> str:
    if "TEST_SRCDIR" not in os.environ:
        pytest.skip("needs the wheels Bazel builds: run under `bazel test //tests/wheels/...`",
                    allow_module_level=True)
    return os.path.join(os.environ["TEST_SRCDIR"], os.environ["TEST_WORKSPACE"])


def product_wheels() -> list:
    paths = sorted(glob.glob(os.path.join(runfiles_root(), "wheels", "*.whl")))
    assert paths, "//:wheels produced no wheel in the runfiles"
    return paths


def fixture_wheel() -> str:
    paths = glob.glob(os.path.join(runfiles_root(), "tests/wheels/fixture/*.whl"))
    assert len(paths) == 1, paths
    return paths[0]


def manifests() -> list:
    paths = sorted(glob.glob(os.path.join(runfiles_root(), "**/*.manifest.json"),
                             recursive=True))
    assert paths, "no wheel manifests in the runfiles"
    return paths


def load_manifest(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def record_digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"=").decode()


@dataclass
class Wheel:
    path: str
    names: list          # archive entries in archive order
    data: dict           # archive path -> bytes
    dist_info: str       # the .dist-info directory
    metadata: "email.message.Message"
    wheel: "email.message.Message"
    record: list         # rows of RECORD

    @property
    def name(self) -> str:
        return self.metadata["Name"]

    @property
    def payload(self) -> list:
        return [n for n in self.names if not n.startswith(self.dist_info + "/")]

    def requires(self) -> list:
        return self.metadata.get_all("Requires-Dist") or []


def read_wheel(path: str) -> Wheel:
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        data = {n: zf.read(n) for n in names}
    dist_infos = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    assert len(dist_infos) == 1, f"{path}: dist-info directories {dist_infos}"
    dist_info = dist_infos.pop()
    parser = email.parser.BytesParser()
    metadata = parser.parsebytes(data[f"{dist_info}/METADATA"])
    wheel = parser.parsebytes(data[f"{dist_info}/WHEEL"])
    record = list(csv.reader(io.StringIO(data[f"{dist_info}/RECORD"].decode("utf-8"))))
    return Wheel(path, names, data, dist_info, metadata, wheel, record)
